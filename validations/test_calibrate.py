"""The timing model's calibration: the GEMM efficiency model and its fit, the measured slowdown of
misaligned vocab GEMMs, the in-step host scale, and `anatomy calibrate`'s pure parts and profile
files (all on CPU, with fake measurements where a measurement would be needed)."""
from __future__ import annotations

import json

import pytest

from llm_anatomy import io
from llm_anatomy.calculator import timing
from llm_anatomy.calculator.timing import fit, roofline
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.measure import calibrate, calibrate_host

ONE_B = ModelConfig.from_name("anchor-1b")


def _kernel(res: dict, name: str) -> dict:
    return next(k for k in res["kernels"] if k["name"] == name)


# ---- the GEMM efficiency model --------------------------------------------------------------------
def test_matmul_efficiency_cases():
    e = roofline.matmul_efficiency
    assert e(8192, 8192, 8192, 132) == pytest.approx(2048 / 2112)  # 16 waves of 128x256 tiles, the last 52% full
    assert e(128 * 133, 128, 128, 132) == pytest.approx(133 / 264)  # 133 tiles: a second wave for one tile
    assert e(512, 512, 256, 132) < 0.2  # 16 tiles on 132 SMs and no K to split
    assert e(512, 512, 65536, 132) > 0.9  # the same tiles, split-K fills the waves
    assert e(4096, 4096, 512, 132, k_half=128) == pytest.approx(e(4096, 4096, 512, 132) * 512 / 640)
    for shape in calibrate.gemm_grid():
        assert 0 < e(*shape, 132) <= 1


def test_fit_recovers_synthetic_rate_and_k_half():
    pts = [dict(m=m, n=n, k=k, tflops=700 * roofline.matmul_efficiency(m, n, k, 132, 128.0))
           for m, n, k in calibrate.gemm_grid()]
    rate, kh = fit.fit_matmul(pts, 132)
    assert kh == 128.0 and rate == pytest.approx(700e12, rel=1e-9)


def test_misaligned_vocab_factors():
    """calibrate's head GEMMs at a vocab that is not a multiple of 8, against the aligned vocab, become
    a slowdown per alignment class and per GEMM dimension (fake numbers: 4x slower at an odd vocab in
    the forward, 2x at vocab = 2 mod 8 in grad_input), applied to a GEMM only where a dim is misaligned."""
    assert [roofline.alignment_class(d) for d in (32000, 32001, 32002, 32004, 128256, 50257)] == [None, 1, 2, 4, None, 1]
    rows = [dict(op=op, rows=T, hidden=H, vocab=V, tflops=600.0 / (4 if (V, op) == (32001, "forward") else
                                                                    2 if (V, op) == (32002, "grad_input") else 1))
            for op, T, H, V in calibrate.vocab_grid()]
    f = fit.misaligned_factors(rows)
    assert f["1"] == pytest.approx(dict(n=0.25, k=1.0, m=1.0)) and f["2"] == pytest.approx(dict(n=1.0, k=0.5, m=1.0))
    assert f["4"] == pytest.approx(dict(n=1.0, k=1.0, m=1.0))
    prof = dict(matmul_misaligned=f)
    assert roofline.alignment_factor(prof, 4096, 32001, 512) == pytest.approx(0.25)  # logits, odd vocab: n
    assert roofline.alignment_factor(prof, 4096, 512, 32002) == pytest.approx(0.5)  # grad_input, vocab 2 mod 8: k
    assert roofline.alignment_factor(prof, 4096, 32000, 512) == 1.0 and roofline.alignment_factor({}, 4096, 32001, 512) == 1.0
    data = calibrate.build_profile(dict(_fake_measurements(), matmul_vocab=rows), dict(date="fake"), "h200-sxm")
    p = fit.from_measured(data)
    odd, even = (timing.estimate_time(ModelConfig(name="v", hidden=512, layers=1, heads=8, intermediate=1024, vocab=v),
                                      Run(4, 1024), "baseline", p, with_kernels=True) for v in (32001, 32000))
    assert _kernel(odd, "loss.lm_head")["compute_s"] == pytest.approx(
        4 * _kernel(even, "loss.lm_head")["compute_s"] * 32001 / 32000, rel=1e-3)


