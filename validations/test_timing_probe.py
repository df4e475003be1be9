"""In-situ per-component timing (anatomy/measure/timeline.py) and the timing model against it.

CPU tests check the measurement's bookkeeping: the interval attribution on a synthetic mark
sequence (exact), and a real CPU run's phases, components and sums. The comparison reads GPU rows
committed under reports/h200/*/probe_timing*.json (scripts/probe_timing.py on an H200): per
component, forward and backward within ±15% of anatomy.calculator.timing.estimate_time; the full
forward + backward and the whole step (with the optimizer) within ±10% of the unmarked steps.
Until such rows are committed the comparison is one skip that says so.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from pathlib import Path

import pytest

from anatomy.config import ModelConfig, Run
from anatomy.measure.components import COMPONENTS
from anatomy.measure.timeline import PHASES, attribute, component_times

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
REPORTS = Path(__file__).parent.parent / "reports/h200"
FILES = sorted(REPORTS.glob("*/probe_timing*.json"))
ROWS = [(f.relative_to(REPORTS).as_posix(), r) for f in FILES for r in json.loads(f.read_text())["rows"]
        if "error" not in r]
GPU = os.environ.get("ANATOMY_GPU_PROFILE", "h200-measured")
SHARE = 0.02  # components under 2% of the marked step are not compared (marker overhead and noise dominate)
NONE = pytest.param(None, marks=pytest.mark.skip(
    reason="no committed GPU timeline rows: run scripts/probe_timing.py on an H200 and commit "
           "reports/h200/<session>/probe_timing*.json"))


def _id(src: str, r: dict) -> str:
    return f"{r['config']}-B{r['batch']}S{r['seq']}-{r['variant']}-{r['optimizer']}"


@lru_cache(maxsize=None)
def _predicted(i: int) -> dict:
    from anatomy.calculator import timing

    r = ROWS[i][1]
    return timing.estimate_time(ModelConfig(**r["cfg"]), Run(r["batch"], r["seq"], "amp"), r["variant"], gpu=GPU,
                                optimizer=r["optimizer"], with_kernels=False)


def _component_params():
    out = []
    for i, (src, r) in enumerate(ROWS):
        tl = r["timeline"]
        for ph in ("forward", "backward"):
            for comp, ms in sorted(tl["components"].get(ph, {}).items()):
                if comp in COMPONENTS and ms >= SHARE * tl["step_ms"]:
                    out.append(pytest.param(i, ph, comp, id=f"{_id(src, r)}-{ph}-{comp}"))
    return out or [pytest.param(None, None, None, marks=NONE.marks)]


@pytest.mark.parametrize("i,phase,comp", _component_params())
def test_component_time_matches_committed_gpu_rows(i, phase, comp, claims):
    """Per component and phase, GPU ms between the component's markers (median of the probe's steps)
    against the model's summed kernel times for that component, ±15%. Only components that take at
    least 2% of the marked step are compared; "other" (time between components: residual adds,
    the backward's start) has no counterpart in the model and is not compared."""
    src, r = ROWS[i]
    pred = _predicted(i)["components"].get(comp, {}).get(f"{phase}_s", 0.0) * 1e3
    claims.check(f"time.{phase} of a component", component=comp, config=_id(src, r) + str(r["cfg"]),
                 variant=r["variant"], predicted=pred, measured=r["timeline"]["components"][phase][comp],
                 tolerance=0.15, device="cuda (recorded)", unit="ms",
                 note=f"{src}; profile {GPU}; CUDA events at component markers")


STEP_CLAIMS = {"forward_backward": ("time.forward+backward", "forward_backward_s", "plain_forward_backward_ms"),
               "step": ("time.step with optimizer", "step_s", "plain_step_ms")}


@pytest.mark.parametrize("i,what", [pytest.param(i, w, id=f"{_id(*ROWS[i])}-{w}") for i in range(len(ROWS))
                                    for w in STEP_CLAIMS] or [pytest.param(None, None, marks=NONE.marks)])
def test_step_time_matches_committed_gpu_rows(i, what, claims):
    """Forward + backward, and the whole step with the optimizer, of the probe's unmarked steps, ±10%."""
    src, r = ROWS[i]
    claim, pred_key, meas_key = STEP_CLAIMS[what]
    claims.check(claim, component="model", config=_id(src, r) + str(r["cfg"]), variant=r["variant"],
                 predicted=_predicted(i)[pred_key] * 1e3, measured=r["timeline"][meas_key], tolerance=0.10,
                 device="cuda (recorded)", unit="ms", note=f"{src}; profile {GPU}; unmarked steps")
