"""The phase memory model against the H200 probe committed in reports/ (a record of a real run:
scripts/probe_memory.py; its header gives GPU, versions, date and command). A fresh GPU run of the
same comparison is the `gpu`-marked test below."""
import json
from pathlib import Path

import pytest

from anatomy.calculator.memory import phases
from anatomy.config import ModelConfig, Run

PROBE = Path(__file__).parent.parent / "reports/h200/session4b/probe_memory.json"
ALL = [r for r in json.loads(PROBE.read_text())["rows"] if "error" not in r]
ROWS = [r for r in ALL if r["optimizer"] is None]
TOL = 0.03  # the claim's bound for physical memory (DESIGN: relative, justified; the goal is 1%)


def _ids(r):
    return f"{r['config']}-B{r['batch']}S{r['seq']}-{r['variant']}" + (f"-{r['optimizer']}" if r["optimizer"] else "")


def _predicted(r):
    return phases(ModelConfig(**r["cfg"]), Run(r["batch"], r["seq"]), r["variant"], r["optimizer"])


def _known(rows, misses: dict):
    """Rows whose miss is known and explained: strict xfail, so a fix that brings one within the
    tolerance turns XPASS into a failure and the mark must come off."""
    return [pytest.param(r, id=_ids(r), marks=pytest.mark.xfail(strict=True, reason=misses[_ids(r)]))
            if _ids(r) in misses else pytest.param(r, id=_ids(r)) for r in rows]


# The first case of the probe's process carries a constant ~69 MB in every phase (forward end -2.7%,
# backward end -11.9%): one-time CUDA allocations of the process's first steps, not in its baseline.
_FIRST = {"seed-B4S1024-baseline-adamw": "first case in the probe process: +69 MB in every phase"}
_BWD_MISSES = {
    # Started from the measured forward end, the walk is short at its peak stage by a fixed amount:
    # 11 MiB for both seed runs, 5.2 MiB for tiny-gqa, 0 for anchor-1b (the probe's last case). A CUDA
    # allocation made once inside backward (a workspace, suspected), not yet attributed.
    "seed-B4S1024-efficient": "a fixed ~11 MiB CUDA allocation inside backward, unattributed (-3.0%)",
    "tiny-gqa-B4S512-efficient": "a fixed ~5 MiB CUDA allocation inside backward, unattributed (-9.0%)",
    "tiny-gqa-B4S512-efficient-adamw": "a fixed ~5 MiB CUDA allocation inside backward, unattributed (-9.6%)",
}


@pytest.mark.parametrize("row", ROWS, ids=_ids)
def test_forward_end_matches_h200_probe(row, claims):
    ph = {p["name"]: p for p in row["phases"]}
    pred = _predicted(row)
    claims.check("memory.allocated after forward", component="model", config=_ids(row), variant=row["variant"],
                 predicted=pred["forward_end"], measured=ph["forward"]["allocated"], tolerance=TOL, device="cuda",
                 unit="B", note=f"recorded H200 probe: {PROBE.name}")


@pytest.mark.parametrize("row", [r for r in ROWS if r["variant"] == "baseline"], ids=_ids)
def test_forward_peak_matches_h200_probe_baseline(row, claims):
    ph = {p["name"]: p for p in row["phases"]}
    claims.check("memory.peak in forward", component="model", config=_ids(row), variant="baseline",
                 predicted=_predicted(row)["forward_peak"], measured=ph["forward"]["peak"], tolerance=TOL,
                 device="cuda", unit="B", note=f"recorded H200 probe: {PROBE.name}")


@pytest.mark.parametrize("row", _known([r for r in ALL if r["variant"] == "efficient"], {
    "tiny-gqa-B4S512-efficient-adamw": "the -4.7% its forward end already has on CUDA (unattributed)"}))
def test_forward_peak_matches_h200_probe_efficient(row, claims):
    """Liger's fused CE transients: the norm output, loss_1d, one logits chunk and, under autocast,
    two bf16 casts of the head weight (memory._liger_forward_transient)."""
    ph = {p["name"]: p for p in row["phases"]}
    claims.check("memory.peak in forward", component="model", config=_ids(row), variant="efficient",
                 predicted=_predicted(row)["forward_peak"], measured=ph["forward"]["peak"], tolerance=TOL,
                 device="cuda", unit="B", note=f"recorded H200 probe: {PROBE.name}")


@pytest.mark.parametrize("row", _known(ALL, _BWD_MISSES))
def test_backward_peak_matches_h200_probe(row, claims):
    ph = {p["name"]: p for p in row["phases"]}
    pred = _predicted(row)
    claims.check("memory.peak in backward", component="model", config=_ids(row), variant=row["variant"],
                 predicted=pred["backward_peak"], measured=ph["backward"]["peak"], tolerance=TOL, device="cuda",
                 unit="B", note=f"recorded H200 probe: {PROBE.name}; predicted at {pred['backward_peak_at']}")


