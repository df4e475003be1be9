"""The phase memory model against the H200 probe committed in reports/ (a record of one real run:
scripts/probe_memory.py; each header gives GPU, versions, date, command and allocator settings):
four named configs and 32 configs drawn with a fixed seed, both variants, with and without AdamW
for the named ones, under two allocator settings; and the efficient variant alone under Run.recompute and
under Run.lean (its lean block: a different backward on CUDA, lean.fp32_grad), under expandable segments.

The claim, ±1%, is on max_memory_allocated / memory_allocated with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. There the caching allocator splits every block it
reuses, so what it counts is the requested bytes rounded to 512, which is what the walk models.
Under the default settings it splits a large-pool block only when more than 1 MiB would remain, and
a cached block handed out whole adds its slack to max_memory_allocated: those rows are held to ±3%,
and a miss there is an expected failure only when the allocator's own accounts explain it
(the walk matches its requested bytes, from the trace or the requested_bytes counter read in the
same run, within ±1%, and the allocated figure is above them).

Each figure is also checked against the allocator trace's live bytes (`trace`), ±1%: what the walk
models, allocation by allocation. A fresh GPU run of the same comparison is the `gpu` test below."""
import json
from pathlib import Path

import pytest

from llm_anatomy.calculator.memory import phases
from llm_anatomy import records
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.report import probes

ALL = (probes.memory_rows(probes.SPLIT) + probes.memory_rows(probes.DEFAULT) + probes.recompute_rows()
       + probes.lean_rows())
# the claim's bound on the allocator's own figure, per setting (DESIGN: relative, justified): ±1% under expandable
# segments, where the figure is the requested bytes rounded to 512; ±3% under the default allocator, whose
# cached blocks handed out whole add their slack (above)
TOL = {probes.SPLIT: 0.01, probes.DEFAULT: 0.03}
TRACE_TOL = probes.TRACE_TOL  # the goal, held against the allocator's requested bytes
# (the claim's names against each figure: the allocator under each setting, and the allocator's trace;
#  the calculator's key, the probe's phase, "allocated" at its end or its "peak")
FIGURES = (
    ({probes.SPLIT: "memory.allocated after forward (expandable segments)",
      probes.DEFAULT: "memory.allocated after forward (default allocator)",
      "trace": "memory.allocated after forward (allocator trace)"}, "forward_end", "forward", "allocated"),
    ({probes.SPLIT: "memory.peak in forward (expandable segments)",
      probes.DEFAULT: "memory.peak in forward (default allocator)",
      "trace": "memory.peak in forward (allocator trace)"}, "forward_peak", "forward", "peak"),
    ({probes.SPLIT: "memory.peak in backward (expandable segments)",
      probes.DEFAULT: "memory.peak in backward (default allocator)",
      "trace": "memory.peak in backward (allocator trace)"}, "backward_peak", "backward", "peak"),
    ({probes.SPLIT: "memory.allocated after backward (expandable segments)",
      probes.DEFAULT: "memory.allocated after backward (default allocator)",
      "trace": "memory.allocated after backward (allocator trace)"}, "backward_end", "backward", "allocated"),
    ({probes.SPLIT: "memory.allocated after the optimizer step (expandable segments)",
      probes.DEFAULT: "memory.allocated after the optimizer step (default allocator)",
      "trace": "memory.allocated after the optimizer step (allocator trace)"}, "optimizer_end", "optimizer",
     "allocated"))
# the peak reduction against each source and allocator setting; memory_reserved's range under each setting
REDUCTION = {
    ("allocator", probes.SPLIT): "memory.peak reduction (baseline / efficient, allocator, expandable segments)",
    ("allocator", probes.DEFAULT): "memory.peak reduction (baseline / efficient, allocator, default allocator)",
    ("trace", probes.SPLIT): "memory.peak reduction (baseline / efficient, trace, expandable segments)",
    ("trace", probes.DEFAULT): "memory.peak reduction (baseline / efficient, trace, default allocator)"}
