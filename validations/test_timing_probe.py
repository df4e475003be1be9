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
import statistics
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
    assert (out["forward"]["attention"]["n"], out["forward"]["other"]["n"], out["backward"]["mlp"]["n"]) == (2, 2, 1)
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


def test_plain_steps_fill_their_budget_and_the_reference_brackets_them():
    """plain_budget_ms: as many unmarked steps as fit at the marked steps' median, between `steps` and
    4 x `steps`, each kept; reference() runs once right before and once right after them (host_ref_ms),
    here calibrate's tiny host step on CPU (calibrate_host.HostStep)."""
    from anatomy.measure.calibrate_host import HostStep

    hs, calls = HostStep(warmup=1, device="cpu"), []

    def ref():
        calls.append(len(calls))
        return hs.reference("efficient", blocks=1, steps=2)

    steps = 2
    big = component_times(TINY, Run(2, 16, "amp"), "efficient", "adamw", steps=steps, warmup=1, device="cpu",
                          plain_budget_ms=1e9, reference=ref)
    small = component_times(TINY, Run(2, 16, "amp"), "efficient", "adamw", steps=steps, warmup=1, device="cpu",
                            plain_budget_ms=1e-6)
    hs.close()
    assert len(big["plain_ms"]) == 4 * steps and len(small["plain_ms"]) == steps
    assert calls == [0, 1] and len(big["host_ref_ms"]) == 2 and all(0 < x < 5000 for x in big["host_ref_ms"])
    assert "host_ref_ms" not in small
    for t in (big, small):
        assert all(0 < fb <= st for fb, st in t["plain_ms"])
        assert t["plain_forward_backward_ms"] == statistics.median(fb for fb, _ in t["plain_ms"])


# ---- the timing model against committed H200 rows ------------------------------------------------
# One session's rows with the profile `anatomy calibrate` measured on the same machine in the same
# command (scripts/h200_next.sh): host speed differs between machines of this kind by up to 1.8x
# (host op 8.5-15.1 us in this project's calibrations), so a row is only compared with its own.
SESSION = probes.TIMING_SESSION
PROFILE = str(SESSION / "h200.json")
SETS = probes.timing_rows(SESSION)


def _id(r: dict) -> str:
    return f"{r['config']}-B{r['batch']}S{r['seq']}-{r['variant']}-{r['optimizer']}"


# Known misses of the ±10% claim on session14b (seed 113; the final code: calibrate's Liger figures beside the
# tiny host step are its only change since session14, and out of sample here), each strict (a fix turns its XPASS
# into a failure), with the error measured there, against the profile calibrated in that run at the host speed
# measured beside each row (probes.predicted: the tiny host step right before and after its unmarked steps;
# docs/timing.md, "Session 10" to "Session 14"). Every one is a row whose time the host sets, wholly (host-bound:
# its predicted GPU time 1.5-10.8 ms of a 9-26 ms step) or in the GPU's idle time after the loss's two host syncs
# (Liger's .item() and torch.equal); each row's GPU time is within ±10% (test_step_gpu_time_within_10pct). The same
# model put other rows there in other runs (session14: tiny-gqa efficient +23.5%, train0 +36.7%, train25 -16.1%;
# session13: the seed B4 S1024 efficient +26.2%, train0 -21.2%), and one process's host moves 0.8-1.3x between
# blocks of 40 steps with the GPU's clock at 1980 MHz throughout (session12-regime).
_HOST = ("host-bound; the host's own noise: host time swings +-20% between blocks of one process, uncorrelated with "
         "the tiny reference step and with the GPU clock (session11 host_depth.json, session12-regime); here ")