def test_accumulate_epilogue_bandwidth():
    """Liger's fp32-accumulating grad_weight at few-row chunks (calibrate.ACC_CHUNKS) sets the fraction
    of copy bandwidth its bytes move at (fake: the 128-row chunk at 60%, the others slower per byte,
    the compute-bound big shapes far below): the max over the rows of K <= 512; without such rows no
    term. The Liger loss's grad_weight then takes its memory term at that fraction, and nothing else does."""
    hbm = 4.0e12
    acc_bytes = lambda T, H, V: 2 * V * H * 4 + 2 * T * (V + H)  # noqa: E731
    frac = {128: 0.60, 256: 0.55, 512: 0.50}
    rows = [dict(op=op, rows=T, hidden=H, vocab=V, tflops=600.0,
                 ms=(acc_bytes(T, H, V) / hbm / frac[T] if T in frac else 2 * T * H * V / 600e12) * 1e3)
            for op, T, H, V in calibrate.vocab_grid()]
    assert {(r["rows"], r["hidden"]) for r in rows if r["rows"] in frac} == set(calibrate.ACC_CHUNKS)
    assert fit.accumulate_bandwidth(rows, hbm) == pytest.approx(0.60)
    assert fit.accumulate_bandwidth([r for r in rows if r["rows"] not in frac], hbm) is None
    m = dict(_fake_measurements(), matmul_vocab=rows, copy_tbps=hbm / 1e12)
    p = fit.from_measured(calibrate.build_profile(m, dict(date="fake"), "h200-sxm"))
    assert p["matmul_accumulate_bw"] == pytest.approx(0.60)
    p = dict(p, sustained_ratio={})  # burst rates: the two profiles' steps differ in length, not in regime
    p0 = dict(p, matmul_accumulate_bw=1.0)
    cfg = ModelConfig(name="v", hidden=2048, layers=1, heads=16, intermediate=4096, vocab=128256)
    a, b = (timing.estimate_time(cfg, Run(1, 4096), "efficient", q, with_kernels=True) for q in (p, p0))
    assert _kernel(a, "loss.grad_weight")["memory_s"] == pytest.approx(_kernel(b, "loss.grad_weight")["memory_s"] / 0.6)
    assert _kernel(a, "loss.logits")["memory_s"] == _kernel(b, "loss.logits")["memory_s"]


def test_widening_casts_take_the_calibrated_upcast_rate():
    """A bf16 -> fp32 cast measured at half the copy's rate (fake) sets upcast_bw = 0.5: under autocast every dW's
    cast back to its fp32 weight (the dense linears', the stacked experts') takes twice its copy-rate time, and the
    narrowing weight casts, the grouped GEMMs and every other copy keep theirs; a profile without the figure
    prices it as a copy."""
    m = dict(_fake_measurements(), upcast_tbps=2.05)
    p = fit.from_measured(calibrate.build_profile(m, dict(date="fake"), "h200-sxm"))
    assert p["upcast_bw"] == pytest.approx(0.5)
    p = dict(p, sustained_ratio={})  # burst rates: the two profiles' steps differ in length, not in regime
    p0 = dict(p, upcast_bw=1.0)
    assert fit.from_measured(calibrate.build_profile(_fake_measurements(), dict(date="fake"), "h200-sxm"))[
        "upcast_bw"] == 1.0
    cfg = ModelConfig(name="m", hidden=256, layers=1, heads=4, intermediate=512, vocab=1000, experts=8,
                      experts_per_token=2, expert_intermediate=128)
    a, b = (timing.estimate_time(cfg, Run(1, 512, "amp"), "efficient", q, with_kernels=True) for q in (p, p0))
    for name in ("attention.qkv.grad_weight_cast", "moe.experts.gate_up.grad_weight_cast",
                 "moe.experts.down.grad_weight_cast"):
        assert _kernel(a, name)["memory_s"] == pytest.approx(2 * _kernel(b, name)["memory_s"]), name
    for name in ("attention.qkv.weight_cast", "moe.experts.gate_up.weight_cast", "moe.experts.gate_up",
                 "moe.permute.gather"):
        assert _kernel(a, name)["memory_s"] == _kernel(b, name)["memory_s"], name


