"""The timing model (anatomy/calculator/timing.py, gpus.py) and its calibration (anatomy/measure/calibrate.py).

CPU tests check the model's internal claims (profiles and their sources, monotonicity, bound
classification, FLOP bookkeeping, MFU) and compare its predictions with the committed H200
records; the gpu-marked test times full steps in-process and holds the model to ±10%.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from anatomy.calculator import estimate, gpus, timing
from anatomy.calculator.optimizer import step_bytes_moved
from anatomy.config import ConfigError, ModelConfig, Run
from anatomy.measure import calibrate

SEED, ONE_B = ModelConfig.from_name("seed"), ModelConfig.from_name("anchor-1b")
SEED_RUN = Run(16, 4096, "amp")
GQA = ModelConfig(name="gqa", hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2816, vocab=32000)


def _kernel(res: dict, name: str) -> dict:
    return next(k for k in res["kernels"] if k["name"] == name)


# ---- profiles -------------------------------------------------------------------------------------
def test_calculator_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from anatomy.calculator import timing, gpus\n"
            "from anatomy.config import ModelConfig, Run\n"
            "timing.estimate_time(ModelConfig.from_name('seed'), Run(2, 256), 'efficient', 'h200-measured')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", ["H200", "h200-sxm", "NVIDIA H200", "h200_SXM", " h200 "])
def test_lookup_is_case_insensitive(name):
    assert gpus.get(name)["name"] == "h200-sxm"


@pytest.mark.parametrize("name", ["h200-measured", "H200-Measured", "h200:measured"])
def test_measured_lookup(name):
    p = gpus.get(name)
    assert p["name"] == "h200-measured" and p["kind"] == "measured"


def test_unknown_gpu_is_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        gpus.get("tpu-v5")
    assert "\n" not in str(e.value) and "tpu-v5" in str(e.value)
    with pytest.raises(ConfigError):
        timing.estimate_time(SEED, SEED_RUN, "efficient", "b300")


@pytest.mark.parametrize("name", sorted(gpus.DATASHEET))
def test_datasheet_profiles_carry_sources(name):
    p = gpus.get(name)
    assert p["kind"] == "datasheet" and p["sms"] > 0 and p["hbm_Bps"] > 0
    assert p["peak_flops"]["bfloat16"] > p["peak_flops"]["float32"] > 0
    for key in ("peak_flops", "hbm_Bps", "sms"):
        assert "https://" in p["sources"][key], (name, key)
    for key in ("launch_s", "host_op_s"):  # unmeasured: must say it is an assumption
        assert "assumption" in p["sources"][key]


def test_datasheet_figures():
    """Dense (no 2:4 sparsity) bf16 with fp32 accumulate, and HBM bandwidth, as the sources print them."""
    got = {n: (p["peak_flops"]["bfloat16"] / 1e12, p["hbm_Bps"] / 1e9) for n, p in gpus.DATASHEET.items()}
    assert got == {"a100-40gb-sxm": (312.0, 1555.0), "a100-80gb-sxm": (312.0, 2039.0), "h100-sxm": (989.4, 3350.0),
                   "h200-sxm": (989.4, 4800.0), "rtx-3090": (71.0, 936.0), "rtx-4090": (165.2, 1008.0),
                   "h100-pcie": (756.5, 2000.0), "l40s": (362.05, 864.0), "l4": (121.0, 300.0)}


@pytest.mark.parametrize("device_name, profile", [
    ("NVIDIA H200", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla T4", None)])
def test_device_names_map_to_one_datasheet_table(device_name, profile):
    """torch's device names pick a datasheet profile (first match wins: "H100 PCIe" before "H100",
    "L40S" before "L4"); `anatomy train`'s MFU reads its peak from the same table."""
    p = gpus.for_device_name(device_name)
    assert (p and p["name"]) == profile


