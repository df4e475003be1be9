"""Run.recompute="full": each efficient block runs under one checkpoint that keeps only its input; backward
re-runs the block's forward but its last matmul (llm_anatomy/efficient/transformer.py, BlockCheckpoint). The
claims: the same numbers as without recompute; the calculator's saved bytes and FLOPs exact per component;
its memory on CPU exact against live storage: after forward, the backward peak (each block's re-run makes
its saved tensors again), after backward, the largest moment inside the last block's forward (autocast's
cached weight casts included) and inside a block's re-run; and the timing's kernel list re-runs the
block's forward kernels in backward."""
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from llm_anatomy.calculator import estimate
from llm_anatomy.calculator.memory import phases
from llm_anatomy.calculator.timing import efficient_kernels
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.kernel_shapes import LCE_ALIGN, lce_vocab
from llm_anatomy.measure.liveness import LiveStorage, measure_phases_live
from llm_anatomy.measure.memory import setup_step
from llm_anatomy.models import autocast_ctx, build_model
from validations.configs import NAMED, POLICIES, configs, runs
from validations.test_efficient import EFFICIENT, check_flops, check_saved
from validations.test_recompute import WALK, check_identical

FULL = "full"


# loss and gradients, the match with the baseline, saved bytes and FLOPs: validations/test_recompute.py, per policy


def test_keeps_only_the_block_inputs(claims):
    """Per layer only the block input, (B, S, H) in the residual dtype (fp32 under amp); besides, what no
    block keeps: the ids (int64), the two fp32 (S, hd) RoPE tables, the final norm's fp32 input, and the
    fused loss's bf16 grad_input (T, H) and fp32 grad_weight (V, H)."""
    from llm_anatomy.measure.run import measure_saved

    cfg, run = NAMED["tiny-gqa"], Run(2, 16, "amp", FULL)
    T, H, L, V = run.tokens, cfg.hidden, cfg.layers, cfg.vocab
    Vg = lce_vocab(V, LCE_ALIGN)  # the CE's grad_weight: a view of its padded accumulator
    rest = 8 * T + 2 * 4 * run.seq * cfg.head_dim + 4 * T * H + 2 * T * H + 4 * Vg * H
    measured = measure_saved(cfg, run, "efficient").report.storage_bytes()
    claims.check("memory.saved: full recompute keeps the block inputs", component="model", config="tiny-gqa/B2S16/amp",
                 variant="efficient", predicted=L * T * H * 4 + rest, measured=measured, device="cpu", unit="B",
                 note="the docstring's arithmetic against saved storage measured")


@pytest.mark.parametrize("policy, optimizer", [("amp", "adamw"), ("bf16", None), ("fp32", "ademamix")])
@pytest.mark.parametrize("name, r", WALK, ids=[f"{n}-B{r.batch}S{r.seq}" for n, r in WALK])
def test_memory_walk_exact_on_cpu(name, r, policy, optimizer, claims):
    """The backward walk re-makes each block's saved tensors when its down matmul's backward asks for them
    (backward_efficient.rerun_block): live storage on CPU, to the byte."""
    cfg, run = NAMED[name], Run(r.batch, r.seq, policy, FULL)
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer=optimizer)}
    pred = phases(cfg, run, "efficient", optimizer=optimizer, device="cpu")
    kw = dict(component="model", config=f"{name}/B{r.batch}S{r.seq}/{policy}/recompute-full", variant="efficient",
              device="cpu", unit="B")
    claims.check("memory.live after forward", predicted=pred["forward_end"], measured=meas["forward"]["allocated"], **kw)
    claims.check("memory.peak in backward", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 note=f"predicted at {pred['backward_peak_at']}; measured after {meas['backward']['peak_op']}", **kw)
    claims.check("memory.live after backward", predicted=pred["backward_end"], measured=meas["backward"]["allocated"],
                 **kw)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(cfg=configs(), run=runs())
def test_memory_walk_hypothesis(cfg, run, claims):
    """test_memory_walk's claim and bound (±3%, as without recompute and under "mlp") on drawn configs."""
    run = Run(run.batch * 4, run.seq * 4, run.dtype, FULL)  # enough tokens for activations to matter
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer="adamw")}
    pred = phases(cfg, run, "efficient", optimizer="adamw", device="cpu")
    claims.check("memory.peak in backward", component="model", config=f"{cfg}/{run}", variant="efficient",
                 predicted=pred["backward_peak"], measured=meas["backward"]["peak"], tolerance=0.03, device="cpu",
                 unit="B")


def _peaks_inside(cfg, run):
    """Live-storage peaks inside the last block's forward and inside its attention's re-run in backward
    (module hooks mark the boundaries; a call with a graph task running is the checkpoint's re-run)."""
    model, ids, targets, _ = setup_step(cfg, run, "efficient", None, "cpu")
    live = LiveStorage()
    live.track(*model.parameters(), ids, targets)
    rows = {}

    def bounds(module, key, in_backward):
        def pre(m, args, kwargs):
            if (torch._C._current_graph_task_id() != -1) == in_backward:
                live.phase("before")

        def post(m, args, kwargs, out):
            if (torch._C._current_graph_task_id() != -1) == in_backward:
                rows[key] = live.phase(key)
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    bounds(model.layers[-1], "block", False)
    bounds(model.layers[-1].attn, "rerun", True)
    with live:
        with autocast_ctx(run, "cpu"):
            loss = model(ids, targets)
        loss.backward()
    return rows