_MISSES = {
    ("seed-B4S1024-baseline-adamw", "forward_backward"): (+0.123, _HOST + "its steps ran 20.4-26.2 ms (median 25.4) "
                                                          "with the reference at 10.9 then 10.7 ms; -3.4% in session14"),
    ("seed-B4S1024-baseline-adamw", "step"): (+0.119, _HOST + "as its forward + backward"),
    ("seed-B4S1024-efficient-adamw", "forward_backward"): (+0.182, _HOST + "its steps ran 24.9-27.4 ms (median 25.4) "
                                                           "with the reference at 10.9 then 11.1 ms; +3.3% in "
                                                           "session14, +26.2% in 13"),
    ("seed-B4S1024-efficient-adamw", "step"): (+0.162, _HOST + "as its forward + backward"),
    ("tiny-gqa-B4S512-baseline-adamw", "step"): (-0.111, _HOST + "its steps ran 7.7-11.9 ms (median 9.6), the reference "
                                                 "7.3 then 9.1 ms; its forward + backward -8.5%"),
    ("train0-B8S1024-efficient-adamw", "forward_backward"): (-0.103, _HOST + "its steps ran 8.7-15.5 ms (median 10.4), "
                                                             "the reference 7.9 then 8.4 ms; +36.7% in session14"),
    ("train0-B8S1024-efficient-adamw", "step"): (-0.117, _HOST + "as its forward + backward"),
    ("train14-B2S4096-efficient-adamw", "step"): (-0.109, "the GPU's idle time after the loss's host syncs, which the "
                                                  "host's speed sets: 5.2 ms of its 31.9 ms step, 2.3 predicted, with "
                                                  "the reference at 10.1 then 12.8 ms (calibrate's 8.8); its "
                                                  "forward + backward -9.8%"),
    ("train19-B8S1024-efficient-adamw", "step"): (-0.106, _HOST + "its steps ran 12.9-16.6 ms (median 15.8), the "
                                                  "reference 11.6 then 12.4 ms; its forward + backward -8.6%"),
}

# Known misses of the ±15% per-component claim on session14b, strict, with the error measured there. Since
# session 13 the fused norm's backward sums fewer dw partials (tiny-gqa's norm backward -15.5% in 12b is within
# now); what is left are small shapes: unfused casts and sums of a few MB, and small GEMMs.
_SMALL = "a small shape: its kernels run a few microseconds, under the calibrated sizes (GEMM grid at 16k tokens)"
_EW = ("4096 rows of 512: the residual gradient's casts and sums (ATen, 24 kernels on 8 MB fp32 tensors) ran ~100 us "
       "against 148 predicted, each at the copy rate plus its launch (an L2 speed-up, tested in session13b, is not it)")
_COMPONENT_MISSES = {
    ("seed-B4S1024-baseline-adamw", "norm backward"): (+0.255, "the eager norm's 12 backward kernels at 4096 rows of "
                                                        "512, under the calibrated 16384 rows (flat below them); "
                                                        "+23.3% in session14, +23.8% in 13 and 12b"),
    ("seed-B4S1024-efficient-adamw", "norm backward"): (+0.257, _EW + "; +25.1% in session14, +26.0% in 13"),
    ("tiny-gqa-B4S512-efficient-adamw", "mlp backward"): (-0.187, _SMALL + "; -20.6% in session14, -18.0% in 13, "
                                                          "-19.1% in 12b, -17.3% in 11d"),
}


def _case(r: dict, key: str, id_: str, misses: dict):
    """One claim case; a known miss is a strict xfail that carries the error measured and the reason."""
    miss = misses.get((_id(r), key))
    marks = [pytest.mark.xfail(strict=True, reason=f"{miss[0]:+.1%} on {SESSION.name}: {miss[1]}")] if miss else []
    return pytest.param(r, key, id=id_, marks=marks)


def _step_cases():
    """The claim's rows: every named row and every drawn training-sized row, of both variants (the eager
    baseline's since session 10, whose profile has its S x S chain, norm and loss tail calibrated)."""
    rows = SETS["named"] + SETS["drawn, training-sized"]
    out = [_case(r, what, f"{what}-{_id(r)}", _MISSES) for r in rows for what in ("forward_backward", "step")]
    return out or [pytest.param(None, None, marks=pytest.mark.skip(reason=f"no timing rows in {SESSION.name}"))]


@pytest.mark.parametrize("r,what", _step_cases())
def test_step_time_within_10pct(r, what, claims):
    """Forward + backward, and the step with AdamW, of the probe's unmarked steps, ±10%, against the
    profile calibrated on the same machine."""
    claims.check(f"time.{what}", component="model", config=_id(r), variant=r["variant"],
                 predicted=probes.predicted(r, PROFILE)["steady"][f"{what}_s"] * 1e3,
                 measured=r["timeline"][f"plain_{what}_ms"], tolerance=0.10, device="cuda (recorded)", unit="ms",
                 note=f"{SESSION.name}/probe_timing*.json; profile {SESSION.name}/h200.json")