def test_measured_profile_is_the_recorded_h200_figures():
    """Only numbers recorded on 2026-11-29 (ANCHORS.md, BENCH.md); unmeasured ones stay labelled assumptions."""
    p = gpus.get("h200-measured")
    assert p["mfu_peak_flops"] == 781e12 and p["hbm_Bps"] == 4.24e12
    assert p["sources"]["launch_s"] == gpus.ASSUMED_LAUNCH and p["sources"]["host_op_s"] == gpus.ASSUMED_HOST
    for key in ("date", "torch", "command", "gpu"):
        assert p["provenance"][key]
    assert p["host_custom_s"]["rms_norm"] == {"forward": 139.0e-6, "backward": 221.3e-6}
    # the profile reproduces the ANCHORS attention table at its own shape (a round trip, not a prediction)
    anchors = {"cudnn": (0.673, 2.50), "flash": (1.033, 4.05), "memory-efficient": (2.296, 9.32)}
    for backend, (fwd_ms, fb_ms) in anchors.items():
        ks = [k for k in timing.efficient_kernels(SEED, Run(16, 4096, "amp"), backend) if k.kind == "sdpa"]
        t = {k.phase: timing.time_kernel(k, p) for k in ks}
        per = {ph: (r["compute_s"] / r["count"]) * 1e3 for ph, r in t.items()}
        assert per["forward"] == pytest.approx(fwd_ms, rel=1e-9)
        assert per["forward"] + per["backward"] == pytest.approx(fb_ms, rel=1e-9)
    assert p["matmul_fit"][0]["model_tflops"] == pytest.approx(781.0)


def test_interconnect_reuses_comm_profiles():
    assert gpus.interconnect("H200")["nvlink_GBps"] == 450.0
    assert gpus.interconnect("a100-40gb")["nvlink_GBps"] == 300.0
    assert gpus.interconnect("rtx-4090") is None


# ---- the GEMM efficiency model --------------------------------------------------------------------
def test_matmul_efficiency_cases():
    e = gpus.matmul_efficiency
    assert e(8192, 8192, 8192, 132) == pytest.approx(2048 / 2112)  # 16 waves of 128x256 tiles, the last 52% full
    assert e(128 * 133, 128, 128, 132) == pytest.approx(133 / 264)  # 133 tiles: a second wave for one tile
    assert e(512, 512, 256, 132) < 0.2  # 16 tiles on 132 SMs and no K to split
    assert e(512, 512, 65536, 132) > 0.9  # the same tiles, split-K fills the waves
    assert e(4096, 4096, 512, 132, k_half=128) == pytest.approx(e(4096, 4096, 512, 132) * 512 / 640)
    for shape in calibrate.gemm_grid():
        assert 0 < e(*shape, 132) <= 1


def test_fit_recovers_synthetic_rate_and_k_half():
    pts = [dict(m=m, n=n, k=k, tflops=700 * gpus.matmul_efficiency(m, n, k, 132, 128.0))
           for m, n, k in calibrate.gemm_grid()]
    rate, kh = gpus.fit_matmul(pts, 132)
    assert kh == 128.0 and rate == pytest.approx(700e12, rel=1e-9)


def test_misaligned_vocab_factors():
    """calibrate's head GEMMs at a vocab that is not a multiple of 8, against the aligned vocab, become
    a slowdown per alignment class and per GEMM dimension (fake numbers: 4x slower at an odd vocab in
    the forward, 2x at vocab = 2 mod 8 in grad_input), applied to a GEMM only where a dim is misaligned."""
    assert [gpus.alignment_class(d) for d in (32000, 32001, 32002, 32004, 128256, 50257)] == [None, 1, 2, 4, None, 1]
    rows = [dict(op=op, rows=T, hidden=H, vocab=V, tflops=600.0 / (4 if (V, op) == (32001, "forward") else
                                                                    2 if (V, op) == (32002, "grad_input") else 1))
            for op, T, H, V in calibrate.vocab_grid()]
    f = gpus.misaligned_factors(rows)
    assert f["1"] == pytest.approx(dict(n=0.25, k=1.0, m=1.0)) and f["2"] == pytest.approx(dict(n=1.0, k=0.5, m=1.0))
    assert f["4"] == pytest.approx(dict(n=1.0, k=1.0, m=1.0))
    prof = dict(matmul_misaligned=f)
    assert gpus.alignment_factor(prof, 4096, 32001, 512) == pytest.approx(0.25)  # logits, odd vocab: n
    assert gpus.alignment_factor(prof, 4096, 512, 32002) == pytest.approx(0.5)  # grad_input, vocab 2 mod 8: k
    assert gpus.alignment_factor(prof, 4096, 32000, 512) == 1.0 and gpus.alignment_factor({}, 4096, 32001, 512) == 1.0
    data = calibrate.build_profile(dict(_fake_measurements(), matmul_vocab=rows), dict(date="fake"), "h200-sxm")
    p = gpus.from_measured(data)
    odd, even = (timing.estimate_time(ModelConfig(name="v", hidden=512, layers=1, heads=8, intermediate=1024, vocab=v),
                                      Run(4, 1024), "baseline", p, with_kernels=True) for v in (32001, 32000))
    assert _kernel(odd, "loss.lm_head")["compute_s"] == pytest.approx(
        4 * _kernel(even, "loss.lm_head")["compute_s"] * 32001 / 32000, rel=1e-3)