RESERVED = {probes.SPLIT: "memory.reserved (expandable segments, the range's slack fitted on these configs)",
            probes.DEFAULT: "memory.reserved (default allocator, the range's slack fitted on these configs)"}


def _ids(r):
    return probes.row_id(r) + ("" if r.get("alloc", probes.SPLIT) == probes.SPLIT else "-default-alloc")


def _predicted(r):
    run = Run.from_record(r)
    return phases(ModelConfig(**r["cfg"]), run, r["variant"], r["optimizer"])


def _cases(trace: bool):
    out = [pytest.param(r, f, id=f"{_ids(r)}-{f[1]}") for r in ALL for f in FIGURES
           if f[2] in {p["name"] for p in r["phases"]} and (not trace or f[1] in r.get("trace", {}))]
    return out or [pytest.param(None, None, marks=pytest.mark.skip(reason="no memory probe rows committed: run "
                                                                   "scripts/probe_memory.py on an H200"))]


def check_phase(claims, row: dict, figure: tuple, pred: dict, measured: int, trace: dict | None,
                source: str, requested: int | None = None) -> str | None:
    """The claim on the allocator's figure (TOL: ±1% split, ±3% default). A miss raises, unless the allocator splits blocks
    only when more than 1 MiB would remain and its own accounts (the trace's requested bytes, or the
    requested_bytes counter) explain the miss: then the reason is returned, for the caller to xfail
    with once every figure is checked."""
    names, key, _, _ = figure
    config = _ids(row) + ("" if row["config"] in ("seed", "tiny-gqa", "anchor-1b") else str(row["cfg"]))
    try:
        claims.check(names[row.get("alloc", probes.SPLIT)], component="model", config=config,
                     variant=row["variant"], predicted=pred[key], measured=measured,
                     tolerance=TOL[row.get("alloc", probes.SPLIT)], device="cuda",
                     unit="B", note=source)
    except AssertionError:
        if row.get("alloc") == probes.SPLIT:
            raise
        for what, t in (("trace's requested bytes", (trace or {}).get(key)), ("requested_bytes counter", requested)):
            if probes.trace_accounts(pred[key], measured, t):
                return (f"{key}: the allocator's figure is {(measured - t) / 2**20:.2f} MiB above its {what}, which "
                        f"the walk is {(pred[key] - t) / t:+.3%} from")
        raise
    return None


@pytest.mark.parametrize("row,figure", _cases(trace=False))
def test_phase_matches_h200_probe(row, figure, claims):
    ph = {p["name"]: p for p in row["phases"]}
    slack = check_phase(claims, row, figure, _predicted(row), ph[figure[2]][figure[3]], row.get("trace"),
                        f"recorded H200 probe: {row['alloc']}", probes.requested(row, figure[2], figure[3]))
    if slack:
        pytest.xfail(slack)


@pytest.mark.parametrize("row,figure", _cases(trace=True))
def test_phase_matches_h200_allocator_trace(row, figure, claims):
    names, key = figure[0], figure[1]
    claims.check(names["trace"], component="model", config=_ids(row), variant=row["variant"],
                 predicted=_predicted(row)[key], measured=row["trace"][key], tolerance=TRACE_TOL, device="cuda",
                 unit="B", note="recorded H200 probe; requested bytes, no allocator slack")


def _pairs():
    by: dict[tuple, dict] = {}
    for r in ALL:
        by.setdefault((r["alloc"], r["config"], r["batch"], r["seq"], r["optimizer"], r.get("recompute", "none"),
                       json.dumps(r["cfg"], sort_keys=True)),
                      {})[r["variant"]] = r
    out = [pytest.param(v["baseline"], v["efficient"], id=_ids(v["baseline"]).replace("-baseline", ""))
           for v in by.values() if len(v) == 2]
    return out or [pytest.param(None, None, marks=pytest.mark.skip(reason="no memory probe rows committed"))]


def _peak(phases_or_trace: dict) -> int:
    """The step's peak, the larger of the forward and backward peaks, from the calculator's phases
    or a row's trace figures."""
    return max(phases_or_trace["forward_peak"] or 0, phases_or_trace["backward_peak"])