def test_misaligned_accumulate_follows_its_own_main_loop():
    """At a misaligned vocab Liger's fp32-accumulating grad_weight runs a fallback kernel whose rate climbs
    with the chunk's K on a curve of its own: fake rows of class 4 on 290 TFLOP/s x matmul_efficiency with
    k_half 400 (class 1 on 150 and 160) give back those figures, and the loss's grad_weight at a class-4
    vocab is priced on that curve, at its chunk's K, in place of the aligned rate x the accumulate factor;
    the other GEMMs keep theirs."""
    sms = fit.datasheet("h200-sxm").sms
    curve = {4: (290e12, 400.0), 1: (150e12, 160.0)}
    rows = [dict(op=op, rows=T, hidden=H, vocab=V, tflops=600.0, ms=2 * T * H * V / 600e12 * 1e3)
            for op, T, H, V in calibrate.vocab_grid()]
    for r in rows:
        a = roofline.alignment_class(r["vocab"])
        if r["op"] == "grad_weight_acc" and a is not None:
            R, kh = curve.get(a, curve[4])
            r["tflops"] = R * roofline.matmul_efficiency(r["vocab"], r["hidden"], r["rows"], sms, kh) / 1e12
    assert len({r["rows"] for r in rows if r["op"] == "grad_weight_acc" and r["vocab"] == 32004}) >= 3
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), matmul_vocab=rows), dict(date="fake"),
                                                  "h200-sxm"))
    mis = p["matmul_misaligned_accumulate"]
    assert set(mis) == {"1", "2", "4"}
    for a, (R, kh) in curve.items():
        assert mis[str(a)]["rate_flops"] == pytest.approx(R, rel=1e-9) and mis[str(a)]["k_half"] == kh
    p = dict(p, sustained_ratio={})
    cfg4 = ModelConfig(name="v4", hidden=2048, layers=1, heads=16, intermediate=4096, vocab=34732)  # class 4
    c, d = (timing.estimate_time(cfg4, Run(1, 4096), "efficient", q, with_kernels=True)
            for q in (p, dict(p, matmul_misaligned_accumulate={})))
    gw, gw0 = _kernel(c, "loss.grad_weight"), _kernel(d, "loss.grad_weight")
    _, V, H, K = gw["shape"]
    assert gw["rate_flops"] == pytest.approx(290e12 * roofline.matmul_efficiency(V, H, K, sms, 400.0), rel=1e-9)
    assert gw0["rate_flops"] == pytest.approx(
        p["matmul_flops"]["bfloat16"] * roofline.matmul_efficiency(V, H, K, sms, p["matmul_k_half"])
        * roofline.alignment_factor(p, V, H, K) * p["matmul_fp32_accumulate"], rel=1e-9)
    assert _kernel(c, "loss.logits")["compute_s"] == _kernel(d, "loss.logits")["compute_s"]


def test_host_scale_from_a_measured_tiny_step():
    """A profile with calibrate's tiny host-bound step: every forward and backward op's host figure
    scales by measured / modelled host time of that step (fake numbers: 3x for the baseline, 1.5x for
    the efficient model, whatever the split between the phases), for any config; the optimizer's is
    left as it was."""
    data = calibrate.build_profile(_fake_measurements(), dict(date="fake"), "h200-sxm")
    p0 = fit.from_measured(data)
    hs = dict(calibrate_host.HOST_STEP)
    cfg, run = ModelConfig(**hs["cfg"]), Run.from_record(hs)
    factors = dict(baseline=3.0, efficient=1.5)
    for v, f in factors.items():
        host = sum(timing.host_seconds(k, p0) for k in timing.kernels(cfg, run, v, None, None))
        hs[v] = dict(forward_ms=1e3 * f * host * 0.9, backward_ms=1e3 * f * host * 0.1, forward_backward_ms=1e3 * f * host)
    p = fit.from_measured(dict(data, measurements=dict(data["measurements"], host_step=hs)))
    assert timing.host_scale(p0, "baseline") == 1.0
    for variant, f in factors.items():
        assert timing.host_scale(p, variant) == pytest.approx(f)
        r0, r = (timing.estimate_time(ONE_B, Run(1, 512), variant, q, optimizer="adamw") for q in (p0, p))
        for ph in ("forward", "backward"):
            assert r["phases"][ph]["host_s"] == pytest.approx(f * r0["phases"][ph]["host_s"])
            assert r["phases"][ph]["gpu_s"] == pytest.approx(r0["phases"][ph]["gpu_s"])
        assert r["phases"]["optimizer"]["host_s"] == pytest.approx(r0["phases"]["optimizer"]["host_s"])