def test_host_scale_from_a_measured_tiny_step():
    """A profile with calibrate's tiny host-bound step: every forward and backward op's host figure
    scales by measured / modelled host time of that step (fake numbers: 3x for the baseline, 1.5x for
    the efficient model, whatever the split between the phases), for any config; the optimizer's is
    left as it was."""
    data = calibrate.build_profile(_fake_measurements(), dict(date="fake"), "h200-sxm")
    p0 = gpus.from_measured(data)
    hs = dict(calibrate.HOST_STEP)
    cfg, run = ModelConfig(**hs["cfg"]), Run(hs["batch"], hs["seq"], hs["dtype"])
    factors = dict(baseline=3.0, efficient=1.5)
    for v, f in factors.items():
        host = sum(timing.host_seconds(k, p0) for k in timing.kernels(cfg, run, v, None, None))
        hs[v] = dict(forward_ms=1e3 * f * host * 0.9, backward_ms=1e3 * f * host * 0.1, forward_backward_ms=1e3 * f * host)
    p = gpus.from_measured(dict(data, measurements=dict(data["measurements"], host_step=hs)))
    assert timing.host_scale(p0, "baseline") == dict(forward=1.0, backward=1.0)
    for variant, f in factors.items():
        assert timing.host_scale(p, variant) == pytest.approx(dict(forward=f, backward=f))
        r0, r = (timing.estimate_time(ONE_B, Run(1, 512), variant, q, optimizer="adamw") for q in (p0, p))
        for ph in ("forward", "backward"):
            assert r["phases"][ph]["host_s"] == pytest.approx(f * r0["phases"][ph]["host_s"])
            assert r["phases"][ph]["gpu_s"] == pytest.approx(r0["phases"][ph]["gpu_s"])
        assert r["phases"]["optimizer"]["host_s"] == pytest.approx(r0["phases"]["optimizer"]["host_s"])


# ---- predictions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", timing.VARIANTS)
@pytest.mark.parametrize("gpu", ["h200-measured", "h200-sxm", "a100-80gb-sxm", "rtx-4090"])
@pytest.mark.parametrize("cfg", [SEED, GQA], ids=["seed", "gqa"])
def test_predictions_positive_and_monotone(variant, gpu, cfg):
    """GPU time grows strictly with batch and sequence; the step time never shrinks (it is flat
    where the host's issue time, which does not depend on the sizes, is the bound)."""
    for runs in ([Run(B, 1024, "amp") for B in (1, 2, 4, 8)], [Run(2, S, "amp") for S in (256, 512, 1024, 2048)]):
        prev = (0.0, 0.0)
        for run in runs:
            r = timing.estimate_time(cfg, run, variant, gpu)
            assert all(k["time_s"] > 0 and k["count"] >= 1 for k in r["kernels"])
            assert r["gpu_s"] > prev[0] and r["forward_backward_s"] >= prev[1]
            prev = (r["gpu_s"], r["forward_backward_s"])
    assert r["step_s"] > r["forward_backward_s"] > 0 and r["optimizer_s"] > 0