@pytest.mark.parametrize("r,what", [pytest.param(*c.values, id=c.id) for c in _step_cases()])  # the rows, no xfails
def test_step_gpu_time_within_10pct(r, what, claims):
    """The step's GPU time, forward + backward and with AdamW: the predicted kernel time of its phases against
    the kernel time the profiler recorded in them, ±10%, on every row of the step claim, the host-bound ones
    included. It is the step without the GPU's idle time, which on a host-bound row the host sets
    (test_step_time_within_10pct's known misses)."""
    if r is None:
        pytest.skip(f"no timing rows in {SESSION.name}")
    pred, meas = probes.gpu_times_ms(r, what, PROFILE)  # every row of the claim is profiled (the test below)
    claims.check(f"time.gpu.{what}", component="model", config=_id(r), variant=r["variant"], predicted=pred,
                 measured=meas, tolerance=0.10, device="cuda (recorded)", unit="ms",
                 note=f"{SESSION.name}/probe_timing*.json kernels; profile {SESSION.name}/h200.json")


def _component_cases():
    """Every component holding >= 5% of the step's kernel time, forward and backward, of the named rows
    and drawn training-sized rows of both variants."""
    rows = SETS["named"] + SETS["drawn, training-sized"]
    out = [_case(r, key, f"{key.replace(' ', '-')}-{_id(r)}", _COMPONENT_MISSES)
           for r in rows for key in probes.component_errors(r, PROFILE)]
    return out or [pytest.param(None, None, marks=pytest.mark.skip(reason=f"no timing rows in {SESSION.name}"))]


@pytest.mark.parametrize("r,key", _component_cases())
def test_component_time_within_15pct(r, key, claims):
    """A component's forward or backward GPU time, predicted, against the kernel time the profiler
    credited to it in the same run (timeline.kernel_times), ±15%."""
    comp, phase = key.split()
    measured = r["kernels"]["components"][phase][comp]["ms"]
    claims.check(f"time.component.{phase}", component=comp, config=_id(r), variant=r["variant"],
                 predicted=probes.predicted(r, PROFILE)["components"][comp][f"{phase}_s"] * 1e3, measured=measured,
                 tolerance=0.15, device="cuda (recorded)", unit="ms",
                 note=f"{SESSION.name}/probe_timing*.json kernels; profile {SESSION.name}/h200.json")


def test_the_claim_covers_at_least_30_drawn_configs():
    for variant in ("efficient", "baseline"):
        assert len([r for r in SETS["drawn, training-sized"] if r["variant"] == variant]) >= 30


# Rows of the small drawn set (the claims session's) far outside its bounds, each with its error (held to ±5
# points, so that a change shows) and its cause; session14b has none. Earlier ones: session14's hyp7 efficient
# (+54.7%, vocab 50000 at hidden 256: 128 Liger chunks at calibrate's one-block figure of 313 us a chunk, which
# calibrate now measures beside the tiny host step) and session13's hyp4 efficient (+137.6%, vocab 46775 at 64
# Liger chunks of 4 rows: cuBLAS's align1 fallback for a vocab that is no multiple of 8, timed as the misaligned
# factors calibrated at 512-16384 rows times the 4-row GEMMs' own tile efficiency, a slowdown counted twice).
_SMALL_OUTLIERS: dict[str, tuple[float, str]] = {}


@pytest.mark.parametrize("session,name,variant,lo,hi", [
    (probes.set_session("drawn, small"), "drawn, small", "baseline", -0.22, 0.27),
    (probes.set_session("drawn, small"), "drawn, small", "efficient", -0.28, 0.37)], ids=lambda x: getattr(x, "name", x))
