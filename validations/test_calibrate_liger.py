"""The timing model's calibration of Liger's loss: its CE kernel priced in lanes at vocabs calibrate never
ran, and its host cost measured in place (per call and per chunk) and left out of the tiny step's scale
(all on CPU, with fake measurements)."""
from __future__ import annotations

import pytest

from llm_anatomy.calculator import timing
from llm_anatomy.calculator.timing import fit
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure import calibrate, calibrate_host
from validations.test_calibrate import _fake_measurements, _liger_host_profile


# ---- Liger's loss: its CE kernel in lanes, its host cost measured in place ------------------------
def test_liger_ce_lanes():
    from llm_anatomy.calculator.timing.op_bytes import liger_ce_width

    assert [liger_ce_width(v) for v in (1000, 16000, 16384, 16385, 18042, 32768, 55960, 64000, 128256)] == \
        [1024, 16384, 16384, 32768, 32768, 32768, 65536, 65536, 131072]


def test_liger_ce_time_follows_lanes_and_alignment():
    """Fake CE timings (not a measurement) that take time per lane, 1.3x per lane at a vocab that is not
    a multiple of 16: at vocabs and chunk rows calibrate never ran, the model's time for the kernel is
    the same law (so V 18042, one 32768-lane pass, costs 2x V 16000 and 1.3x more), not time per vocab."""
    from llm_anatomy.calculator.timing.op_bytes import fused_bytes, liger_ce_width
    from llm_anatomy.measure.calibrate_kernels import LIGER_CHUNK_ROWS, LIGER_VOCABS

    hbm = 4.0e12
    law = lambda V, rows: rows * liger_ce_width(V) * 6 / hbm / 0.8 * (1.3 if V % 16 else 1.0)  # noqa: E731
    fused = [dict(op="liger_ce", tokens=n, width=V, ms=law(V, n) * 1e3 + 2.2e-3, queued=True)
             for V in LIGER_VOCABS for n in LIGER_CHUNK_ROWS]
    assert {V % 16 == 0 for V in LIGER_VOCABS} == {True, False}
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), fused=fused, copy_tbps=hbm / 1e12),
                                                   dict(date="fake"), "h200-sxm"))
    for V in (18042, 22672, 40000, 63060, 100003):
        for rows in (256, 1024, 4096):
            t = sum(fused_bytes("liger_ce", V, rows)) / (hbm * timing.fused_efficiency(p, "linear_ce", V, rows))
            assert t == pytest.approx(law(V, rows), rel=0.02), (V, rows)
    t16, t18 = (law(V, 1024) for V in (16000, 18042))
    assert t18 / t16 == pytest.approx(2 * 1.3)


def test_liger_host_is_measured_per_call_and_per_chunk():
    """Liger's host time is the measured call (forward, backward) plus the measured cost per chunk, and
    no tiny-step scale touches it; a profile that did not measure it counts the eager ops the loss
    issues (7 a call under amp, 6 a chunk, 2 in backward)."""
    from llm_anatomy.kernel_shapes import chunk_rows

    cfg = ModelConfig(name="v", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=18042)
    run = Run(2, 2048, loss_impl="liger")
    n = -(-run.tokens // chunk_rows(run.tokens, cfg.hidden, cfg.vocab))
    assert n == 16  # ceil(V / H) = 18 chunks of next_pow2(4096 / 18) = 256 rows
    p = _liger_host_profile(forward=800.0, chunk=150.0, backward=100.0)
    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=50.0))  # a scale far from 1
    ps = dict(p, host_step=hs)
    assert timing.host_scale(ps, "efficient") > 3
    for prof in (p, ps):
        r = timing.estimate_time(cfg, run, "efficient", prof, optimizer=None, with_kernels=True)
        loss = {(k["phase"]): 0.0 for k in r["kernels"]}
        for k in r["kernels"]:
            if k["component"] == "loss":
                loss[k["phase"]] += k["host_s"]
        assert loss["forward"] == pytest.approx((800 + n * 150) * 1e-6)
        assert loss["backward"] == pytest.approx(100e-6)
    p0 = _liger_host_profile()
    r = timing.estimate_time(cfg, run, "efficient", p0, optimizer=None, with_kernels=True)
    ops = sum(k["host_s"] for k in r["kernels"] if k["component"] == "loss") / p0["host_op_s"]
    assert ops == pytest.approx(7 + 6 * n + 2)


def test_host_scale_leaves_out_what_was_measured_in_place():
    """The tiny step's measured time less Liger's measured share, over the modelled time less the same:
    a step measured at f x its modelled other ops plus Liger's figures gives the scale f exactly."""
    p = _liger_host_profile(forward=800.0, chunk=150.0, backward=100.0)
    hs = dict(calibrate_host.HOST_STEP, loss_impl="liger")  # a tiny step run with Liger's loss
    cfg, run = ModelConfig(**hs["cfg"]), Run.from_record(hs)
    ks = timing.kernels(cfg, run, "efficient", None, None)
    liger = sum(timing.host_seconds(k, p) for k in ks if timing.in_situ(k, p))
    other = sum(timing.host_seconds(k, p) for k in ks if not timing.in_situ(k, p))
    assert liger > 1e-3 and other > 1e-3
    hs["efficient"] = dict(forward_backward_ms=(2.5 * other + liger) * 1e3)
    assert timing.host_scale(dict(p, host_step=hs), "efficient") == pytest.approx(2.5)


def test_liger_host_figures_are_the_median_ratio_to_the_tiny_step_beside_them():
    """calibrate_host.liger_from_blocks: each block's figure over the tiny host step timed right before it,
    the median of those ratios, times the efficient tiny step's median. A slow block whose step was slow
    too moves nothing; the raw blocks are kept."""
    from llm_anatomy.measure.calibrate_host import liger_from_blocks

    blocks = [(10.0, dict(forward=500.0, chunk=200.0, backward=400.0)),
              (15.0, dict(forward=750.0, chunk=300.0, backward=600.0)),  # the host 1.5x slower in both
              (10.0, dict(forward=520.0, chunk=400.0, backward=380.0))]  # a slow Liger block alone
    out = liger_from_blocks(blocks, step_ms=8.0)
    assert out["chunk"] == pytest.approx(20.0 * 8.0)  # ratios 20, 20, 40: the median 20
    assert out["forward"] == pytest.approx(50.0 * 8.0) and out["backward"] == pytest.approx(40.0 * 8.0)
    assert [b["step_ms"] for b in out["blocks"]] == [10.0, 15.0, 10.0] and out["blocks"][2]["chunk"] == 400.0