def test_bound_classification():
    eff = timing.estimate_time(SEED, SEED_RUN, "efficient", "h200-measured")
    base = timing.estimate_time(SEED, SEED_RUN, "baseline", "h200-measured")
    big = timing.time_kernel(timing.Kernel("mm", "x", "forward", "matmul", 1, 2 * 8192 ** 3, 3 * 8192 ** 2 * 2,
                                           (1, 8192, 8192, 8192)), gpus.get("h200-measured"))
    assert big["bound"] == "compute" and big["time_s"] * 1e3 == pytest.approx(2 * 8192 ** 3 / 781e12 * 1e3 + 3e-3)
    for name in ("attention.qkv", "mlp.gate_up", "mlp.down.grad_weight", "attention.sdpa", "attention.sdpa.backward",
                 "loss.logits"):
        assert _kernel(eff, name)["bound"] == "compute", name
    for name in ("norm.rms_norm", "mlp.swiglu", "attention.rope_qkv", "attention.residual_add",
                 "loss.cross_entropy"):
        assert _kernel(eff, name)["bound"] == "memory", name
    for name in ("norm.rms_norm.dw_sum", "loss.sum", "loss.backward_check"):
        assert _kernel(eff, name)["bound"] == "launch", name
    # the baseline's S x S work is memory-bound: QKᵀ at head dim 64 does 64 FLOPs per output byte
    for name in ("attention.scores", "attention.probs_v", "attention.softmax", "attention.softmax.backward"):
        assert _kernel(base, name)["bound"] == "memory", name


@pytest.mark.parametrize("cfg", [SEED, GQA, ModelConfig.from_name("llama3.2-1b")], ids=["seed", "gqa", "tied"])
def test_matmul_flops_match_the_calculator(cfg):
    """The kernels' FLOPs are the calculator's: the baseline's matmuls are exactly the counter
    convention; the efficient model's matmuls plus causal SDPA (fwd F, bwd 2F) are the model one."""
    run = Run(2, 512, "amp")
    fl = estimate(cfg, run, "baseline", "cuda").to_dict()["flops"]["counter"]
    mm = sum(k.flops * k.count for k in timing.baseline_kernels(cfg, run) if k.kind == "matmul")
    assert mm == fl["forward"] + fl["backward"]
    fl = estimate(cfg, run, "efficient", "cuda").to_dict()["flops"]["model"]
    ks = timing.efficient_kernels(cfg, run)
    mm = sum(k.flops * k.count for k in ks if k.kind == "matmul")
    sdpa_fwd = sum(k.flops * k.count for k in ks if k.kind == "sdpa" and k.phase == "forward")
    assert mm + 3 * sdpa_fwd == fl["forward"] + fl["backward"]


def test_mfu_definitions():
    for gpu, peak in (("h200-measured", 781e12), ("h200-sxm", 989.4e12)):
        r = timing.estimate_time(SEED, SEED_RUN, "efficient", gpu, with_kernels=False)
        fl = estimate(SEED, SEED_RUN, "efficient", "cuda").to_dict()["flops"]
        for conv in ("model", "counter"):
            assert r["mfu"][conv] == pytest.approx((fl[conv]["forward"] + fl[conv]["backward"])
                                                   / r["forward_backward_s"] / peak)
        assert 0 < r["mfu"]["model"] < r["mfu"]["counter"] < 1  # counter: causal not halved, bwd 2.5x
        assert r["mfu"]["peak_flops"] == peak


def test_optimizer_phase():
    eff = timing.optimizer_kernels(SEED, SEED_RUN, "efficient")
    from anatomy.calculator import param_count

    assert sum(k.bytes * k.count for k in eff) == step_bytes_moved(param_count(SEED), "ademamix")  # one pass
    for v in timing.VARIANTS:
        for cfg in (SEED, GQA, ModelConfig.from_name("llama3.2-1b")):
            assert sum(n * c for n, c in timing.param_sizes(cfg, v).items()) == param_count(cfg)
    base = timing.optimizer_kernels(SEED, SEED_RUN, "baseline")
    assert sum(k.bytes * k.count for k in base) > 4 * sum(k.bytes * k.count for k in eff)
    mem = {o: sum(k["memory_s"] for k in timing.estimate_time(ONE_B, Run(4, 4096), "efficient", "h200-measured",
                                                               optimizer=o)["kernels"] if k["phase"] == "optimizer")
           for o in ("ademamix", "adamw")}
    assert mem["ademamix"] / mem["adamw"] == pytest.approx(9 / 7, rel=1e-6)  # bandwidth-bound: 36 B vs 28 B