def test_what_the_model_gets_wrong_outside_the_claim(session, name, variant, lo, hi):
    """Not claims, but the model's stated errors where the claim does not reach, so that a change shows:
    the small drawn configs are bound by the host, whose in-step cost per op varies between machines
    (host op 8.5-23 us over sessions 7d-10) and between rows of one run. Each set against its own
    session's profile; the bounds hold session12's draw (seed 89: efficient -25.3% to +34.0%, baseline
    -15.0% to +21.7%), session12b's (seed 97: -16.5% to +23.5%, -15.7% to +20.5%) and session13's (seed
    103: -22.7% to +18.0% but for its outlier, -19.1% to +24.2%) with 3 points to spare. Read after those
    bounds were set: session14b's (seed 113, the claims' run) -8.5% to +28.5% and -10.7% to +25.3%, within;
    session14's (seed 109, calibrate's one-block Liger figure) went past the efficient lower bound, -32.2%
    (hyp24, its steps 6.5-12.0 ms; -32.2% to +16.7% but for its outlier), and -10.9% to +26.0% (baseline)."""
    errs = {_id(r): probes.time_error(r, "forward_backward", str(session / "h200.json"))
            for r in probes.timing_rows(session)[name] if r["variant"] == variant}
    for k, (err, why) in _SMALL_OUTLIERS.items():
        if k.endswith(f"-{variant}-adamw"):
            assert abs(errs.pop(k) - err) < 0.05, (k, why)  # a KeyError: the outlier is not in this session's set
    lo_, hi_ = min(errs.values()), max(errs.values())
    assert len(errs) >= 20 and lo < lo_ and hi_ < hi, (lo_, hi_)


def test_kernel_time_per_component_adds_up():
    """The profiler's per-component kernel time of each row: every component present in both phases
    of the seed step, positive, with its kernel count, and the forward + backward total of the same
    order as the unmarked step. Not bounded by it: the profiled steps are two other steps, and on
    GPU-bound rows they ran up to 11% slower than the unmarked median (session7 train24: 58.1 ms of
    kernels against a 52.4 ms step; session7d train23: 52.4 against 49.5) while host-bound rows idle
    most of their step (drawn hyp19: 1.5% of it)."""
    rows = [r for rs in SETS.values() for r in rs]
    # every claim row has its kernels; the small drawn set's probe may run out of its time limit in its
    # profiled pass (session12b: at row 57 of 64; session13: at row 45), and the rows it did not profile keep
    # their steps
    assert all("kernels" in r for name in ("named", "drawn, training-sized") for r in SETS[name])
    assert all("timeline" in r for r in SETS["drawn, small"]) and sum("kernels" in r for r in SETS["drawn, small"]) >= 40
    rows = [r for r in rows if "kernels" in r]
    for r in rows:
        k = r["kernels"]["components"]
        total = sum(c["ms"] for ph in ("forward", "backward") for c in k.get(ph, {}).values())
        assert all(c["ms"] >= 0 and c["n"] > 0 for ph in k.values() for c in ph.values())
        # (a unit slip, us or s for ms, would be off by 1000x either way)
        assert 0.01 < total / r["timeline"]["plain_forward_backward_ms"] < 1.15, (_id(r), total)
    seed = next(r for r in SETS["named"] if _id(r) == "seed-B16S4096-efficient-adamw")
    for ph in ("forward", "backward"):
        assert set(COMPONENTS) - {"loss" if ph == "backward" else ""} <= set(seed["kernels"]["components"][ph])


def test_error_table_in_docs_is_current():
    """docs/timing.md's probe table is generated from these rows (anatomy.report.probes.timing_markdown)."""
    assert probes.timing_markdown(SESSION) in (Path(__file__).parent.parent / "docs/timing.md").read_text()


def test_rows_the_probe_could_not_run_were_predicted_ooms():
    """A drawn row that did not run (the probe records the error and goes on) ran out of device memory,
    and the memory calculator had predicted it would: its backward peak over the capacity the error
    message reports (the probe draws configs without reading the calculator)."""
    import json
    import re

    from anatomy.calculator.memory import phases

    failed = [r for name, f in probes.TIMING_SETS for p in [probes.set_session(name, SESSION) / f] if p.exists()
              for r in json.loads(p.read_text())["rows"] if "error" in r]
    for r in failed:
        cap = float(re.search(r"total capacity of ([\d.]+) GiB", r["error"]).group(1)) * 2**30
        run = Run(r["batch"], r["seq"], "amp")
        peak = phases(ModelConfig(**r["cfg"]), run, r["variant"], r["optimizer"])["backward_peak"]
        assert "OutOfMemoryError" in r["error"] and peak > cap, (r["config"], peak / 2**30, cap / 2**30)
