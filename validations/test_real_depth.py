"""Real-depth claims: the user's own training loop (scripts/probe_timing.py --user-loop) against estimate_time.

The rows are the out-of-sample cases of llm_anatomy/real_depth.py (12-32 layers, 0.5-8 B parameters, drawn
with a seed chosen after the timing model's code was final) and the named real presets, each run as a user
writes the loop (fused AdamW, bf16 autocast over fp32 weights, steps back to back). Each committed run
(llm_anatomy.records.REAL_DEPTH_RUNS: one freshly started H200 each) is compared with the profile `anatomy
calibrate` measured first in that run (calibrated.json beside the record); a run whose calibrate failed falls
back to the packaged profile (llm_anatomy/calculator/profiles/h200.json, another machine's) and every claim's note
says which. Known misses: validations/known_misses.json. The claims:
  time.real_depth.gpu.forward_backward, time.real_depth.gpu.step   kernel time within ±10%, every row
  time.real_depth.step        the wall-clock step within ±10% where the model calls the row GPU-bound
                              (GPU busy >= 90%); a host-bound row is reported with its bound, not claimed
  time.real_depth.component.forward / .backward   per component within ±15% (rows with a components pass)
Without a committed record every claim skips, naming the command that makes it. The CPU tests below check
the draw and the bookkeeping.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from llm_anatomy import real_depth, records
from llm_anatomy.calculator import param_count
from validations import known_misses
from validations.real_depth import real_depth_cases

MISSING = ("no committed user-loop record (reports/h200/user-loop/machine-N/real-depth.json): run `ONLY=real-depth "
           "REAL_DEPTH_SEED=<new> bash scripts/gpu_records.sh` on a fresh H200 and commit its real-depth.json, "
           "calibrated.json and env.json")
WALL_TEST = "validations/test_real_depth.py::test_real_depth_wall_step_within_10pct_when_gpu_bound"
KERNEL_TEST = "validations/test_real_depth.py::test_real_depth_kernel_time_within_10pct"
COMPONENT_TEST = "validations/test_real_depth.py::test_real_depth_component_within_15pct"


def _run(record: Path) -> tuple[str, str, list[dict]]:
    """(profile for estimate_time, the claims' note, the rows that ran) of one committed run: the same-run
    profile where the record names it and it is committed beside it, else the packaged one."""
    head = json.loads(record.read_text())
    prof = record.with_name("calibrated.json")
    machine = record.parent.name
    if prof.is_file() and head.get("profile") == prof.name:
        gpu, note = str(prof), f"{machine}, same-run profile (calibrated.json)"
    else:
        gpu, note = "h200-measured", (f"{machine}, packaged profile from another machine, not same-run (record: "
                                      f"{head.get('profile', 'no profile')})")
    rows = [dict(r, id=f"{machine}-{r['id']}", gpu=gpu, note=note) for r in head["rows"] if "error" not in r]
    return gpu, note, rows


RUNS = [_run(r) for r in records.REAL_DEPTH_RUNS if r.is_file()]
ROWS = [r for _, _, rows in RUNS for r in rows]
KERNEL_PARAMS = ([known_misses.param(KERNEL_TEST, f"{r['id']}-{what}", r, what) for r in ROWS
                  for what in ("forward_backward", "step")] or [pytest.param(None, None, id="no-record")])
WALL_PARAMS = [known_misses.param(WALL_TEST, r["id"], r) for r in ROWS] or [pytest.param(None, id="no-record")]
COMP_PARAMS = [known_misses.param(COMPONENT_TEST, f"{key.replace(' ', '-')}-{r['id']}", r, key) for r in ROWS
               if r.get("components")
               for key in real_depth.row_errors(r, r["gpu"]) if key.split()[-1] in ("forward", "backward")
               and not key.startswith("GPU")] or [pytest.param(None, None, id="no-record")]


def _config(r: dict) -> str:
    return f"{r['id']} ({r['kind']})"


def _check(claims, r: dict, what: str) -> None:
    c = real_depth.claim(r, what, r["gpu"], r["note"])
    if isinstance(c, str):
        pytest.skip(c)
    claims.check(c["claim"], component="step", config=_config(r), variant=r["variant"], predicted=c["predicted"],
                 measured=c["measured"], tolerance=c["tolerance"], device="cuda (recorded)", unit="ms", note=c["note"])


@pytest.mark.parametrize("r, what", KERNEL_PARAMS)
def test_real_depth_kernel_time_within_10pct(r, what, claims):
    if r is None:
        pytest.skip(MISSING)
    _check(claims, r, what)


@pytest.mark.parametrize("r", WALL_PARAMS)
def test_real_depth_wall_step_within_10pct_when_gpu_bound(r, claims):
    """Where the model calls the row host-bound it is reported with its bound, not claimed (a skip)."""
    if r is None:
        pytest.skip(MISSING)
    _check(claims, r, "wall")


@pytest.mark.parametrize("r, key", COMP_PARAMS)
def test_real_depth_component_within_15pct(r, key, claims):
    if r is None:
        pytest.skip(MISSING)
    comp, phase = key.split()
    res = real_depth.predicted(r, r["gpu"])
    pred, meas = res["components"][comp][f"{phase}_s"] * 1e3, r["components"][phase][comp]["ms"]
    if phase == "forward":
        claims.check("time.real_depth.component.forward", component=comp, config=_config(r), variant=r["variant"],
                     predicted=pred, measured=meas, tolerance=0.15, device="cuda (recorded)", unit="ms",
                     note=r["note"])
    else:
        claims.check("time.real_depth.component.backward", component=comp, config=_config(r), variant=r["variant"],
                     predicted=pred, measured=meas, tolerance=0.15, device="cuda (recorded)", unit="ms",
                     note=r["note"])


def test_every_known_miss_names_a_case():
    assert not known_misses.unused(WALL_TEST, [r["id"] for r in ROWS])
    assert not known_misses.unused(KERNEL_TEST, [p.id for p in KERNEL_PARAMS])
    assert not known_misses.unused(COMPONENT_TEST, [p.id for p in COMP_PARAMS])


def test_real_depth_error_table():
    """Not a claim: MAPE and worst case per quantity of each run, for its own profile, the packaged one and
    the datasheet (python3 -m llm_anatomy.real_depth RECORD prints the same table)."""
    if not RUNS:
        pytest.skip(MISSING)
    for gpu, note, rows in RUNS:
        table = real_depth.markdown(rows, {"this run's": gpu, "packaged": "h200-measured", "datasheet": "h200-sxm"})
        assert table.count("\n") >= 4
        print(note, table, sep="\n")


# ---- CPU: the draw and the bookkeeping -----------------------------------------------------------------
def test_draw_is_seeded_distinct_and_in_range(monkeypatch):
    a, b = real_depth.draw(6, seed=11), real_depth.draw(6, seed=11)
    assert a == b and len({c.id for c in a}) == 6 and real_depth.draw(6, seed=12) != a
    for c in a:
        assert real_depth.LAYERS[0] <= c.cfg.layers <= real_depth.LAYERS[1]
        assert real_depth.PARAMS[0] <= param_count(c.cfg) <= real_depth.PARAMS[1]
        assert real_depth.peak_bytes(*c) <= real_depth.HEADROOM * real_depth.H200_CAPACITY
        assert c.run.recompute == "none" or c.variant == "efficient"
    monkeypatch.setenv("ANATOMY_DRAW_SEED", "7")
    assert real_depth.draw_seed() == 7
    monkeypatch.setenv("ANATOMY_DRAW_SEED", "seven")
    with pytest.raises(ValueError, match="ANATOMY_DRAW_SEED"):
        real_depth.draw_seed()


def test_a_32_case_draw_spans_the_space():
    """GQA and MHA, tied and untied, vocabs that are not multiples of 8, sequences 1k-16k, both variants,
    and MLP recompute where a plain step does not fit."""
    cs = real_depth.draw(32, seed=real_depth.DEFAULT_SEED)
    assert len(cs) == 32
    assert {c.cfg.kv_heads < c.cfg.heads for c in cs} == {True, False}
    assert {c.cfg.tie_embeddings for c in cs} == {True, False}
    assert any(c.cfg.vocab % 8 for c in cs) and any(c.cfg.vocab % 8 == 0 for c in cs)
    assert {c.run.seq for c in cs} >= {1024, 4096, 16384} and {c.variant for c in cs} == set(real_depth.VARIANTS)
    assert any(c.run.recompute == "mlp" for c in cs)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(real_depth_cases())
def test_strategy_cases_fit_and_are_real_depth(c):
    assert 12 <= c.cfg.layers <= 32 and 0.5e9 <= param_count(c.cfg) <= 8e9
    assert real_depth.peak_bytes(*c) <= real_depth.HEADROOM * real_depth.H200_CAPACITY


def test_presets_include_a_7b_class_row_at_B1S4096():
    ids = [c.id for c in real_depth.preset_cases()]
    assert "llama2-7b-B1S4096-efficient" in ids and any(i.startswith("llama3.2-1b") for i in ids)


def _user_loop():
    from scripts import user_loop

    return user_loop


def test_user_loop_kernel_time_by_phase_from_a_trace():
    """A synthetic Chrome trace (not a measurement): a kernel belongs to the phase range its launch lies in,
    from any host thread (backward's kernels come from autograd's thread); kernels launched outside every
    range, or without a launch, are not counted; per step = total / steps."""
    ev = [dict(cat="user_annotation", name="forward", ts=0.0, dur=10.0),
          dict(cat="user_annotation", name="backward", ts=10.0, dur=20.0),
          dict(cat="user_annotation", name="optimizer", ts=30.0, dur=5.0),
          dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=1.0, dur=1.0, args=dict(correlation=1)),
          dict(cat="cuda_driver", name="cuLaunchKernel", ts=12.0, dur=1.0, tid=9, args=dict(correlation=2)),
          dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=31.0, dur=1.0, args=dict(correlation=3)),
          dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=40.0, dur=1.0, args=dict(correlation=4)),
          dict(cat="kernel", name="gemm", ts=100.0, dur=4000.0, args=dict(correlation=1)),
          dict(cat="kernel", name="triton", ts=5000.0, dur=6000.0, args=dict(correlation=2)),
          dict(cat="gpu_memset", name="Memset", ts=12000.0, dur=1000.0, args=dict(correlation=3)),
          dict(cat="kernel", name="outside", ts=14000.0, dur=9000.0, args=dict(correlation=4)),
          dict(cat="kernel", name="orphan", ts=15000.0, dur=9000.0, args=dict(correlation=99))]
    k = _user_loop().kernel_ms(dict(traceEvents=ev), steps=2)
    assert k["phases"] == pytest.approx(dict(forward=2.0, backward=3.0, optimizer=0.5))
    assert (k["forward_backward_ms"], k["step_ms"], k["kernels_per_step"]) == pytest.approx((5.0, 5.5, 1.5))
    assert k["span_ms"] == pytest.approx((13000.0 - 100.0) / 1e3 / 2)


def test_row_errors_bookkeeping():
    """A fake row (not a measurement) whose measured figures are the prediction x 1.25: every quantity's
    error is 1 / 1.25 - 1, the wall step is claimed only where the model calls the row GPU-bound, and a
    component under 5% of the step's kernel time is left out."""
    c = real_depth.preset_cases()[0]
    row = dict(id=c.id, kind="preset", cfg=c.cfg.to_dict(), batch=c.run.batch, seq=c.run.seq,
               recompute=c.run.recompute, variant=c.variant)
    res = real_depth.predicted(row, "h200-measured")
    fb = (res["phases"]["forward"]["gpu_s"] + res["phases"]["backward"]["gpu_s"]) * 1e3
    comps = {ph: {k: dict(ms=v[f"{ph}_s"] * 1e3 * 1.25) for k, v in res["components"].items()}
             for ph in ("forward", "backward")}
    comps["forward"]["tiny"] = dict(ms=1e-6)
    row.update(kernels=dict(forward_backward_ms=fb * 1.25, step_ms=res["gpu_s"] * 1e3 * 1.25),
               wall=dict(step_ms=res["steady"]["step_s"] * 1e3 * 1.25), gpu_busy=0.95, components=comps)
    e = real_depth.row_errors(row, "h200-measured")
    assert all(v == pytest.approx(1 / 1.25 - 1) for v in e.values())
    assert ("wall step (GPU-bound)" in e) == (real_depth.predicted_busy(res) >= 0.9)
    assert "tiny forward" not in e and "mlp forward" in e
    t = real_depth.error_table([row, dict(row, error="OutOfMemoryError")], "h200-measured")
    assert t["GPU time, step"]["n"] == 1 and t["GPU time, step"]["within"] == 0


def test_clock_weight_reads_the_row_clock_against_the_profile():
    """The datasheet H200 runs bursts at 1980 MHz and sustains 1590: a row at 1785 MHz sits halfway."""
    row = dict(clocks=dict(sm_mhz=1785.0))
    assert real_depth.clock_weight(row, "h200-sxm") == pytest.approx(0.5)
    assert real_depth.clock_weight(dict(clocks=dict(sm_mhz=2100.0)), "h200-sxm") == 0.0
    assert real_depth.clock_weight(dict(clocks={}), "h200-sxm") is None
