"""The causal SDPA kernel's CTA schedule (llm_anatomy/calculator/timing/sdpa_schedule.py), its fit to calibrate's
rows (timing/fit.schedule_table, measure/calibrate_sdpa.py), and, on a GPU, its prediction at grids and head
dims calibrate never timed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy import records
from llm_anatomy.calculator import timing
from llm_anatomy.calculator.timing import sdpa_schedule
from llm_anatomy.calculator.timing.kernels_efficient import efficient_kernels
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure import calibrate_sdpa
from validations import known_misses

SMS = 132
TRUE = {"forward": dict(a=2.5e-6, o=1.5e-6, c=1.15e-6), "backward": dict(a=1.7e-6, o=4.0e-6, c=3.0e-6)}


def test_head_dims_pad_to_the_kernels_tile():
    assert [sdpa_schedule.padded_head_dim(d) for d in (16, 32, 64, 80, 96, 128)] == [64, 64, 64, 128, 128, 128]


def test_causal_work_per_cta():
    """Forward: query block i visits i + 1 key blocks; backward: key block i is visited by n - i query
    blocks; both sum to the causal triangle n (n + 1) / 2 (a partial last block counts whole)."""
    assert sdpa_schedule.cta_work(512, "forward") == [1, 2, 3, 4]
    assert sdpa_schedule.cta_work(512, "backward") == [4, 3, 2, 1]
    assert sum(sdpa_schedule.cta_work(1000, "forward")) == 8 * 9 // 2
    with pytest.raises(ValueError):
        sdpa_schedule.cta_work(512, "sideways")


def test_under_one_wave_the_longest_cta_sets_the_time():
    """64 CTAs on 132 SMs: the kernel lasts as long as its longest CTA, whatever the batch x heads."""
    for bh in (1, 4, 16):
        assert sdpa_schedule.makespan_units(bh, 512, SMS, 0.5, "forward") == 0.5 + 4


@settings(max_examples=60, deadline=None)
@given(bh=st.integers(1, 256), seq=st.sampled_from([128, 256, 512, 1024, 2048, 4096]),
       ratio=st.floats(0.05, 10), phase=st.sampled_from(sdpa_schedule.PHASES))
def test_makespan_lies_between_the_mean_load_and_one_cta_more(bh, seq, ratio, phase):
    """Greedy list scheduling: no faster than the work spread evenly over the SMs, nor than the longest
    CTA; no slower than that even spread plus one longest CTA (Graham's bound)."""
    work = [ratio + w for w in sdpa_schedule.cta_work(seq, phase)] * bh
    m = sdpa_schedule.makespan_units(bh, seq, SMS, ratio, phase)
    lower = max(sum(work) / SMS, max(work))
    assert lower - 1e-9 <= m <= sum(work) / SMS + max(work) + 1e-9


@settings(max_examples=40, deadline=None)
@given(bh=st.integers(1, 200), seq=st.sampled_from([256, 1024, 4096]), phase=st.sampled_from(sdpa_schedule.PHASES))
def test_more_heads_never_finish_sooner(bh, seq, phase):
    a = sdpa_schedule.makespan_units(bh, seq, SMS, 1.0, phase)
    assert sdpa_schedule.makespan_units(bh + 1, seq, SMS, 1.0, phase) >= a - 1e-9


@settings(max_examples=30, deadline=None)
@given(order=st.lists(st.integers(1, 120), min_size=2, max_size=8), seq=st.sampled_from([512, 2048]),
       ratio=st.floats(0.05, 10), phase=st.sampled_from(sdpa_schedule.PHASES))
def test_a_resumed_schedule_is_the_schedule_from_the_start(order, seq, ratio, phase):
    """makespan_units resumes a larger grid from the largest of its shape already scheduled: in any order of
    asks, every figure equals greedy scheduling from empty slots, to the bit."""
    import heapq

    def fresh(bh):
        work = [ratio + w for w in sdpa_schedule.cta_work(seq, phase)]
        if bh * len(work) <= SMS:
            return max(work)
        slots = [0.0] * SMS
        for _ in range(bh):
            for w in work:
                heapq.heapreplace(slots, slots[0] + w)
        return max(slots)

    sdpa_schedule.makespan_units.cache_clear()
    sdpa_schedule._RESUME.clear()
    assert [sdpa_schedule.makespan_units(bh, seq, SMS, ratio, phase) for bh in order] == [fresh(bh) for bh in order]


def _rows(sched: dict, phase: str) -> list[tuple[int, int, int, float]]:
    return [(B, h, S, sdpa_schedule.kernel_s(sched, B, h, S, SMS, phase)) for B, h, S in calibrate_sdpa.SCHEDULE_GRIDS]


@pytest.mark.parametrize("phase", sdpa_schedule.PHASES)
def test_fit_recovers_a_known_schedule(phase):
    """Rows made by a known (a, o, c) at calibrate's grids: the fit returns them to the grid's resolution
    and reproduces every row within 1%."""
    got = sdpa_schedule.fit(_rows(TRUE[phase], phase), SMS, phase)
    for k in ("a", "o", "c"):
        assert got[k] == pytest.approx(TRUE[phase][k], rel=0.15, abs=2e-7)
    assert max(abs(e) for e in sdpa_schedule.errors(got, _rows(TRUE[phase], phase), SMS, phase)) < 0.01


def test_fit_needs_three_grids():
    with pytest.raises(ValueError, match="at least 3"):
        sdpa_schedule.fit(_rows(TRUE["forward"], "forward")[:2], SMS, "forward")


def _calibrate_rows(hd: int = 64) -> list[dict]:
    return [dict(backend="cudnn", B=B, heads=h, S=S, hd=hd,
                 fwd_kernel_ms=sdpa_schedule.kernel_s(TRUE["forward"], B, h, S, SMS, "forward") * 1e3,
                 bwd_kernel_ms=sdpa_schedule.kernel_s(TRUE["backward"], B, h, S, SMS, "backward") * 1e3)
            for B, h, S in calibrate_sdpa.SCHEDULE_GRIDS]


def _profile(rows: list[dict]) -> dict:
    data = json.loads(records.H200_PROFILE.read_text())
    data["measurements"]["attention_kernels"] = rows
    return timing.get(data)


def test_profile_carries_the_fitted_schedule_with_its_source():
    p = _profile(_calibrate_rows())
    e = p["sdpa_schedule"]["cudnn"]["64"]
    assert e["shapes"] == len(calibrate_sdpa.SCHEDULE_GRIDS) and e["max_error"] < 0.01
    assert "sdpa_schedule.fit" in p["sources"]["sdpa_schedule"]
    assert not _profile([])["sdpa_schedule"]  # no kernel rows: the full-wave rates


@pytest.mark.parametrize("hd", [64, 32, 128])
def test_sdpa_kernels_take_the_schedule_at_the_head_dim_they_run(hd):
    """The SDPA kernel's time is the schedule's at the padded head dim (hd 32 runs the 64 kernel); a
    head dim with no calibrated schedule takes the nearest one (only 64 calibrated here). At burst rates:
    the sustained-load term (roofline.sustained_weight) is off."""
    p = _profile(_calibrate_rows(64)).replace(sustained_ratio={})
    heads, B, S = 8, 4, 512
    cfg = ModelConfig(name="t", hidden=heads * hd, layers=2, heads=heads, intermediate=4 * heads * hd, vocab=1000)
    out = timing.estimate_time(cfg, Run(B, S, "amp"), "efficient", p, optimizer=None)
    for name, phase in (("attention.sdpa", "forward"), ("attention.sdpa.backward", "backward")):
        (k,) = [k for k in out["kernels"] if k["name"] == name]
        fitted = sdpa_schedule.kernel_s(p["sdpa_schedule"]["cudnn"]["64"][phase], B, heads, S, SMS, phase)
        assert k["per_launch_s"] == pytest.approx(fitted, rel=1e-9)
        assert fitted == pytest.approx(sdpa_schedule.kernel_s(TRUE[phase], B, heads, S, SMS, phase), rel=0.01)
        assert "CTA schedule" in k["note"] and (("hd64 kernel" in k["note"]) == (hd == 32))
        assert ("nearest calibrated to hd128" in k["note"]) == (hd == 128)


def test_cudnn_lists_the_small_kernels_around_its_main_one():
    """Memsets of the row statistics in each phase, dot(dO, O) (zeroing the fp32 dQ accumulator) and
    the dQ conversion in backward: under cuDNN only, one each per layer."""
    cfg = ModelConfig(name="m", hidden=512, layers=3, heads=8, intermediate=1024, vocab=1000)
    run = Run(2, 256, "amp")
    names = {"attention.sdpa.memset", "attention.sdpa.backward.memset", "attention.sdpa.dot_do_o",
             "attention.sdpa.convert_dq"}
    cud = {k.name: k for k in efficient_kernels(cfg, run, "cudnn") if k.name in names}
    assert set(cud) == names and all(k.count == cfg.layers and k.host is None for k in cud.values())
    T, H = run.tokens, cfg.hidden
    assert cud["attention.sdpa.convert_dq"].bytes == T * H * (4 + 2)
    assert not [k for k in efficient_kernels(cfg, run, "flash") if k.name in names]


def test_rows_from_profiled_kernels():
    """Calibrate's rows: per call, the longest kernel of each phase and the rest."""
    lab = calibrate_sdpa._label(1, 8, 512, 64)
    comps = {"forward": {lab: dict(ms=0.10, n=20, top={"fprop": 0.09, "Memset": 0.01})},
             "backward": {lab: dict(ms=0.30, n=40, top={"bprop": 0.20, "dot": 0.05, "cvt": 0.05})}}
    (r,) = calibrate_sdpa.rows_from_kernels(comps, [(1, 8, 512, 64), (2, 8, 512, 64)], reps=10)
    assert (r["fwd_kernel_ms"], r["bwd_kernel_ms"], r["fwd_kernel"], r["bwd_kernel"]) == (0.009, 0.02, "fprop", "bprop")
    assert r["fwd_other_ms"] == pytest.approx(0.001) and r["bwd_other_ms"] == pytest.approx(0.01)


# shapes calibrate never timed: other batches, heads and lengths, and the padded head dims
GPU_SHAPES = [(3, 12, 768, 64), (4, 8, 512, 32), (2, 24, 1536, 128), (6, 20, 1024, 64), (1, 32, 3072, 128),
              (2, 10, 2560, 96)]


@pytest.fixture(scope="module")
def sdpa_kernel_rows(cuda_device) -> dict[tuple, dict]:
    """cuDNN's SDPA kernels at every GPU_SHAPES shape, {(B, h, S, hd): calibrate's row}, from one profiler
    pass in a process of its own: the profiler leaves CUPTI attached, and the host-bound step tests after
    these would pay for it (calibrate.py profiles last for the same reason). One process, not one per
    shape: each start (CUDA, cuDNN, the profiler) costs several seconds."""
    code = ("import json, sys, time; from llm_anatomy.measure.calibrate_sdpa import measure_sdpa_kernels; "
            f"print(json.dumps(measure_sdpa_kernels(time.monotonic() + 120, reps=10, shapes={GPU_SHAPES!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return {(r["B"], r["heads"], r["S"], r["hd"]): r for r in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B{}h{}S{}hd{}".format(*s))
def test_sdpa_kernel_time_within_15pct_gpu(shape, claims, cuda_device, suite_profile, sdpa_kernel_rows):
    """cuDNN's main SDPA kernel, forward and backward, at a shape calibrate never timed: its profiled
    duration against the schedule of the suite's profile (conftest.py suite_profile: $ANATOMY_GPU_PROFILE,
    else this GPU's own calibration), ±15%."""
    profile, label = suite_profile
    prof = timing.get(profile)
    if not (prof.get("sdpa_schedule") or {}).get("cudnn"):
        pytest.skip(f"profile {label} has no cuDNN SDPA schedule")
    B, h, S, hd = shape
    row = sdpa_kernel_rows.get(tuple(shape))
    assert row is not None, f"the profiler pass credited no forward and backward kernels to {shape}"
    sched, note = sdpa_schedule.lookup(prof, "cudnn", hd)
    for phase, key in (("forward", "fwd_kernel"), ("backward", "bwd_kernel")):
        pred = sdpa_schedule.kernel_s(sched[phase], B, h, S, prof["sms"], phase) * 1e3
        claims.check("time.sdpa_kernel.forward" if phase == "forward" else "time.sdpa_kernel.backward",
                     component="attention", config=f"B{B}h{h}S{S}hd{hd}",
                     variant="efficient", predicted=pred, measured=row[f"{key}_ms"], tolerance=0.15, device="cuda",
                     unit="ms", note=f"profile {label}; {note}; kernel {row[key]}")


IN_STEP_TEST = "validations/test_sdpa_schedule.py::test_sdpa_kernel_in_step_within_15pct"


def _in_step_cases():
    """Every efficient row of the probe's run: cuDNN's main kernel per layer as the probe profiled it in the
    step, each id its shape and its occurrence; known misses: validations/known_misses.json."""
    from llm_anatomy.report import sdpa_plot

    seen: dict[str, int] = {}
    out = []
    for p in sdpa_plot.in_step():
        shape = "{phase}-B{B}h{heads}S{S}hd{hd}".format(**p)
        seen[shape] = seen.get(shape, 0) + 1
        out.append(known_misses.param(IN_STEP_TEST, f"{shape}-{seen[shape]}", p))
    return out or [pytest.param(None, marks=pytest.mark.skip(reason="no profiled efficient rows"))]


def test_every_known_miss_names_a_case():
    assert not known_misses.unused(IN_STEP_TEST, [c.id for c in _in_step_cases()])


@pytest.mark.parametrize("point", _in_step_cases())
def test_sdpa_kernel_in_step_within_15pct(point, claims):
    """The main cuDNN kernel inside the probes' steps (named and drawn rows, their attention component's
    profiled kernels over the layers) against the schedule of the profile calibrated in the same run,
    ±15%, in the step's own conditions: the drawn rows' shapes, which the fit never saw, and the named
    ones (the seed B16 S4096 is also one of calibrate's grids)."""
    from llm_anatomy.report import sdpa_plot

    prof = timing.get(str(records.TIMING_PROBE_PROFILE))
    claims.check("time.sdpa_kernel.forward" if point["phase"] == "forward" else "time.sdpa_kernel.backward",
                 component="attention",
                 config="B{B}h{heads}S{S}hd{hd}".format(**point), variant="efficient",
                 predicted=sdpa_plot.predict_us(prof, point) / 1e3, measured=point["us"] / 1e3, tolerance=0.15,
                 device="cuda (recorded)", unit="ms", note="reports/h200/timing-probe kernels")
