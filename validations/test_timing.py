"""The timing model (llm_anatomy/calculator/timing/) against itself and the committed H200 records.

CPU tests check the model's internal claims (monotonicity, bound classification, FLOP bookkeeping, MFU,
host syncs) and compare its predictions with the committed H200 step and kernel records (llm_anatomy.records;
known misses: validations/known_misses.json); the gpu-marked test times full steps in-process and holds
the model to ±10%. The profiles themselves: test_gpu_profile.py.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from llm_anatomy import records
from llm_anatomy.calculator import estimate, timing
from llm_anatomy.calculator.timing import roofline
from llm_anatomy.calculator.optimizer import step_bytes_moved
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.report import steps
from validations import known_misses

SEED, ONE_B = ModelConfig.from_name("seed"), ModelConfig.from_name("anchor-1b")
SEED_RUN = Run(16, 4096, "amp")
GQA = ModelConfig(name="gqa", hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2816, vocab=32000)


def _kernel(res: dict, name: str) -> dict:
    return next(k for k in res["kernels"] if k["name"] == name)


# ---- predictions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", timing.VARIANTS)
@pytest.mark.parametrize("gpu", ["h200-measured", "h200-sxm", "a100-80gb-sxm-datasheet", "rtx-4090-datasheet"])
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
    p = timing.get("h200-measured")
    big = timing.time_kernel(timing.Kernel("mm", "x", "forward", "matmul", 1, 2 * 8192 ** 3, 3 * 8192 ** 2 * 2,
                                           (1, 8192, 8192, 8192)), p)
    rate = p["matmul_flops"]["bfloat16"] * roofline.matmul_efficiency(8192, 8192, 8192, p["sms"], p["matmul_k_half"])
    assert big["bound"] == "compute" and big["time_s"] == pytest.approx(
        2 * 8192 ** 3 / rate + max(p["launch_s"], p["kernel_gap_s"]))
    for name in ("attention.qkv", "mlp.gate_up", "mlp.down.grad_weight", "attention.sdpa", "attention.sdpa.backward",
                 "loss.logits"):
        assert _kernel(eff, name)["bound"] == "compute", name
    for name in ("norm.rms_norm", "mlp.swiglu", "attention.rope_qkv", "attention.residual_add",
                 "loss.cross_entropy"):
        assert _kernel(eff, name)["bound"] == "memory", name
    lean = timing.estimate_time(SEED, replace(SEED_RUN, lean=True), "efficient", "h200-measured")  # Run.lean
    assert _kernel(lean, "norm.add_rms_norm")["bound"] == "memory"
    assert not any(k["name"] == "attention.residual_add" for k in lean["kernels"])  # the adds run inside the norms
    for name in ("norm.rms_norm.dw_sum", "loss.sum", "loss.scale"):
        assert _kernel(eff, name)["bound"] == "launch", name
    # the baseline's S x S work is memory-bound; QKᵀ at head dim 64 (32 FLOPs per byte, its main loop at
    # k / (k + k_half) of the GEMM rate) sits near the measured ridge, on one side or the other as the fitted
    # k_half moves between calibrations
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
    measured_peak = max(r["tflops"] for r in json.loads(records.H200_PROFILE.read_text())["measurements"]
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
    from llm_anatomy.calculator import param_count

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
    """Liger's .item() before the loss and torch.equal at the start of its backward split the step; our
    loss syncs nowhere, so forward + backward is one segment."""
    r = timing.estimate_time(SEED, Run(16, 4096, "amp", loss_impl="liger"), "efficient", "h200-measured",
                             with_kernels=False)
    assert [s["starts_at"] for s in r["segments"]][:3] == ["embedding.gather", "loss.count_targets",
                                                           "loss.backward_check"]
    assert r["segments"][3]["phase"] == "optimizer" and len(r["segments"]) == 4
    assert r["forward_backward_s"] == pytest.approx(sum(s["time_s"] for s in r["segments"][:3]))
    ours = timing.estimate_time(SEED, SEED_RUN, "efficient", "h200-measured", with_kernels=False)
    assert [s["starts_at"] for s in ours["segments"]][:1] == ["embedding.gather"] and len(ours["segments"]) == 2
    assert ours["segments"][1]["phase"] == "optimizer"
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
RECORDS = {row["record"]: row for row in steps.compare_committed("h200-measured")}
RECORD_TEST = "validations/test_timing.py::test_committed_steps_within_10pct"


def test_committed_records_are_present():
    assert set(RECORDS) == {rel for rel, _ in steps.step_records()}
    assert not known_misses.unused(RECORD_TEST, RECORDS)


@pytest.mark.parametrize("rel", [known_misses.param(RECORD_TEST, rel, rel) for rel, _ in steps.step_records()])
def test_committed_steps_within_10pct(rel, claims):
    """The ±10% goal against each committed step record (bench/step.py runs on other machines than the
    profile's calibration); every comparison lands in the claims report."""
    r = RECORDS[rel]
    claims.check("step time (fwd+bwd) vs committed H200 record", component="model", config=rel, variant="efficient"
                 if "efficient" in rel else "baseline", predicted=r["predicted_ms"], measured=r["measured_ms"],
                 tolerance=0.10, device="cuda (recorded)", unit="ms")


def test_the_two_seed_records_cannot_both_be_within_10pct():
    """The first run and the second machine timed the same code, torch and GPU model 18 minutes apart:
    no single prediction is within ±10% of both, so a ±10% claim on the seed step can only hold against
    one machine."""
    a = RECORDS[records.rel(records.STEPS["baseline-peers"] / "step-seed-efficient.json")]["measured_ms"]
    b = RECORDS[records.rel(records.STEPS["seed-repeat"] / "step-seed-efficient.json")]["measured_ms"]
    assert max(a, b) * 0.9 > min(a, b) * 1.1


@pytest.mark.parametrize("row", steps.compare_kernel_records("h200-measured"), ids=lambda r: r["what"].split()[0])
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

    from llm_anatomy.models import build_model

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
def test_step_time_within_10pct_gpu(case, claims, cuda_device, suite_profile):
    """Predicted vs measured forward + backward on this GPU, ±10% (the DESIGN goal for time). The
    profile is the suite's (conftest.py suite_profile: $ANATOMY_GPU_PROFILE, else this GPU's own
    calibration, measured once per machine and cached). Where the profile has
    a tiny host step, the prediction takes the host's speed in this process (calibrate_host.HostStep,
    timed right before and after the steps; timing.at_host_speed): the host's speed moves between
    processes and within one, and this step waits on the host for its loss's syncs."""
    from llm_anatomy.measure.calibrate_host import HostStep

    preset, B, S, variant = GPU_CASES[case]
    cfg, run = ModelConfig.from_name(preset), Run(B, S, "amp")
    hs = HostStep()
    refs = [hs.reference(variant)]
    times = _measure_step_ms(cfg, run, variant)
    refs.append(hs.reference(variant))
    hs.close()
    measured = statistics.median(times)
    profile, label = suite_profile
    prof = timing.get(profile)
    if (prof.get("host_step") or {}).get(variant):
        prof = timing.at_host_speed(prof, variant, statistics.mean(refs))
    pred = timing.estimate_time(cfg, run, variant, prof, optimizer=None, with_kernels=False)
    claims.check("time.forward_backward", component="model", config=f"{preset}/B{B}S{S}/amp", variant=variant,
                 predicted=pred["forward_backward_s"] * 1e3, measured=measured, tolerance=0.10, device="cuda",
                 unit="ms", note=f"profile {label}; steps {min(times):.1f}-{max(times):.1f} ms; tiny host step "
                                 f"{refs[0]:.2f}, {refs[1]:.2f} ms here")
    assert math.isfinite(measured)


def test_gqa_backward_reduces_heads_under_cudnn_only():
    """Under GQA, cuDNN's SDPA backward writes dK and dV per query head in fp32 and sums each group
    after (fmha_reduce_head in every GQA row's H200 trace): one memory kernel per layer, under cuDNN
    only, and none without GQA."""
    from llm_anatomy.calculator.timing.kernels_efficient import efficient_kernels

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