def _allocator_peak(r: dict) -> int:
    return max(p["peak"] for p in r["phases"] if p["name"] in ("forward", "backward"))


@pytest.mark.parametrize("base,eff", _pairs())
def test_peak_reduction_matches_prediction(base, eff, claims):
    """The full model's peak-memory reduction, baseline peak / efficient peak, measured on the H200
    against the calculator's ratio: TOL on the allocator's peaks (±1% split, ±3% default), ±1% on the trace's."""
    pred = _peak(_predicted(base)) / _peak(_predicted(eff))
    for source, measured, tol in (("allocator", _allocator_peak(base) / _allocator_peak(eff), TOL[base["alloc"]]),
                                  ("trace", _peak(base["trace"]) / _peak(eff["trace"]), TRACE_TOL)):
        claims.check(REDUCTION[source, base["alloc"]], component="model",
                     config=_ids(base).replace("-baseline", ""), variant="ratio", predicted=pred,
                     measured=measured, tolerance=tol, device="cuda", note="recorded H200 probe")


@pytest.mark.parametrize("row", [pytest.param(r, id=_ids(r)) for r in ALL] or [
    pytest.param(None, marks=pytest.mark.skip(reason="no memory probe rows committed"))])
def test_reserved_within_predicted_range(row, claims):
    """memory_reserved, the looser figure, at every phase of the probe's last step: within the
    calculator's range (calculator.memory.reserved), under both allocator settings. The range's slack
    was fitted on an earlier probe of these configs (docs/history.md); the step benchmarks below are the
    check out of sample."""
    pred = _predicted(row)
    for p in row["phases"]:
        claims.within(RESERVED[row["alloc"]],
                      low=pred["reserved_low"] if p["name"] != "init" else 0,
                      high=pred["reserved_high"], measured=p["reserved"], component="model",
                      config=f"{_ids(row)}-{p['name']}", variant=row["variant"], device="cuda", unit="B",
                      note="recorded H200 probe")


@pytest.mark.gpu
@pytest.mark.parametrize("variant,recompute,optimizer,lean", [
    ("baseline", "none", "adamw", False), ("efficient", "none", "adamw", False), ("efficient", "mlp", "adamw", False),
    ("efficient", "full", "adamw", False), ("efficient", "full", None, False), ("efficient", "none", "adamw", True),
    ("efficient", "none", None, True)])
def test_phases_on_this_gpu(variant, recompute, optimizer, lean, claims):
    """The same checks in this process, each recompute policy and the lean block too: strict under expandable
    segments (scripts/gpu_suite.sh sets them), the default allocator's explained slack an expected failure
    otherwise."""
    from llm_anatomy.measure.memory import measure_phases, splits_every_block, trace_phases

    cfg = ModelConfig(name="mem", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640, vocab=5000)
    run = Run(4, 512, recompute=recompute, lean=lean)
    row = dict(config="mem", batch=4, seq=512, variant=variant, optimizer=optimizer, recompute=recompute,
               cfg=cfg.to_dict(), alloc=probes.SPLIT if splits_every_block() else probes.DEFAULT,
               **(dict(lean=True) if lean else {}))
    phs = measure_phases(cfg, run, variant, optimizer=optimizer)
    row["phases"] = phs
    ph = {p["name"]: p for p in phs}
    trace = trace_phases(cfg, run, variant, optimizer)
    pred = phases(cfg, run, variant, optimizer)
    slack = []
    for figure in FIGURES:
        if figure[2] not in ph:  # no optimizer, no optimizer phase
            continue
        slack.append(check_phase(claims, row, figure, pred, ph[figure[2]][figure[3]], trace, "this GPU",
                                 probes.requested(row, figure[2], figure[3])))
        claims.check(figure[0]["trace"], component="model", config=_ids(row), variant=variant,
                     predicted=pred[figure[1]], measured=trace[figure[1]], tolerance=TRACE_TOL, device="cuda",
                     unit="B", note="this GPU; requested bytes")
    if any(slack):
        pytest.xfail("; ".join(m for m in slack if m))