# ---- calibrate: its pure parts on CPU -------------------------------------------------------------
def test_gemm_grid_covers_the_model_family():
    grid = set(calibrate.gemm_grid())
    T = calibrate.GRID_TOKENS
    assert (8192, 8192, 8192) in grid
    for name in calibrate.GRID_PRESETS:
        c = ModelConfig.from_name(name)
        assert {(T, 3 * c.hidden, c.hidden), (T, c.hidden, c.intermediate), (c.hidden, c.intermediate, T)} <= grid


@pytest.mark.parametrize("device,base", [("NVIDIA H200", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("NVIDIA A100-SXM4-80GB",
                                                                                       "a100-80gb-sxm"),
                                         ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla T4", None)])
def test_guess_base(device, base):
    assert calibrate.guess_base(device) == base


def _fake_measurements() -> dict:
    """Fake numbers (not a measurement): a GEMM grid drawn from the model at 650 TFLOP/s, k_half 96."""
    mm = [dict(m=m, n=n, k=k, tflops=650 * roofline.matmul_efficiency(m, n, k, 132, 96.0)) for m, n, k in
          calibrate.gemm_grid()]
    att = [dict(backend="cudnn", B=16, heads=8, S=4096, hd=64, causal=True, fwd_ms=0.7, fwd_bwd_ms=2.6),
           dict(backend="cudnn", B=4, heads=16, S=4096, hd=128, causal=True, fwd_ms=0.6, fwd_bwd_ms=2.2)]
    return dict(matmul_bf16=mm, copy_tbps=4.1, launch_us=2.2, host_op_us=7.5, attention=att,
                host_custom_us=dict(rms_norm=dict(forward=90.0, backward=150.0), source="fake"))


def _liger_host_profile(**liger):
    """A profile from the fake measurements, with Liger's host figures (us) where given."""
    m = _fake_measurements()
    m["host_custom_us"] = dict(m["host_custom_us"], **({"liger_ce": liger} if liger else {}))
    return fit.from_measured(calibrate.build_profile(m, dict(date="fake"), "h200-sxm"))


def test_profile_json_round_trip(tmp_path):
    data = calibrate.build_profile(_fake_measurements(), dict(date="fake", gpu="fake", torch="fake",
                                                              command="pytest"), "h200-sxm")
    path = tmp_path / "h200.json"
    io.write_atomic(path, json.dumps(data))
    p = timing.get(str(path))
    assert p["name"] == "h200-measured" and p["kind"] == "measured"
    assert p["matmul_k_half"] == 96.0 and p["matmul_flops"]["bfloat16"] == pytest.approx(650e12)
    assert (p["hbm_Bps"], p["launch_s"], p["host_op_s"]) == pytest.approx((4.1e12, 2.2e-6, 7.5e-6))
    assert p["peak_flops"] == timing.get("h200-sxm")["peak_flops"]  # unmeasured: the datasheet's
    assert set(p["attention"]["cudnn"]) == {"64", "128"}
    r = timing.estimate_time(ONE_B, Run(4, 4096), "efficient", p, with_kernels=True)
    assert "hd128" in _kernel(r, "attention.sdpa")["note"] and "nearest" not in _kernel(r, "attention.sdpa")["note"]
    assert timing.estimate_time(ONE_B, Run(4, 4096), "efficient", json.loads(path.read_text()))["forward_backward_s"] \
        == r["forward_backward_s"]


def test_bad_profile_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError):
        timing.get(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError):
        timing.get(str(bad))
    with pytest.raises(ConfigError):
        calibrate.build_profile(dict(matmul_bf16=[]), {}, "no-such-gpu")


def test_calibrate_without_cuda_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibrate.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA" in err


SXS_FRAC = {"sxs.scale": 0.9, "sxs.mask_add": 0.34, "sxs.float": 0.5, "sxs.softmax": 0.52, "sxs.to_compute": 0.9,
            "sxs.softmax.backward": 0.45, "sxs.sink_cat": 0.4, "sxs.sink_slice_cast": 0.6, "sxs.sink_slice_backward": 0.7}


def sxs_profiles(hbm: float = 4.0e12):
    """(a profile with fake timings of every S x S op at SXS_FRAC of the copy bandwidth, one without them)."""
    from llm_anatomy.calculator.timing.op_bytes import fused_bytes
    from llm_anatomy.measure.calibrate_aten import SXS_OPS, SXS_ROWS, SXS_SEQS

    assert set(SXS_FRAC) == set(SXS_OPS)
    fused = [dict(op=op, tokens=SXS_ROWS, width=S, queued=True,
                  ms=(sum(fused_bytes(op, S, SXS_ROWS)) / hbm / SXS_FRAC[op] + 2.2e-6) * 1e3)
             for op in SXS_OPS for S in SXS_SEQS]
    return tuple(fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), copy_tbps=hbm / 1e12, **f),
                                                           dict(date="fake"), "h200-sxm")) for f in (dict(fused=fused), {}))


