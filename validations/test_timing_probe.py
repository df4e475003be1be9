"""In-situ per-component timing (anatomy/measure/timeline.py) and the timing model against it.

CPU tests check the measurement's bookkeeping: the interval attribution on a synthetic mark
sequence (exact), and a real CPU run's phases, components and sums. The comparison reads the GPU
rows of one H200 session (scripts/probe_timing.py, with that run's `anatomy calibrate` profile):
the named training shapes are held to ±10% (known misses strict-xfailed with their reasons); the
drawn configs, which the host bounds, are the model's stated bias; docs/timing.md carries the
whole error table (per component too), generated from the same rows (anatomy.report.probes).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from anatomy.config import ModelConfig, Run
from anatomy.report import probes
from anatomy.measure.components import COMPONENTS
from anatomy.measure.timeline import MARK, PHASES, attribute, attribute_kernels, component_times, trace_kernels

TINY = ModelConfig(name="tiny", hidden=64, layers=2, heads=4, intermediate=96, vocab=128)


# ---- the attribution, exact ---------------------------------------------------------------------
def test_attribute_credits_each_interval_to_the_running_phase_and_component():
    marks = [("other", 0.0),  # before any phase: not part of a step
             ("phase:forward", 1.0), ("embedding", 1.5), ("other", 2.0), ("attention", 2.25), ("other", 5.0),
             ("loss", 5.5), ("other", 7.0),
             ("phase:backward", 7.25), ("loss", 7.5), ("attention", 8.0), ("embedding", 12.0),
             ("phase:optimizer", 12.5), ("optimizer", 12.75), ("other", 14.0),
             ("phase:end", 14.5), ("mlp", 20.0)]  # after the end: not part of a step
    assert attribute(marks) == {
        "forward": {"other": 0.5 + 0.25 + 0.5 + 0.25, "embedding": 0.5, "attention": 2.75, "loss": 1.5},
        "backward": {"other": 0.25, "loss": 0.5, "attention": 4.0, "embedding": 0.5},
        # the tracker's label is still "embedding" until the optimizer sets its own
        "optimizer": {"embedding": 0.25, "optimizer": 1.25, "other": 0.5}}


def test_attribute_carries_the_label_into_a_phase():
    """A forward that starts in the component the backward ended in emits no label (the tracker
    marks changes only): the label carried in is what runs."""
    marks = [("embedding", 0.0), ("phase:forward", 0.0), ("other", 3.0), ("phase:end", 4.0)]
    assert attribute(marks) == {"forward": {"embedding": 3.0, "other": 1.0}}
    assert attribute([("phase:forward", 0.0), ("phase:end", 2.0)], label="norm") == {"forward": {"norm": 2.0}}
    assert attribute([]) == {} and attribute([("phase:forward", 1.0)]) == {}


def test_kernel_time_is_credited_to_the_mark_before_its_launch():
    """attribute_kernels: a kernel belongs to the component running when the host launched it, whenever
    it ran; kernels outside a phase are not part of a step. trace_kernels pairs each GPU event of a
    Chrome trace with its launch by correlation id (runtime or driver API) and reads the marks."""
    marks = [("phase:forward", 0.0), ("attention", 1.0), ("other", 5.0), ("phase:backward", 6.0), ("mlp", 6.5),
             ("phase:end", 9.0)]
    kernels = [(0.5, 100.0, "gather"), (2.0, 3000.0, "sdpa"), (3.0, 1000.0, "gemm"), (5.5, 200.0, "add"),
               (7.0, 2000.0, "gemm"), (9.5, 50.0, "after")]
    out = attribute_kernels(marks, kernels)
    assert {(ph, c): v["ms"] for ph, cs in out.items() for c, v in cs.items()} == pytest.approx(
        {("forward", "other"): 0.3, ("forward", "attention"): 4.0, ("backward", "mlp"): 2.0})
    assert out["forward"]["attention"]["top"] == {"sdpa": 3.0, "gemm": 1.0}
    trace = {"traceEvents": [
        dict(cat="user_annotation", name=MARK + "phase:forward", ts=0.0, dur=0.1),
        dict(cat="user_annotation", name=MARK + "norm", ts=1.0, dur=0.1),
        dict(cat="user_annotation", name="unrelated", ts=1.5, dur=9.0),
        dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=2.0, dur=1.0, args=dict(correlation=7)),
        dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=3.0, dur=1.0, args=dict(correlation=8)),
        dict(cat="kernel", name="triton_rms", ts=40.0, dur=5.0, args=dict(correlation=8)),
        dict(cat="gpu_memset", name="Memset", ts=30.0, dur=2.0, args=dict(correlation=7)),
        dict(cat="kernel", name="orphan", ts=50.0, dur=9.0, args=dict(correlation=99)),
        dict(cat="user_annotation", name=MARK + "phase:end", ts=60.0, dur=0.1)]}
    m, k = trace_kernels(trace)
    assert m == [("phase:forward", 0.0), ("norm", 1.0), ("phase:end", 60.0)]
    assert sorted(k) == [(2.0, 2.0, "Memset"), (3.0, 5.0, "triton_rms")]
    assert attribute_kernels(m, k)["forward"]["norm"]["ms"] == pytest.approx(0.007)


# ---- a real run on CPU ----------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", None])
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_component_times_on_cpu(variant, optimizer):
    steps = 3
    t = component_times(TINY, Run(2, 16, "amp"), variant, optimizer, steps=steps, warmup=1, device="cpu")
    assert len(t["per_step"]) == steps and t["marks_per_step"] > 2 * len(COMPONENTS)
    assert set(t["components"]) == ({"forward", "backward", "optimizer"} if optimizer else {"forward", "backward"})
    assert set(COMPONENTS) <= set(t["components"]["forward"])
    assert set(COMPONENTS) <= set(t["components"]["backward"])
    if optimizer:
        opt = t["components"]["optimizer"]
        assert max(opt, key=opt.get) == "optimizer" and set(opt) <= {"optimizer", "other", "embedding"}
    for s in [t, *t["per_step"]]:
        for ph, comps in s["components"].items():
            assert all(v >= 0 for v in comps.values()), (ph, comps)
        assert s["phases"]["forward"] > 0 and s["phases"]["backward"] > 0
        assert (s["phases"]["optimizer"] > 0) == bool(optimizer)
    for s in t["per_step"]:  # each step adds up (the medians are taken entry by entry)
        for ph in PHASES:
            assert math.isclose(sum(s["components"].get(ph, {}).values()), s["phases"][ph], rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(s["forward_backward_ms"], s["phases"]["forward"] + s["phases"]["backward"], rel_tol=1e-12)
        assert math.isclose(s["step_ms"], sum(s["phases"].values()), rel_tol=1e-12)
    assert math.isclose(t["forward_backward_ms"], sorted(s["forward_backward_ms"] for s in t["per_step"])[1])
    assert 0 < t["plain_forward_backward_ms"] <= t["plain_step_ms"]
    # a CPU step of this size takes milliseconds; a unit slip (s, us) would be off by 1000x
    assert 0.05 < t["plain_step_ms"] < 5000 and 0.05 < t["step_ms"] < 5000


# ---- the timing model against committed H200 rows ------------------------------------------------
# One session's rows with the profile `anatomy calibrate` measured on the same machine in the same
# run (scripts/h200_next.sh): host speed differs between machines of this kind by up to 1.8x
# (host op 8.5-15.1 us in this project's calibrations), so a row is only compared with its own.
SESSION = probes.TIMING_SESSION
PROFILE = str(SESSION / "h200.json")
NAMED, DRAWN = probes.timing_rows(SESSION)


def _id(r: dict) -> str:
    return f"{r['config']}-B{r['batch']}S{r['seq']}-{r['variant']}-{r['optimizer']}"


# The claim's domain: the efficient model at the named training shapes, where a step is tens of
# milliseconds of GPU work. Known misses, each strict (a fix turns its XPASS into a failure):
_MISSES = {
    "seed-B16S4096-baseline-adamw": "eager S x S softmax, mask and casts run below the copy roofline (-28%)",
    "llama3.2-1b-B2S2048-baseline-adamw": "the same eager attention kernels, at S=2048 (-17%)",
    "seed-B4S1024-baseline-adamw": "host-bound: the host's issue time per op is underestimated (docs/timing.md)",
    "seed-B4S1024-efficient-adamw": "host-bound: the host's issue time per op is underestimated (docs/timing.md)",
    "tiny-gqa-B4S512-baseline-adamw": "host-bound: the host's issue time per op is underestimated (docs/timing.md)",
    "tiny-gqa-B4S512-efficient-adamw": "host-bound: the host's issue time per op is underestimated (docs/timing.md)",
}


@pytest.mark.parametrize("r", [pytest.param(r, id=_id(r), marks=[pytest.mark.xfail(strict=True, reason=_MISSES[_id(r)])]
                                            if _id(r) in _MISSES else []) for r in NAMED])
@pytest.mark.parametrize("what", ["forward_backward", "step"])
def test_named_step_time_within_10pct(r, what, claims):
    """Forward + backward, and the step with AdamW, of the probe's unmarked steps, ±10%, against the
    profile calibrated in the same run."""
    claims.check(f"time.{what}", component="model", config=_id(r), variant=r["variant"],
                 predicted=probes.predicted(r, PROFILE)[f"{what}_s"] * 1e3,
                 measured=r["timeline"][f"plain_{what}_ms"], tolerance=0.10, device="cuda (recorded)", unit="ms",
                 note=f"{SESSION.name}/probe_timing.json; profile {SESSION.name}/h200.json")


def test_drawn_configs_are_underpredicted_where_the_host_bounds_them():
    """The model's known bias, stated so that a fix shows: on the drawn configs (small, mostly
    host-bound: 1-4 layers, 128-8192 tokens) every prediction of forward + backward is low, by
    8-66% on session4c, with the profile of the same run. The host issues each eager op in 25-60 us inside a
    model (autograd, autocast, module calls) against the 8.5-15 us calibrate's bare-op loop measures."""
    errs = [probes.time_error(r, "forward_backward", PROFILE) for r in DRAWN]
    assert len(errs) == 64
    assert all(-0.75 < e < 0 for e in errs), sorted(errs)[-3:]


def test_error_table_in_docs_is_current():
    """docs/timing.md's probe table is generated from these rows (anatomy.report.probes.timing_markdown)."""
    assert probes.timing_markdown(SESSION) in (Path(__file__).parent.parent / "docs/timing.md").read_text()
