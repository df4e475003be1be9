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


def test_committed_h200_profile_is_a_calibration():
    """The committed `h200-measured` profile is an `anatomy calibrate` output, byte for byte the one a
    recorded H200 run wrote (reports/h200/session13), with its provenance; every figure the datasheet
    had is replaced by a measurement, and the attention table reproduces the SDPA rows it measured at
    their own shapes (a round trip, not a prediction)."""
    from pathlib import Path

    committed = Path(gpus.PROFILE_DIR / "h200.json")
    assert committed.read_bytes() == (Path(__file__).parent.parent / "reports/h200/session13/h200.json").read_bytes()
    p = gpus.get("h200-measured")
    assert p["provenance"]["command"].startswith("anatomy calibrate") and p["provenance"]["gpu"] == "NVIDIA H200"
    for key in ("date", "torch", "cuda", "triton", "cudnn"):
        assert p["provenance"][key]
    for key in ("matmul_flops", "hbm_Bps", "launch_s", "host_op_s", "host_custom_s", "attention", "mfu_peak_flops"):
        assert p["sources"][key].startswith("measured"), key
    assert p["matmul_k_half"] > 0 and set(p["host_custom_s"]) >= {"rms_norm", "swiglu", "rope_qkv", "liger_ce"}
    from anatomy.measure.calibrate_aten import SXS_OPS, SXS_SEQS
    from anatomy.measure.calibrate_kernels import LIGER_VOCABS

    fused = {(r["op"], r["width"]) for r in p["fused_rows"]}
    assert {(op, S) for op in SXS_OPS for S in SXS_SEQS} <= fused and {("liger_ce", V) for V in LIGER_VOCABS} <= fused
    m = json.loads(committed.read_text())["measurements"]
    for row in m["attention"]:
        if row["S"] != 4096 or row["backend"] in p["sdpa_schedule"]:  # those are timed by their schedule, below
            continue
        ks = [k for k in timing.efficient_kernels(ModelConfig(name="a", hidden=row["heads"] * row["hd"], layers=1,
                                                              heads=row["heads"], intermediate=256, vocab=256),
                                                  Run(row["B"], row["S"], "amp"), row["backend"]) if k.kind == "sdpa"]
        t = {k.phase: timing.time_kernel(k, p) for k in ks}
        per = {ph: (r["compute_s"] / r["count"]) * 1e3 for ph, r in t.items()}
        assert per["forward"] == pytest.approx(row["fwd_ms"], rel=1e-9)
        assert per["forward"] + per["backward"] == pytest.approx(row["fwd_bwd_ms"], rel=1e-9)
    # cuDNN's CTA schedule (session 12 on) holds every main-kernel duration it was fitted to within 5%
    from anatomy.measure.calibrate_sdpa import schedule_shapes

    assert {(r["B"], r["heads"], r["S"], r["hd"]) for r in m["attention_kernels"]} == set(schedule_shapes())
    assert all(e["max_error"] < 0.05 for e in p["sdpa_schedule"]["cudnn"].values())