# After backward the efficient model holds 1.9-10 MiB more than parameters + gradients on the H200
# (10 MiB at B4S1024, 5.3 MiB at B2S4096, 1.9 MiB for tiny-gqa; none on CPU): not yet attributed.
_EFF_END = "efficient: 2-10 MiB beyond parameters + gradients after backward on CUDA, unattributed"
_END_MISSES = {**_FIRST, **{k: _EFF_END for k in ("tiny-gqa-B4S512-efficient", "tiny-gqa-B4S512-efficient-adamw",
                                                  "seed-B4S1024-efficient", "seed-B4S1024-efficient-adamw")}}


@pytest.mark.parametrize("row", _known(ALL, _END_MISSES))
def test_phase_ends_match_h200_probe(row, claims):
    """After backward: parameters + gradients (+ optimizer state); after the step: the gradients gone."""
    ph = {p["name"]: p for p in row["phases"]}
    pred = _predicted(row)
    for phase, key in (("backward", "backward_end"), ("optimizer", "optimizer_end")):
        if phase in ph:
            claims.check(f"memory.allocated after {phase}", component="model", config=_ids(row),
                         variant=row["variant"], predicted=pred[key], measured=ph[phase]["allocated"], tolerance=TOL,
                         device="cuda", unit="B", note=f"recorded H200 probe: {PROBE.name}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_phases_on_this_gpu(variant, claims):
    from anatomy.measure.memory import measure_phases

    cfg = ModelConfig(name="mem", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640, vocab=5000)
    run = Run(4, 512)
    ph = {p["name"]: p for p in measure_phases(cfg, run, variant, optimizer=None)}
    pred = phases(cfg, run, variant)
    claims.check("memory.allocated after forward", component="model", config="mem-B4S512", variant=variant,
                 predicted=pred["forward_end"], measured=ph["forward"]["allocated"], tolerance=TOL, device="cuda",
                 unit="B")
    claims.check("memory.peak in backward", component="model", config="mem-B4S512", variant=variant,
                 predicted=pred["backward_peak"], measured=ph["backward"]["peak"], tolerance=TOL, device="cuda",
                 unit="B", note=f"predicted at {pred['backward_peak_at']}")
    if pred["forward_peak"] is not None:
        claims.check("memory.peak in forward", component="model", config="mem-B4S512", variant=variant,
                     predicted=pred["forward_peak"], measured=ph["forward"]["peak"], tolerance=TOL, device="cuda",
                     unit="B")


# Drawn GPU configs (scripts/probe_memory.py --hypothesis N --seed S), once an H200 session has run it:
# every row is compared; until then this collects nothing and pytest reports the empty set as a skip.
HYP_ROWS = [r for f in sorted(PROBE.parent.parent.glob("*/probe_memory_hypothesis.json"))
            for r in json.loads(f.read_text())["rows"] if "error" not in r]


@pytest.mark.parametrize("row", HYP_ROWS, ids=_ids)
def test_backward_peak_matches_h200_probe_hypothesis(row, claims):
    ph = {p["name"]: p for p in row["phases"]}
    pred = _predicted(row)
    claims.check("memory.peak in backward", component="model", config=_ids(row) + str(row["cfg"]),
                 variant=row["variant"], predicted=pred["backward_peak"], measured=ph["backward"]["peak"],
                 tolerance=TOL, device="cuda", unit="B", note=f"drawn config; predicted at {pred['backward_peak_at']}")


# The step benchmarks (bench/step.py, committed under reports/h200/) record max_memory_allocated over
# 10 timed steps of configs the probe never ran: an independent check of the whole-step peak.
STEPS = {"session1/step-seed-efficient.json": "efficient", "session3/step-seed-efficient.json": "efficient",
         "session1/step-1b-efficient.json": "efficient", "session1/step-seed-baseline.json": "baseline"}
_STEP_MISSES: dict[str, str] = {}  # (seed baseline at S=4096 was one until the CUDA softmax tmp)


@pytest.mark.parametrize("rel", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=_STEP_MISSES[r]))
                                 if r in _STEP_MISSES else r for r in STEPS])
def test_step_peak_matches_committed_step_benchmarks(rel, claims):
    rec = json.loads((PROBE.parent.parent / rel).read_text())
    cfg, run = ModelConfig.from_name(rec["preset"]), Run(rec["batch"], rec["seq"], "amp")
    ph = phases(cfg, run, STEPS[rel])  # no optimizer: bench/step.py times forward + backward
    pred = max(ph["forward_peak"] or 0, ph["backward_peak"])
    claims.check("memory.peak of a fwd+bwd step", component="model", config=f"{rec['preset']}/B{run.batch}S{run.seq}",
                 variant=STEPS[rel], predicted=pred, measured=int(rec["peak_mib"] * 2**20), tolerance=TOL,
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

    shutil.copy(Path(__file__).parent.parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_oom.py").write_text(OOM_TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--claims-report",
                        str(tmp_path / "claims.json")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
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

    from anatomy.config import PRESETS

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * 2**30, 16 * 2**30))
    need = gpu_fits(PRESETS["seed"], Run(2, 256), "efficient")
    assert 0 < need < 10 * 2**30
    with pytest.raises(pytest.skip.Exception, match=r"predicted OOM: the step needs [0-9.]+ GiB .* 10.00 GiB free "
                                                    r"of 16.00"):
        gpu_fits(PRESETS["seed"], Run(16, 4096), "baseline")