def test_host_sync_segments():
    """Liger's .item() before the loss and torch.equal at the start of its backward split the step."""
    r = timing.estimate_time(SEED, SEED_RUN, "efficient", "h200-measured", with_kernels=False)
    assert [s["starts_at"] for s in r["segments"]][:3] == ["embedding.gather", "loss.count_targets",
                                                           "loss.backward_check"]
    assert r["segments"][3]["phase"] == "optimizer" and len(r["segments"]) == 4
    assert r["forward_backward_s"] == pytest.approx(sum(s["time_s"] for s in r["segments"][:3]))
    tiny = timing.estimate_time(ModelConfig(hidden=64, layers=2, heads=4, intermediate=96, vocab=128), Run(1, 16),
                                "efficient", "h200-measured")
    assert all(s["bound"] == "host" for s in tiny["segments"])  # microscopic tensors: the CPU is the limit


def test_datasheet_profile_is_more_optimistic_than_measured():
    for cfg, run, v in ((SEED, SEED_RUN, "efficient"), (ONE_B, Run(4, 4096), "efficient"),
                        (SEED, SEED_RUN, "baseline")):
        ds = timing.estimate_time(cfg, run, v, "h200-sxm", with_kernels=False)["forward_backward_s"]
        ms = timing.estimate_time(cfg, run, v, "h200-measured", with_kernels=False)["forward_backward_s"]
        assert ds < ms


def test_efficient_fp32_is_not_modelled():
    with pytest.raises(ConfigError):
        timing.estimate_time(SEED, Run(2, 256, "fp32"), "efficient", "h200-sxm")
    assert timing.estimate_time(SEED, Run(2, 256, "fp32"), "baseline", "h200-sxm")["forward_backward_s"] > 0


# ---- against the committed H200 records -----------------------------------------------------------
RECORDS = {row["record"]: row for row in timing.compare_committed("h200-measured")}


def test_committed_records_are_present():
    assert set(RECORDS) == {rel for rel, _ in timing.STEP_RECORDS}


# Known misses of the uncalibrated model (docs/timing.md says why): strict, so a fix that brings one
# within ±10% turns its XPASS into a failure and the mark must come off.
_KNOWN_MISSES = {"session1/step-seed-efficient.json", "session3/step-seed-efficient.json",
                 "session1/step-seed-baseline.json"}


@pytest.mark.parametrize("rel", [pytest.param(rel, marks=pytest.mark.xfail(strict=True, reason="known miss of the "
                                 "uncalibrated model")) if rel in _KNOWN_MISSES else rel
                                 for rel, _ in timing.STEP_RECORDS])
def test_committed_steps_within_10pct(rel, claims):
    """The ±10% goal against each committed step record; every comparison lands in the claims report."""
    r = RECORDS[rel]
    claims.check("step time (fwd+bwd) vs committed H200 record", component="model", config=rel, variant="efficient"
                 if "efficient" in rel else "baseline", predicted=r["predicted_ms"], measured=r["measured_ms"],
                 tolerance=0.10, device="cuda (recorded)", unit="ms")


def test_the_two_seed_records_cannot_both_be_within_10pct():
    """session1 and session3 timed the same code, torch and GPU model on two machines 18 minutes
    apart: 59.7 vs 45.3 ms. No single prediction is within ±10% of both (45.3 x 1.1 < 59.7 x 0.9),
    so a ±10% claim on the seed step can only hold against one machine."""
    a = RECORDS["session1/step-seed-efficient.json"]["measured_ms"]
    b = RECORDS["session3/step-seed-efficient.json"]["measured_ms"]
    assert max(a, b) * 0.9 > min(a, b) * 1.1


@pytest.mark.parametrize("row", timing.compare_kernel_records("h200-measured"), ids=lambda r: r["what"].split()[0])
def test_committed_kernels_are_lower_bounded(row):
    """Fused kernels (fwd + bwd, isolated) and optimizer steps: max(GPU, host) is below the measurement."""
    assert 0 < row["predicted_ms"] < row["measured_ms"], row


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
    mm = [dict(m=m, n=n, k=k, tflops=650 * gpus.matmul_efficiency(m, n, k, 132, 96.0)) for m, n, k in
          calibrate.gemm_grid()]
    att = [dict(backend="cudnn", B=16, heads=8, S=4096, hd=64, causal=True, fwd_ms=0.7, fwd_bwd_ms=2.6),
           dict(backend="cudnn", B=4, heads=16, S=4096, hd=128, causal=True, fwd_ms=0.6, fwd_bwd_ms=2.2)]
    return dict(matmul_bf16=mm, copy_tbps=4.1, launch_us=2.2, host_op_us=7.5, attention=att,
                host_custom_us=dict(rms_norm=dict(forward=90.0, backward=150.0), source="fake"))