def test_interconnect_reuses_comm_profiles():
    assert gpus.interconnect("H200")["nvlink_GBps"] == 450.0
    assert gpus.interconnect("a100-40gb")["nvlink_GBps"] == 300.0
    assert gpus.interconnect("rtx-4090") is None


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
    p = gpus.get("h200-measured")
    big = timing.time_kernel(timing.Kernel("mm", "x", "forward", "matmul", 1, 2 * 8192 ** 3, 3 * 8192 ** 2 * 2,
                                           (1, 8192, 8192, 8192)), p)
    rate = p["matmul_flops"]["bfloat16"] * gpus.matmul_efficiency(8192, 8192, 8192, p["sms"], p["matmul_k_half"])
    assert big["bound"] == "compute" and big["time_s"] == pytest.approx(
        2 * 8192 ** 3 / rate + max(p["launch_s"], p["kernel_gap_s"]))
    for name in ("attention.qkv", "mlp.gate_up", "mlp.down.grad_weight", "attention.sdpa", "attention.sdpa.backward",
                 "loss.logits"):
        assert _kernel(eff, name)["bound"] == "compute", name
    for name in ("norm.rms_norm", "mlp.swiglu", "attention.rope_qkv", "attention.residual_add",
                 "loss.cross_entropy"):
        assert _kernel(eff, name)["bound"] == "memory", name
    for name in ("norm.rms_norm.dw_sum", "loss.sum", "loss.backward_check"):
        assert _kernel(eff, name)["bound"] == "launch", name
    # the baseline's S x S work is memory-bound; QKᵀ at head dim 64 (32 FLOPs per byte, its main loop at
    # k / (k + k_half) of the GEMM rate) sits near the measured ridge. Where exactly moves with the fitted
    # k_half: compute / memory was 1.05, 0.94, 1.25, 1.27 and 1.12 on session9f's and session10-10d's profiles
    # (k_half 144, 120, 184, 200, 160)
    for name in ("attention.probs_v", "attention.softmax", "attention.softmax.backward"):
        assert _kernel(base, name)["bound"] == "memory", name
    sc = _kernel(base, "attention.scores")
    assert 0.8 < sc["compute_s"] / sc["memory_s"] < 1.5


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
    # the measured ceiling: the best GEMM calibrate timed in a loop (ANCHORS' convention)
    measured_peak = max(r["tflops"] for r in json.loads((gpus.PROFILE_DIR / "h200.json").read_text())["measurements"]
                        ["matmul_bf16"]) * 1e12
    for gpu, peak in (("h200-measured", measured_peak), ("h200-sxm", 989.4e12)):
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
    # on the datasheet's roofline (the measured profile times torch's fused AdamW at its calibrated rate)
    mem = {o: sum(k["memory_s"] for k in timing.estimate_time(ONE_B, Run(4, 4096), "efficient", "h200-sxm",
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


# Known misses against the committed profile (session13's calibration; these records are bench/step.py runs
# of sessions 1-6, on other machines and before the fused ops' fast path; docs/timing.md): strict, so a fix
# that brings one within ±10% turns its XPASS into a failure and the mark must come off. Calibrate's GEMM rate
# moves 811-838 TFLOP/s between runs (sessions 10d-13; 836 in 13), and these GEMM-heavy records were timed at
# the power cap (docs/timing.md assumption 9): the efficient ones read -8.8% to -11.4%, two of them just past.
_KNOWN_MISSES = {"session1/step-seed-efficient.json": "session 1's slow host (-28.6%)",
                 "session1/step-1b-efficient.json": "-11.4% (-10.7% on session12b's profile, -12.0% on session12's)",
                 "session6/step-anchor-1b-efficient-recompute.json": "-10.2% (-9.5% on session12b's profile)"}


@pytest.mark.parametrize("rel", [pytest.param(rel, marks=pytest.mark.xfail(strict=True, reason="known miss, an older "
                                 f"record on another machine: {_KNOWN_MISSES[rel]}")) if rel in _KNOWN_MISSES else rel
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


# These isolated calls are host-bound, so their bound moves with the calibrating process's host: session11d's
# was slow (Liger's chunk 246 us against 149 in 11c) and put two of them over session 1's records; session13's
# (the committed profile) puts every one under. Strict: a slower calibration that crosses one fails here first.
_SLOW_HOST: dict[str, str] = {}


@pytest.mark.parametrize("row", [pytest.param(r, marks=[pytest.mark.xfail(strict=True, reason=_SLOW_HOST[k])] if k in
                                              _SLOW_HOST else []) for r in timing.compare_kernel_records("h200-measured")
                                 for k in [r["what"].split()[0]]], ids=lambda r: r["what"].split()[0])
def test_committed_kernels_are_lower_bounded(row):
    """Fused kernels (fwd + bwd, isolated) and optimizer steps: max(GPU, host) is below the measurement."""
    assert 0 < row["predicted_ms"] < row["measured_ms"], row


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


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_step_time_within_10pct_gpu(case, claims, cuda_device):
    """Predicted vs measured forward + backward on this GPU, ±10% (the DESIGN goal for time). The
    profile is $ANATOMY_GPU_PROFILE (a name or a path; default h200-measured): run `anatomy
    calibrate` first in the same session so the profile describes this machine. Where the profile has
    a tiny host step, the prediction takes the host's speed in this process (calibrate_host.HostStep,
    timed right before and after the steps; measured.at_host_speed): it moves +-15% between processes
    and more within one (session9e, session10), and this step waits on the host for its loss's syncs."""
    from anatomy.calculator.measured import at_host_speed
    from anatomy.measure.calibrate_host import HostStep

    preset, B, S, variant = GPU_CASES[case]
    cfg, run = ModelConfig.from_name(preset), Run(B, S, "amp")
    hs = HostStep()
    refs = [hs.reference(variant)]
    times = _measure_step_ms(cfg, run, variant)
    refs.append(hs.reference(variant))
    hs.close()
    measured = statistics.median(times)
    profile = os.environ.get("ANATOMY_GPU_PROFILE", "h200-measured")
    prof = gpus.get(profile)
    if (prof.get("host_step") or {}).get(variant):
        prof = at_host_speed(prof, variant, statistics.mean(refs))
    pred = timing.estimate_time(cfg, run, variant, prof, optimizer=None, with_kernels=False)
    claims.check("time.forward_backward", component="model", config=f"{preset}/B{B}S{S}/amp", variant=variant,
                 predicted=pred["forward_backward_s"] * 1e3, measured=measured, tolerance=0.10, device="cuda",
                 unit="ms", note=f"profile {profile}; steps {min(times):.1f}-{max(times):.1f} ms; tiny host step "
                                 f"{refs[0]:.2f}, {refs[1]:.2f} ms here")
    assert math.isfinite(measured)


def test_gqa_backward_reduces_heads_under_cudnn_only():
    """Under GQA, cuDNN's SDPA backward writes dK and dV per query head in fp32 and sums each group
    after (fmha_reduce_head in every GQA row's H200 trace, session 11): one memory kernel per layer,
    under cuDNN only, and none without GQA."""
    from anatomy.calculator.launches import efficient_kernels

    cfg = ModelConfig(name="gqa", hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2816, vocab=8192)
    run = Run(2, 1024, "amp")
    found = {b: [k for k in efficient_kernels(cfg, run, b) if k.name == "attention.sdpa.gqa_reduce"]
             for b in ("cudnn", "flash")}
    (k,) = found["cudnn"]
    assert not found["flash"]
    T = run.tokens
    assert (k.count, k.phase, k.bytes) == (cfg.layers, "backward", 2 * T * cfg.hidden * 4 + 2 * T * cfg.kv_dim * 2)
    mha = ModelConfig(name="mha", hidden=1024, layers=2, heads=16, kv_heads=16, intermediate=2816, vocab=8192)
    assert not [k for k in efficient_kernels(mha, run) if k.name == "attention.sdpa.gqa_reduce"]