def test_baseline_sxs_chain_takes_its_calibrated_rates():
    """Fake timings (not a measurement) of the baseline's S x S ops at calibrate's sequence lengths, each
    at its own fraction of the copy bandwidth: the baseline step's kernels of those ops take exactly
    those times at a calibrated S (bytes / (bandwidth x fraction)), the fp32 policy keeps only the
    softmax's, and the efficient model does not change."""
    p, p0 = sxs_profiles()
    frac = SXS_FRAC
    cfg = ModelConfig(name="b", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=32000)
    a, b = (timing.estimate_time(cfg, Run(2, 2048), "baseline", q, with_kernels=True) for q in (p, p0))
    of = {"attention.scale": "sxs.scale", "attention.mask_add": "sxs.mask_add", "attention.float": "sxs.float",
          "attention.softmax": "sxs.softmax", "attention.to_compute": "sxs.to_compute",
          "attention.to_compute.backward": "sxs.float", "attention.softmax.backward": "sxs.softmax.backward",
          "attention.float.backward": "sxs.to_compute", "attention.scale.backward": "sxs.scale"}
    for name, op in of.items():
        assert _kernel(a, name)["memory_s"] == pytest.approx(_kernel(b, name)["memory_s"] / frac[op], rel=1e-3), name
    f32 = timing.estimate_time(cfg, Run(2, 2048, "fp32"), "baseline", p, with_kernels=True)
    f32_0 = timing.estimate_time(cfg, Run(2, 2048, "fp32"), "baseline", p0, with_kernels=True)
    assert _kernel(f32, "attention.softmax")["memory_s"] == pytest.approx(_kernel(f32_0, "attention.softmax")["memory_s"] / 0.52,
                                                                           rel=1e-3)
    assert _kernel(f32, "attention.scale")["memory_s"] == _kernel(f32_0, "attention.scale")["memory_s"]
    e, e0 = (timing.estimate_time(cfg, Run(2, 2048), "efficient", q, with_kernels=False)["forward_backward_s"] for q in (p, p0))
    assert e == e0


def test_fused_adamw_takes_its_calibrated_rate():
    """Fake timings (not a measurement) of torch's fused AdamW at calibrate's sizes, at 80% of the copy
    bandwidth: every AdamW kernel of a step takes exactly its bytes at that rate, AdEMAMix (not
    calibrated) stays on the copy roofline, and the forward and backward do not change (at burst rates:
    the sustained-load weight follows the whole step's length, optimizer included)."""
    from llm_anatomy.calculator.timing.op_bytes import fused_bytes
    from llm_anatomy.measure.calibrate_kernels import ADAMW_NUMELS, ADAMW_TENSORS

    hbm, frac = 4.0e12, 0.8
    fused = [dict(op="optimizer.adamw", tokens=ADAMW_TENSORS, width=n, queued=True,
                  ms=(sum(fused_bytes("optimizer.adamw", n, ADAMW_TENSORS)) / hbm / frac + 2.2e-6) * 1e3)
             for n in ADAMW_NUMELS]
    p, p0 = (fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), copy_tbps=hbm / 1e12, **f),
                                                            dict(date="fake"), "h200-sxm")) for f in (dict(fused=fused), {}))
    p, p0 = p.replace(sustained_ratio={}), p0.replace(sustained_ratio={})
    cfg = ModelConfig(name="o", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=32000)
    for variant in ("efficient", "baseline"):
        for opt, f in (("adamw", frac), ("ademamix", 1.0)):
            a, b = (timing.estimate_time(cfg, Run(2, 2048), variant, q, optimizer=opt, with_kernels=True) for q in (p, p0))
            ka, kb = ([k for k in r["kernels"] if k["phase"] == "optimizer"] for r in (a, b))
            assert len(ka) == len(kb) > 2
            for x, y in zip(ka, kb):
                assert x["memory_s"] == pytest.approx(y["memory_s"] / f, rel=1e-9), (variant, opt, x["name"])
            assert a["phases"]["backward"]["gpu_s"] == b["phases"]["backward"]["gpu_s"]