CONFIGS = [*EFFICIENT, "mha-narrow-mlp"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", CONFIGS)
def test_peaks_inside_a_block_exact_on_cpu(name, policy, claims):
    """Inside the last block's forward nothing is saved: the largest moment is o's output in attention or
    the MLP's, with every weight cast autocast has cached so far (the earlier layers' too: amp checks the
    cache); inside a block's re-run in backward, o's output while qkv's output lives, beside the tensors
    re-made so far. mha-narrow-mlp (I = 1) puts the block's peak in attention, the others in the MLP."""
    cfg = (NAMED[name] if name in NAMED else
           ModelConfig(name=name, hidden=128, layers=2, heads=8, kv_heads=8, intermediate=1, vocab=5))
    run = Run(2, 64, policy, FULL)
    meas = _peaks_inside(cfg, run)
    pred = phases(cfg, run, "efficient", device="cpu")
    stage = {s["name"]: s["live"] for s in pred["backward_stages"]}
    kw = dict(component="model", config=f"{name}/B2S64/{policy}/recompute-full", variant="efficient", device="cpu",
              unit="B")
    claims.check("memory.live at the peak inside the last block's forward", predicted=pred["forward_peak_last_block"],
                 measured=meas["block"]["peak"], note=f"measured after {meas['block']['peak_op']}", **kw)
    claims.check("memory.live at the peak inside a block's re-run (attention)",
                 predicted=stage[f"layer {cfg.layers - 1} recompute attention.o"], measured=meas["rerun"]["peak"],
                 note=f"measured after {meas['rerun']['peak_op']}", **kw)


@pytest.mark.parametrize("policy", ["amp", "bf16"])
def test_backward_reruns_the_block_forward_kernels(policy):
    """Every forward kernel of a layer runs again in backward, once per layer, at the same FLOPs and bytes,
    but down's matmul and the block's last add (the early stop); and the extra matmul and SDPA FLOPs are
    the calculator's extra counter FLOPs (SDPA's kernel entry is causal, the counter's is not)."""
    cfg = ModelConfig.from_name("seed")
    run = Run(2, 512, policy, FULL)
    ks = efficient_kernels(cfg, run)
    fwd = {k.name: k for k in ks if k.phase == "forward" and k.order == 1}
    again = {k.name.removesuffix(".recompute"): k for k in ks if k.name.endswith(".recompute")}
    assert set(fwd) - set(again) == {"mlp.down", "mlp.residual_add"} and set(again) <= set(fwd)
    for name, k in again.items():
        f = fwd[name]
        assert k.phase == "backward" and (k.flops, k.bytes, k.kind, k.fused) == (f.flops, f.bytes, f.kind, f.fused)
        assert k.count == (2 * cfg.layers if name == "norm.rms_norm" else cfg.layers), name
    assert again["attention.sdpa"].op_phase == "forward"
    none = efficient_kernels(cfg, Run(2, 512, policy))
    mm = [sum(k.flops * k.count for k in lst if k.kind == "matmul") for lst in (ks, none)]
    sdpa = sum(k.flops * k.count for k in again.values() if k.kind == "sdpa")
    est = [estimate(cfg, Run(2, 512, policy, r), "efficient", "cuda").total("flops_counter_bwd") for r in (FULL, "none")]
    assert mm[0] - mm[1] + 2 * sdpa == est[0] - est[1]


def test_full_is_an_efficient_option():
    with pytest.raises(ConfigError, match="option of the efficient variant"):
        build_model(NAMED["tiny"], "baseline", device="meta", recompute=FULL)
    with pytest.raises(ConfigError, match="option of the efficient variant"):
        estimate(NAMED["tiny"], Run(2, 16, "amp", FULL), "baseline")
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--preset", "seed", "--variant", "baseline",
                          "--recompute", FULL], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--variant efficient" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--help"], capture_output=True, text=True)
    assert "full (keep" in " ".join(out.stdout.split()), out.stdout


def test_estimate_reports_it():
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--preset", "seed", "--variant",
                          "efficient", "--recompute", FULL, "--json"], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d["run"]["recompute"] == FULL
    mlp = phases(ModelConfig.from_name("seed"), Run(16, 4096, "amp", "mlp"), "efficient")
    assert d["memory"]["saved"]["total"] < mlp["saved"] / 2  # seed B16 S4096: 0.97 of mlp's 2.9 GiB


@pytest.mark.gpu
@pytest.mark.parametrize("name", EFFICIENT + ["seed-narrow"])
def test_on_cuda(name, claims):
    """On the GPU: the same numbers as without recompute (the Triton kernels, cuDNN, Liger), and the saved
    bytes and FLOPs exact."""
    check_identical(NAMED[name], Run(2, 256, "amp"), device="cuda", recompute=FULL)
    check_saved(claims, NAMED[name], Run(2, 256, "amp", FULL), f"{name}/B2S256/amp/recompute-full", device="cuda")
    check_flops(claims, NAMED[name], Run(2, 256, "amp", FULL), f"{name}/B2S256/amp/recompute-full", device="cuda")
