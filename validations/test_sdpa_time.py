"""SDPA's time on small grids (issue 5, session 11): calibrate's one- and two-wave cuDNN rows give a
per-call cost beyond the FLOPs (measured.attention_table's fixed_s), and GQA's backward adds cuDNN's
head reduction. All on CPU, with measurements synthesized from a known truth (not measured numbers)."""
from __future__ import annotations

import pytest

from anatomy.calculator import gpus, launches, measured, timing
from anatomy.config import ModelConfig, Run
from anatomy.measure import calibrate

SMS = 132
# the truth the fake rows are drawn from: net FLOP/s per (hd, S) and a per-call cost, per phase
RATE = {(64, 1024): (420e12, 380e12), (64, 2048): (520e12, 450e12), (64, 4096): (560e12, 480e12),
        (128, 1024): (480e12, 400e12), (128, 2048): (600e12, 500e12), (128, 4096): (640e12, 520e12),
        (32, 512): (200e12, 150e12), (32, 1024): (260e12, 190e12)}
FIXED = {64: (6e-6, 19e-6), 128: (8e-6, 25e-6), 32: (5e-6, 16e-6)}


def _row(backend: str, B: int, nh: int, S: int, hd: int, small: bool) -> dict:
    f, eff = gpus.causal_attention_flops(B, nh, S, hd), gpus.attention_wave_efficiency(B, nh, S, SMS)
    (rf, rfb), (xf, xfb) = RATE[(hd, S)], FIXED[hd]
    row = dict(backend=backend, B=B, heads=nh, S=S, hd=hd, causal=True,
               fwd_ms=(xf + f / (rf * eff)) * 1e3, fwd_bwd_ms=(xfb + 3.5 * f / (rfb * eff)) * 1e3)
    return dict(row, grid="small") if small else row


def _rows(small: bool = True) -> list[dict]:
    return ([_row("cudnn", *s, small=False) for s in calibrate.ATTENTION_SHAPES + calibrate.SEQ_SHAPES]
            + [_row("cudnn", *s, small=True) for s in calibrate.SMALL_SHAPES if small])


def test_calibrate_shapes_cover_each_small_grid():
    """Each small grid's length and head dim is also measured at a full wave: the solve is exact there."""
    full = {(S, hd) for _, _, S, hd in calibrate.ATTENTION_SHAPES + calibrate.SEQ_SHAPES}
    for B, nh, S, hd in calibrate.SMALL_SHAPES:
        assert (S, hd) in full
        assert B * nh * -(-S // 128) <= 2 * SMS  # one or two waves


def test_attention_table_recovers_fixed_cost_and_net_rates():
    t = measured.attention_table(_rows(), SMS)["cudnn"]
    for hd, (xf, xfb) in FIXED.items():
        assert t[str(hd)]["fixed_s"]["fwd"] == pytest.approx(xf, rel=1e-6)
        assert t[str(hd)]["fixed_s"]["fwd_bwd"] == pytest.approx(xfb, rel=1e-6)
        for S, r in t[str(hd)]["seq"].items():
            assert (r["fwd"], r["fwd_bwd"]) == pytest.approx(RATE[(hd, int(S))], rel=1e-6)
    gross = measured.attention_table(_rows(small=False), SMS)["cudnn"]  # no small grid: no per-call cost
    assert all("fixed_s" not in e for e in gross.values())
    assert gross["64"]["seq"]["1024"]["fwd"] < RATE[(64, 1024)][0]  # the cost folded into a lower rate


@pytest.mark.parametrize("B,nh,S,hd", [(2, 16, 1024, 64), (2, 8, 512, 32), (1, 16, 2048, 128), (4, 8, 1024, 64),
                                       (16, 8, 4096, 64), (3, 12, 1536, 128)])
def test_sdpa_kernel_time_follows_the_truth(B, nh, S, hd):
    """The calculator's SDPA compute term, forward and backward, against the truth the rows came from,
    on the calibrated grids and off them (lengths between the measured ones interpolate in log S)."""
    p = dict(gpus.get("h200-sxm"), attention=measured.attention_table(_rows(), SMS), sms=SMS)
    f, eff = gpus.causal_attention_flops(B, nh, S, hd), gpus.attention_wave_efficiency(B, nh, S, SMS)
    fwd = timing.time_kernel(launches.Kernel("sdpa", "attention", "forward", "sdpa", 1, f, 0, (B, nh, S, hd),
                                             "bfloat16", "cudnn"), p)["compute_s"]
    bwd = timing.time_kernel(launches.Kernel("sdpa.backward", "attention", "backward", "sdpa", 1, 5 * f // 2, 0,
                                             (B, nh, S, hd), "bfloat16", "cudnn"), p)["compute_s"]
    if (hd, S) in RATE:
        (rf, rfb), (xf, xfb) = RATE[(hd, S)], FIXED[hd]
        assert fwd == pytest.approx(xf + f / (rf * eff), rel=1e-6)
        assert fwd + bwd == pytest.approx(xfb + 3.5 * f / (rfb * eff), rel=1e-6)
    else:  # between two measured lengths: between their times
        lo, hi = (max(s for h, s in RATE if h == hd and s < S), min(s for h, s in RATE if h == hd and s > S))
        times = [FIXED[hd][0] + f / (RATE[(hd, s)][0] * eff) for s in (lo, hi)]
        assert min(times) <= fwd <= max(times)


def test_gqa_backward_reduces_heads_under_cudnn_only():
    cfg = ModelConfig(name="gqa", hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2816, vocab=8192)
    run = Run(2, 1024, "amp")
    names = {b: [k for k in launches.efficient_kernels(cfg, run, b) if k.name == "attention.sdpa.gqa_reduce"]
             for b in ("cudnn", "flash")}
    (k,) = names["cudnn"]
    assert not names["flash"]
    T, Hkv = run.tokens, cfg.kv_dim
    assert (k.count, k.phase, k.bytes) == (cfg.layers, "backward", 2 * T * cfg.hidden * 4 + 2 * T * Hkv * 2)
    mha = ModelConfig(name="mha", hidden=1024, layers=2, heads=16, kv_heads=16, intermediate=2816, vocab=8192)
    assert not [k for k in launches.efficient_kernels(mha, run) if k.name == "attention.sdpa.gqa_reduce"]