def test_at_host_speed_scales_every_host_figure_and_no_gpu_figure():
    """A tiny host step measured at 1.3x calibration's: every kernel's host time (eager ops, custom calls,
    Liger's in-place figures, the optimizer's) is 1.3x, the tiny-step scale and every GPU time unchanged;
    a profile without that variant's tiny step is refused."""
    p = _liger_host_profile(forward=800.0, chunk=150.0, backward=100.0)
    p = dict(p, host_step=dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0),
                               baseline=dict(forward_backward_ms=8.0)))
    cfg = ModelConfig(name="h", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=18042)
    for variant, base in (("efficient", 9.0), ("baseline", 8.0)):
        q = timing.at_host_speed(p, variant, 1.3 * base)
        assert timing.host_scale(q, variant) == pytest.approx(timing.host_scale(p, variant), rel=1e-12)
        a, b = (timing.estimate_time(cfg, Run(2, 2048), variant, x, optimizer="adamw", with_kernels=True) for x in (q, p))
        assert len(a["kernels"]) == len(b["kernels"])
        for x, y in zip(a["kernels"], b["kernels"]):
            assert x["host_s"] == pytest.approx(1.3 * y["host_s"], rel=1e-12) and x["time_s"] == y["time_s"], x["name"]
        assert sum(k["host_s"] for k in a["kernels"]) > 0
    with pytest.raises(ValueError, match="no tiny host step"):
        timing.at_host_speed(timing.get("h200-sxm"), "efficient", 10.0)


def test_baseline_eager_chains_take_their_calibrated_rates():
    """Fake timings (not a measurement) of the baseline's norm, loss tail, SwiGLU, gpt-oss clamps and RoPE, each
    chain as a whole at its own fraction of the copy bandwidth plus one launch per kernel: at a calibrated
    width and row count every kernel of the chain takes exactly its bytes at that fraction, the fp32 policy
    (not calibrated) keeps the copy roofline, gpt-oss's clamps take their own chain's rate, and the
    efficient model does not change."""
    from llm_anatomy.calculator.timing.op_bytes import EAGER_CHAINS, fused_bytes
    from llm_anatomy.measure.calibrate_aten import EAGER_CE_ROWS, EAGER_CE_VOCABS, ROPE_HEAD_DIMS, ROPE_ROWS
    from llm_anatomy.measure.calibrate_kernels import FUSED_TOKENS, RMS_WIDTHS, SWIGLU_WIDTHS

    hbm, launch = 4.0e12, 2.2e-6
    frac = {"eager_norm.forward": 0.75, "eager_norm.backward": 0.85, "eager_ce.forward": 0.8, "eager_ce.backward": 0.6,
            "eager_mlp.forward": 0.7, "eager_mlp.backward": 0.9, "eager_clamp.forward": 0.95, "eager_clamp.backward": 0.5,
            "eager_rope.forward": 0.35, "eager_rope.backward": 0.4}
    assert set(frac) == set(EAGER_CHAINS)
    grid = {"norm": (FUSED_TOKENS, RMS_WIDTHS), "ce": (EAGER_CE_ROWS, EAGER_CE_VOCABS), "mlp": (FUSED_TOKENS, SWIGLU_WIDTHS),
            "clamp": (FUSED_TOKENS, SWIGLU_WIDTHS), "rope": (ROPE_ROWS, ROPE_HEAD_DIMS)}
    fused = [dict(op=op, tokens=t, width=w, queued=True,
                  ms=(sum(fused_bytes(op, w, t)) / hbm / frac[op] + len(EAGER_CHAINS[op](t, w)) * launch) * 1e3)
             for op in frac for t, ws in (grid[op.split(".")[0][6:]],) for w in ws]
    p, p0 = (fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), copy_tbps=hbm / 1e12,
                                                                 launch_us=launch * 1e6, **f), dict(date="fake"), "h200-sxm"))
             for f in (dict(fused=fused), {}))
    cfg = ModelConfig(name="e", hidden=2048, layers=2, heads=16, intermediate=5632, vocab=32000)
    run = Run(4, 2048)  # 8192 tokens: the loss at its calibrated rows; norm and MLP rates are flat below 16384
    # (kernel name, phase) -> its chain, as launches.baseline_kernels names them
    comp = {"eager_norm": "norm", "eager_ce": "loss", "eager_mlp": "mlp", "eager_clamp": "mlp"}
    chain = {(f"{comp[op.split('.')[0]]}.{name}", op.split(".")[1]): op for op in frac if op.split(".")[0] in comp
             for name, _, _ in EAGER_CHAINS[op](1, 1)}
    # RoPE on q and k, hd 128 here: attention.rope_{q,k}.<op>, ".backward" after the backward's names
    chain |= {(f"attention.rope_{t}.{name}{'.backward' if ph == 'backward' else ''}", ph): f"eager_rope.{ph}"
              for t in "qk" for ph in ("forward", "backward") for name, _, _ in EAGER_CHAINS[f"eager_rope.{ph}"](1, 1)}
    oss = ModelConfig(name="o", hidden=2048, layers=2, heads=16, intermediate=5632, vocab=32000, mlp="gpt-oss")
    for c_, chains in ((cfg, set(frac) - {"eager_clamp.forward", "eager_clamp.backward"}), (oss, set(frac))):
        a, b = (timing.estimate_time(c_, run, "baseline", q, optimizer=None, with_kernels=True) for q in (p, p0))
        seen = set()
        for x, y in zip(a["kernels"], b["kernels"]):
            op = chain.get((x["name"], x["phase"]))
            seen.add(op)
            assert x["memory_s"] == pytest.approx(y["memory_s"] / (frac[op] if op else 1.0), rel=1e-9), x["name"]
        assert seen == chains | {None}, c_.mlp
    f32 = [timing.estimate_time(cfg, Run(4, 2048, "fp32"), "baseline", q, optimizer=None)["gpu_s"] for q in (p, p0)]
    assert f32[0] == f32[1]
    e = [timing.estimate_time(c_, run, "efficient", q, optimizer=None)["gpu_s"] for q in (p, p0) for c_ in (cfg, oss)]
    assert e[:2] == e[2:]