# The step benchmarks (bench/step.py, committed under reports/h200/) record max_memory_allocated over
# 10 timed steps of configs the probe never ran: an independent check of the whole-step peak.
STEPS = {records.rel(p): v for p, v in probes.step_records()}


@pytest.mark.parametrize("rel", list(STEPS))
def test_step_peak_matches_committed_step_benchmarks(rel, claims):
    rec = json.loads((records.ROOT / rel).read_text())
    cfg, run = ModelConfig.from_name(rec["preset"]), Run.from_record(rec)
    ph = phases(cfg, run, STEPS[rel])  # no optimizer: bench/step.py times forward + backward
    pred = max(ph["forward_peak"] or 0, ph["backward_peak"])
    claims.within("memory.reserved of a fwd+bwd step (out of the fit's sample)", low=ph["reserved_low"],
                  high=ph["reserved_high"], measured=int(rec["reserved_mib"] * 2**20), component="model",
                  config=f"{rec['preset']}/B{run.batch}S{run.seq}", variant=STEPS[rel], device="cuda (recorded)",
                  unit="B", note=f"{rel}: bench/step.py")
    claims.check("memory.peak of a fwd+bwd step", component="model", config=f"{rec['preset']}/B{run.batch}S{run.seq}",
                 variant=STEPS[rel], predicted=pred, measured=int(rec["peak_mib"] * 2**20), tolerance=TOL[probes.DEFAULT],
                 device="cuda (recorded)", unit="B", note=f"{rel}: {rec.get('gpu', 'H200')}, bench/step.py")


OOM_TESTS = """
import torch
from conftest import _NEED


def test_predicted_to_fit(request):
    request.node.stash[_NEED] = dict(config="seed B2S64 amp", variant="baseline", need=1000, free=5000, total=8000)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_undeclared():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


def test_other_error():
    raise ValueError("not an OOM")
"""


def test_an_unpredicted_oom_is_a_failed_claim_not_a_crash(tmp_path):
    """conftest's hook: a torch.OutOfMemoryError in a test becomes a failed claims row (the
    prediction beside the free memory, when the test declared one through gpu_fits), the run goes
    on to the next test, and other errors are left alone."""
    import shutil
    import subprocess
    import sys

    import os

    root = Path(__file__).parent.parent
    shutil.copy(root / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_oom.py").write_text(OOM_TESTS)
    # the copied conftest imports the repo's validations package (its GPU clock and slowdown hooks)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--claims-report",
                        str(tmp_path / "claims.json")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 1 and "3 failed" in r.stdout, r.stdout[-1500:]
    assert "unpredicted OOM: CUDA out of memory. Tried to allocate 2.00 GiB; the calculator predicted" in r.stdout
    rows = {row["test"].split("::")[1]: row for row in json.loads((tmp_path / "claims.json").read_text())["rows"]}
    assert set(rows) == {"test_predicted_to_fit", "test_undeclared"}
    assert rows["test_predicted_to_fit"]["predicted"] == 1000 and rows["test_predicted_to_fit"]["measured"] == 5000
    assert not rows["test_predicted_to_fit"]["passed"] and not rows["test_undeclared"]["passed"]
    assert "use the gpu_fits fixture" in rows["test_undeclared"]["note"]


def test_a_predicted_oom_is_skipped_with_the_prediction(gpu_fits, monkeypatch):
    """gpu_fits skips before building anything when the calculator's peak exceeds the free memory
    (mem_get_info faked to a 16 GiB card with 10 GiB free), and lets a step that fits through."""
    import torch

    from llm_anatomy.config import PRESETS

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * 2**30, 16 * 2**30))
    need = gpu_fits(PRESETS["seed"], Run(2, 256), "efficient")
    assert 0 < need < 10 * 2**30
    with pytest.raises(pytest.skip.Exception, match=r"predicted OOM: the step needs [0-9.]+ GiB .* 10.00 GiB free "
                                                    r"of 16.00"):
        gpu_fits(PRESETS["seed"], Run(16, 4096), "baseline")