def test_profile_json_round_trip(tmp_path):
    data = calibrate.build_profile(_fake_measurements(), dict(date="fake", gpu="fake", torch="fake",
                                                              command="pytest"), "h200-sxm")
    path = gpus.write_atomic(tmp_path / "h200.json", data)
    assert not list(tmp_path.glob("*.tmp"))
    p = gpus.get(str(path))
    assert p["name"] == "h200-measured" and p["kind"] == "measured"
    assert p["matmul_k_half"] == 96.0 and p["matmul_flops"]["bfloat16"] == pytest.approx(650e12)
    assert (p["hbm_Bps"], p["launch_s"], p["host_op_s"]) == pytest.approx((4.1e12, 2.2e-6, 7.5e-6))
    assert p["peak_flops"] == gpus.DATASHEET["h200-sxm"]["peak_flops"]  # unmeasured: the datasheet's
    assert set(p["attention"]["cudnn"]) == {"64", "128"}
    r = timing.estimate_time(ONE_B, Run(4, 4096), "efficient", p, with_kernels=True)
    assert "hd128" in _kernel(r, "attention.sdpa")["note"] and "nearest" not in _kernel(r, "attention.sdpa")["note"]
    assert timing.estimate_time(ONE_B, Run(4, 4096), "efficient", json.loads(path.read_text()))["forward_backward_s"] \
        == r["forward_backward_s"]


def test_bad_profile_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError):
        gpus.get(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError):
        gpus.get(str(bad))
    with pytest.raises(ConfigError):
        calibrate.build_profile(dict(matmul_bf16=[]), {}, "no-such-gpu")


def test_calibrate_without_cuda_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibrate.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA" in err


# ---- on the GPU -----------------------------------------------------------------------------------
GPU_CASES = {"seed-efficient-B16S4096": ("seed", 16, 4096, "efficient"),
             "anchor1b-efficient-B4S4096": ("anchor-1b", 4, 4096, "efficient"),
             "seed-baseline-B16S4096": ("seed", 16, 4096, "baseline")}


def _measure_step_ms(cfg: ModelConfig, run: Run, variant: str, warmup: int = 3, repeats: int = 10) -> list[float]:
    """Forward + backward under bf16 autocast over fp32 weights, CUDA events, inputs rotated: as
    bench/step.py. Reads no calculator."""
    import torch

    from anatomy.models import build_model

    model = build_model(cfg, variant, device="cuda")
    ids = [torch.randint(0, cfg.vocab, (run.batch, run.seq), device="cuda") for _ in range(2)]
    times = []
    for i in range(warmup + repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[i % 2], ids[i % 2])
        loss.backward()
        b.record()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    del model
    torch.cuda.empty_cache()
    return times


# The eager baseline at the seed step runs its S x S softmax, mask and casts below the copy roofline:
# 396-398 ms measured against 285-287 predicted on two H200 machines (reports/h200/session4b, 4c).
_GPU_MISSES = {"seed-baseline-B16S4096": "eager S x S kernels below the roofline: -28% on the committed probe rows"}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_GPU_MISSES[c]))
                                  if c in _GPU_MISSES else c for c in GPU_CASES])
def test_step_time_within_10pct_gpu(case, claims, cuda_device):
    """Predicted vs measured forward + backward on this GPU, ±10% (the DESIGN goal for time). The
    profile is $ANATOMY_GPU_PROFILE (a name or a path; default h200-measured): run `anatomy
    calibrate` first in the same session so the profile describes this machine."""
    preset, B, S, variant = GPU_CASES[case]
    cfg, run = ModelConfig.from_name(preset), Run(B, S, "amp")
    times = _measure_step_ms(cfg, run, variant)
    measured = statistics.median(times)
    profile = os.environ.get("ANATOMY_GPU_PROFILE", "h200-measured")
    pred = timing.estimate_time(cfg, run, variant, profile, optimizer=None, with_kernels=False)
    claims.check("time.forward_backward", component="model", config=f"{preset}/B{B}S{S}/amp", variant=variant,
                 predicted=pred["forward_backward_s"] * 1e3, measured=measured, tolerance=0.10, device="cuda",
                 unit="ms", note=f"profile {profile}; steps {min(times):.1f}-{max(times):.1f} ms")
    assert math.isfinite(measured)