def test_embedding_backward_rate_is_calibrated_apart_from_its_zero_fill():
    """Fake embedding_dense_backward timings (not a measurement): the (V, H) fill at the copy rate, then the
    rest at 12% of it up to 3072 ids (the feature kernel) and 30% past (sort + segmented sum). At other
    vocabs, the model's fill follows V and the rest keeps its calibrated rate, per row count."""
    from llm_anatomy.calculator.timing.op_bytes import fused_bytes
    from llm_anatomy.calculator.timing.registry import launches as fused_launches
    from llm_anatomy.measure.calibrate_aten import EMBEDDING_ROWS, EMBEDDING_VOCAB, EMBEDDING_WIDTHS

    hbm, launch = 4.0e12, 2.2e-6
    eff = lambda T: 0.12 if T <= 3072 else 0.30  # noqa: E731
    law = lambda H, T: sum(fused_bytes("embedding.backward", H, T)) / hbm / eff(T)  # noqa: E731
    fused = [dict(op="embedding.backward", tokens=T, width=H, vocab=EMBEDDING_VOCAB, queued=True,
                  ms=(EMBEDDING_VOCAB * H * 4 / hbm + launch + fused_launches("embedding.backward", H, T) * launch
                      + law(H, T)) * 1e3) for T in EMBEDDING_ROWS for H in EMBEDDING_WIDTHS]
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), fused=fused, copy_tbps=hbm / 1e12),
                                                       dict(date="fake"), "h200-sxm"))
    for T, H, V in ((2048, 1024, 16000), (4096, 2048, 128256), (65536, 512, 50000)):
        cfg = ModelConfig(name="e", hidden=H, layers=1, heads=8, intermediate=2 * H, vocab=V)
        r = timing.estimate_time(cfg, Run(1, T), "efficient", p, with_kernels=True)
        assert _kernel(r, "embedding.backward.zero")["memory_s"] == pytest.approx(V * H * 4 / hbm, rel=1e-9)
        assert _kernel(r, "embedding.backward")["memory_s"] == pytest.approx(law(H, T), rel=1e-3), (T, H, V)
        assert _kernel(r, "embedding.backward")["count"] == (1 if T <= 3072 else 30)
