"""Qwen3 dense: an explicit head_dim (heads x head_dim need not be hidden) and RMSNorm over each q and k head
(ModelConfig.qk_norm), end to end.

Against Hugging Face's Qwen3ForCausalLM (an outside implementation): parameters and FLOPs under both conventions,
exactly, and the same per-token losses from the same weights. Against our own two models: saved bytes exact for
every variant and recompute policy (named configs and hypothesis-drawn ones), counter FLOPs exact, the efficient
model's error within twice the baseline's, and the parameter lists the memory, sharding and timing models use.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.calculator import param_count
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.hf_config import from_hf_config
from llm_anatomy.models import build_model, make_batch
from validations import test_efficient, test_saved
from validations.configs import POLICIES, qk_norm_configs, runs
from validations.hf_configs import HF_CONFIGS, MODELS
from validations.test_qwen2 import (
    check_fake_pg,
    check_flops_against_hf,
    check_parameter_lists,
    check_same_losses,
)

transformers = pytest.importorskip("transformers")

QWEN3 = {  # CPU-sized: head_dim apart from hidden / heads (wider, narrower, hidden not divisible), GQA, tied
    "tiny-qwen3-wide": ModelConfig(name="tiny-qwen3-wide", hidden=48, layers=2, heads=4, kv_heads=2, head_dim=16,
                                   intermediate=96, vocab=97, norm_eps=1e-6, rope_theta=1e6, qk_norm=True),
    "tiny-qwen3-tied": ModelConfig(name="tiny-qwen3-tied", hidden=50, layers=1, heads=3, kv_heads=1, head_dim=8,
                                   intermediate=80, vocab=211, tie_embeddings=True, norm_eps=1e-6, qk_norm=True),
    "tiny-qwen3-mha": ModelConfig(name="tiny-qwen3-mha", hidden=64, layers=1, heads=4, intermediate=96, vocab=128,
                                  qk_norm=True),
}
REAL = [n for n, m in MODELS.items() if m.model_type == "qwen3"]


def hf_qwen3(cfg: ModelConfig, device="cpu"):
    """transformers' Qwen3ForCausalLM of the same shape (eager attention: QKᵀ and P@V as two matmuls)."""
    hf = transformers.Qwen3Config(
        hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate,
        vocab_size=cfg.vocab, tie_word_embeddings=cfg.tie_embeddings, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attn_implementation="eager")
    with torch.device(device):
        return transformers.Qwen3ForCausalLM(hf)


# ---- configs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REAL)
def test_real_config_reads_head_dim_and_qk_norm(name):
    d = json.loads(HF_CONFIGS[name].read_text())
    cfg = from_hf_config(HF_CONFIGS[name])
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == d["head_dim"] == 128
    assert cfg.q_dim == d["num_attention_heads"] * 128 and cfg.tie_embeddings == d["tie_word_embeddings"]
    assert cfg.norm_eps == d["rms_norm_eps"] and cfg.rope_theta == d["rope_theta"]
    assert cfg.to_dict()["qk_norm"] is True
    assert ("head_dim" in cfg.to_dict()) == (cfg.q_dim != cfg.hidden)  # 0.6B and 4B: 2048 / 4096 wide q


def test_head_dim_derived_when_absent():
    """Every config that never names head_dim is what it was: derived, left out of to_dict, equal to one that
    states the derived value."""
    c = ModelConfig(hidden=64, layers=1, heads=4, intermediate=8, vocab=8)
    assert c.head_dim == 16 and c.q_dim == 64 and "head_dim" not in c.to_dict() and "qk_norm" not in c.to_dict()
    assert c == dataclasses.replace(c, head_dim=16)
    with pytest.raises(ConfigError, match="not divisible by heads"):
        ModelConfig(hidden=50, layers=1, heads=3, intermediate=8, vocab=8)
    with pytest.raises(ConfigError, match="head_dim=7 must be even"):
        ModelConfig(hidden=50, layers=1, heads=3, head_dim=7, intermediate=8, vocab=8)


@pytest.mark.parametrize("field, value, message", [
    ("use_sliding_window", True, None),  # the window then applies (max_window_layers below the depth)
    ("attention_bias", True, "attention_bias=true is not modelled"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 is not modelled"),
    ("rope_scaling", {"rope_type": "made-up"}, "rope_scaling.rope_type must be one of"),
    ("head_dim", 0, "head_dim must be a positive integer"),
])
def test_unmodelled_fields_are_refused_in_one_line(tmp_path, field, value, message):
    from validations.test_fuzz import run_cli

    d = json.loads(HF_CONFIGS["Qwen3-0.6B"].read_text())
    d[field] = value
    if field == "use_sliding_window":
        d.update(sliding_window=4096, max_window_layers=20)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    rc, _, err = run_cli(["estimate", "--hf-config", str(p), "--batch", "1", "--seq", "8192"], "qwen3")
    assert rc == 2 and err.count("\n") == 1, err
    assert (message or "sliding_window=4096 is shorter than --seq 8192") in err


def test_estimate_reads_qwen3_8b():
    from validations.test_fuzz import run_cli

    rc, out, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS["Qwen3-8B"]), "--batch", "1", "--seq", "4096",
                            "--variant", "efficient", "--gpu", "H200", "--json"], "qwen3")
    assert rc == 0, err
    d = json.loads(out)
    assert d["params"] == MODELS["Qwen3-8B"].params == 8_190_735_360
    assert d["config"]["qk_norm"] is True and d["config"]["heads"] * 128 == 4096


# ---- parameters and FLOPs, against Hugging Face ------------------------------------------------------
@pytest.mark.parametrize("name", [*QWEN3, *REAL])
def test_params_equal_huggingface_qwen3(name, claims):
    cfg = QWEN3.get(name) or from_hf_config(HF_CONFIGS[name])
    model = hf_qwen3(cfg, device="meta")
    claims.check("params equal Hugging Face's", component="model", config=name, variant="hf-qwen3",
                 predicted=param_count(cfg), measured=sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("name", [*QWEN3, "Qwen3-0.6B"])
def test_parameter_lists_are_the_models(name):
    """memory.param_tensors, sharding.param_shapes and timing.param_sizes list the models' own tensors."""
    cfg = QWEN3.get(name) or dataclasses.replace(from_hf_config(HF_CONFIGS[name]), layers=2)
    check_parameter_lists(cfg)


@pytest.mark.parametrize("run", [Run(2, 16, "fp32"), Run(1, 33, "fp32")], ids=["B2S16", "B1S33"])
@pytest.mark.parametrize("name", QWEN3)
def test_flops_equal_huggingface_qwen3(name, run, claims):
    """Counter: FlopCounterMode's totals of HF's eager Qwen3, forward, then backward of logits.sum(). Model: HF's
    matmuls with the S×S ones (its only bmm) halved for the causal mask. The q/k norms have no matmul."""
    check_flops_against_hf(claims, QWEN3[name], hf_qwen3(QWEN3[name]), run, f"{name}/B{run.batch}S{run.seq}",
                           "hf-qwen3")


# ---- the same function as Hugging Face's ------------------------------------------------------------
@pytest.mark.parametrize("name", QWEN3)
def test_baseline_computes_huggingface_qwen3(name):
    """Our baseline's weights (norm weights drawn away from 1) loaded into Qwen3ForCausalLM under HF's names,
    both in float64: the same per-token losses (float32 rounding of the logits at most, as test_qwen2)."""
    cfg, run = QWEN3[name], Run(2, 24, "fp32")
    ours = build_model(cfg, dtype=torch.float64)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.5)
    ids, targets = make_batch(cfg, run)
    mine = check_same_losses(ours, hf_qwen3(cfg).to(torch.float64), ids, targets)
    with torch.no_grad():
        plain = build_model(dataclasses.replace(cfg, qk_norm=False), dtype=torch.float64)  # the norms matter
        plain.load_state_dict({n: t for n, t in ours.state_dict().items() if not re.search(r"attn\.[qk]_norm\.", n)})
        assert not torch.allclose(plain(ids, targets, reduction="none"), mine)


# ---- our two models: exact accounting, same function ----------------------------------------------------
def _check_all(claims, cfg, run, cid):
    """The baseline (run's dtype), and the efficient model under every recompute policy: saved bytes exact per
    component and in total; the efficient model's counter FLOPs exact."""
    test_saved._check(claims, cfg, run, cid)
    for recompute in ("none", "mlp", "full"):
        r = dataclasses.replace(run, recompute=recompute)
        test_efficient.check_saved(claims, cfg, r, f"{cid}/recompute-{recompute}")
    test_efficient.check_flops(claims, cfg, run, cid)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", QWEN3)
def test_saved_and_flops_exact(name, policy, claims):
    _check_all(claims, QWEN3[name], Run(2, 16, policy), f"{name}/B2S16/{policy}")


@settings(max_examples=30)
@given(cfg=qk_norm_configs(), run=runs())
def test_saved_and_flops_exact_hypothesis(cfg, run, claims):
    """30 drawn qk-norm configs (head_dim apart from hidden / heads), each through the baseline and the efficient
    model under none, mlp and full recompute: 30 per variant and policy."""
    _check_all(claims, cfg, run, f"{cfg}/{run}")


# For the error-ratio claim every tensor has at least 128 elements (validations/configs.py accuracy_configs):
# the q_norm and k_norm weights are head_dim wide, so head_dim is 128 here.
ACCURACY = {
    "qwen3-gqa-hd128": ModelConfig(name="qwen3-gqa-hd128", hidden=192, layers=2, heads=4, kv_heads=2, head_dim=128,
                                   intermediate=192, vocab=160, norm_eps=1e-6, rope_theta=1e6, qk_norm=True),
}


@pytest.mark.parametrize("policy, recompute", [(p, "none") for p in POLICIES] + [("amp", "mlp"), ("amp", "full")])
@pytest.mark.parametrize("name", ACCURACY)
def test_efficient_matches_baseline(name, policy, recompute):
    """Loss and every gradient (q_norm's and k_norm's included): error(efficient) <= 2 × error(baseline)."""
    worst = test_efficient.check_matches_baseline(ACCURACY[name], Run(2, 24, policy, recompute=recompute))
    assert any(n.endswith("attn.q_norm.weight") for n in worst) and any(n.endswith("attn.k_norm.weight") for n in worst)


def test_efficient_loads_the_baseline_state_dict():
    """The same names for q_norm and k_norm in both models; the fused qkv splits at heads x head_dim."""
    from llm_anatomy.efficient.transformer import to_baseline_state_dict

    cfg = QWEN3["tiny-qwen3-wide"]
    base, eff = build_model(cfg), build_model(cfg, "efficient")
    eff.load_state_dict(base.state_dict())
    back = to_baseline_state_dict(eff)
    assert back.keys() == base.state_dict().keys()
    assert all(torch.equal(back[n], t) for n, t in base.state_dict().items())


@settings(max_examples=10, deadline=None)
@given(cfg=qk_norm_configs(), lean=st.booleans())
def test_lean_block_saved_exact(cfg, lean, claims):
    """The lean block (Run.lean) with qk-norm: what the efficient model keeps, exact."""
    run = Run(2, 8, "amp", lean=lean)
    test_efficient.check_saved(claims, cfg, run, f"{cfg}/lean={lean}")


# ---- memory phases: the norms' saved tensors and their backward in the live storage ---------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant, recompute", [("baseline", "none"), ("efficient", "none"), ("efficient", "mlp"),
                                                ("efficient", "full")])
@pytest.mark.parametrize("name", ["tiny-qwen3-wide", "tiny-qwen3-tied"])
def test_phases_against_live_storage(name, variant, recompute, policy, claims):
    """memory.phases on CPU against live storage (test_memory_walk's claims): the phase ends exact, the peak in
    backward within ±3%, with q_norm's and k_norm's saved tensors, gradients and weight gradients walked."""
    from validations.test_memory_walk import _check

    _check(claims, QWEN3[name], Run(2, 16, policy, recompute=recompute), variant, "adamw",
           f"{name}/B2S16/{policy}/{recompute}/adamw")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant, recompute", [("baseline", "none"), ("efficient", "none"), ("efficient", "full")])
def test_phases_attention_bound(variant, recompute, policy, claims):
    """A shape whose backward peak is in attention (S = 64 over a vocab of 16), where the qk-norm stages run."""
    from validations.test_memory_walk import _check

    cfg = ModelConfig(name="qwen3-attn-bound", hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                      intermediate=32, vocab=16, qk_norm=True)
    _check(claims, cfg, Run(1, 64, policy, recompute=recompute), variant, "adamw", f"attn-bound/{policy}/{recompute}")


@pytest.mark.parametrize("policy", POLICIES)
def test_phases_lean_block(policy, claims):
    """The lean block (Run.lean) with qk-norm: the phase ends exact, the backward peak within ±3%."""
    from validations.test_memory_walk import _check

    _check(claims, QWEN3["tiny-qwen3-wide"], Run(1, 64, policy, lean=True), "efficient", "adamw",
           f"tiny-qwen3-wide/B1S64/{policy}/lean/adamw")


# ---- the timing model's kernel lists -------------------------------------------------------------------
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_kernel_lists_name_the_qk_norms_baseline(recompute):
    """The baseline's q_norm and k_norm have kernels (forward and backward; re-run under full recompute) only with
    qk_norm, and the attention kernels' bytes grow with heads x head_dim, not with hidden."""
    from llm_anatomy.calculator.timing import kernels

    cfg, run = from_hf_config(HF_CONFIGS["Qwen3-0.6B"]), Run(1, 1024, "amp", recompute=recompute)
    names = {k.name for k in kernels(cfg, run, "baseline")}
    for n in ("q_norm", "k_norm"):
        assert any(f"attention.{n}" in k and "backward" in k for k in names)
        assert any(f"attention.{n}" in k and "backward" not in k for k in names)
    plain = {k.name for k in kernels(dataclasses.replace(cfg, qk_norm=False), run, "baseline")}
    assert not [k for k in plain if "_norm" in k and k.startswith("attention.")]
    o = {k.name: k for k in kernels(cfg, run, "baseline")}["attention.o"]
    assert o.flops == 2 * run.tokens * cfg.q_dim * cfg.hidden != 2 * run.tokens * cfg.hidden ** 2


@pytest.mark.parametrize("recompute", ["none", "mlp", "full"])
def test_kernel_lists_fuse_the_qk_norms_into_rope(recompute):
    """The efficient model runs q_norm and k_norm inside the RoPE kernel (anatomy::rope_qkv_norm): with qk_norm its
    list has rope_qkv_norm's forward, backward and two weight-gradient sums a layer in rope_qkv's place (and its
    forward again under full recompute), no separate norm, cat or split kernel; without qk_norm, rope_qkv's
    entries as before. The backward reads d(q, k, v) and qkv's q and k columns and writes d(qkv)."""
    from llm_anatomy.calculator.timing import kernels

    cfg, run = from_hf_config(HF_CONFIGS["Qwen3-0.6B"]), Run(1, 1024, "amp", recompute=recompute)
    ks = {k.name: k for k in kernels(cfg, run, "efficient")}
    attn = {n for n in ks if n.startswith("attention.") and ("norm" in n or "rope_qkv" in n)}
    fused = {"attention.rope_qkv_norm", "attention.rope_qkv_norm.backward", "attention.rope_qkv_norm.dw_sum"}
    assert attn == fused | ({"attention.rope_qkv_norm.recompute"} if recompute == "full" else set())
    T, L, c, D, qk = run.tokens, cfg.layers, 2, cfg.q_dim + 2 * cfg.kv_dim, cfg.q_dim + cfg.kv_dim
    assert (ks["attention.rope_qkv_norm"].bytes, ks["attention.rope_qkv_norm"].count) == (2 * T * D * c, L)
    assert ks["attention.rope_qkv_norm.backward"].bytes == T * (2 * D + qk) * c
    assert ks["attention.rope_qkv_norm.dw_sum"].count == 2 * L
    plain = {k.name: k for k in kernels(dataclasses.replace(cfg, qk_norm=False), run, "efficient")}
    assert not [n for n in plain if "_norm" in n and n.startswith("attention.")]
    assert plain["attention.rope_qkv"].bytes == ks["attention.rope_qkv_norm"].bytes


# ---- data parallel: the q_norm / k_norm weights and the heads x head_dim projections, sharded and reduced ------
@pytest.mark.parametrize("name, strategy, world", [("tiny-qwen3-wide", "fsdp", 3), ("tiny-qwen3-tied", "ddp", 2)],
                         ids=["wide-fsdp-W3", "tied-ddp-W2"])
def test_fake_pg_collectives_and_per_rank_bytes(name, strategy, world, claims):
    """FSDP2 / DDP's real code on a fake process group (llm_anatomy.distributed.simulate), rank 0: collectives
    and per-rank parameter, gradient and optimizer bytes as the calculator's parameter layout predicts them."""
    check_fake_pg(claims, QWEN3[name], name, strategy, world, steps=1)


# ---- the Triton path: q_norm and k_norm inside the RoPE kernel (rope_qkv_norm) -----------------------------
def test_qk_norm_triton_matches_reference():
    """The efficient attention's q_norm and k_norm, fused into the RoPE kernel, through the Triton kernels
    (interpreter, on CPU) against the plain-torch reference: the same output and gradients (the norms' weights'
    included), within torch's fp32 tolerances (another summation order)."""
    from llm_anatomy.baseline.transformer import rope_tables
    from llm_anatomy.efficient.attention import Attention
    from llm_anatomy.kernels import INTERPRET, triton_on_cpu

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it where there is no GPU)")
    torch.manual_seed(0)
    attn = Attention(24, heads=3, kv_heads=1, head_dim=16, qk_norm=True, eps=1e-6)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.weight.normal_(1.0, 0.3)
    cos, sin = rope_tables(8, 16, 1e6, "cpu", torch.float32)
    x = torch.randn(2, 8, 24)
    outs = []
    for ctx in (triton_on_cpu, contextlib.nullcontext):
        xi = x.clone().requires_grad_()
        attn.zero_grad()
        with ctx():
            y = attn(xi, cos, sin)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, attn.q_norm.weight.grad.clone(), attn.k_norm.weight.grad.clone(),
                     attn.qkv.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", QWEN3)
def test_saved_exact_cuda(name, policy, claims):
    """On CUDA: the baseline's matmuls, the efficient model's Triton rope_qkv_norm (the fused q/k norms), cuDNN SDPA."""
    cfg, run, cid = QWEN3[name], Run(2, 256, policy), f"{name}/B2S256/{policy}"
    test_saved._check(claims, cfg, run, cid, device="cuda")
    test_efficient.check_saved(claims, cfg, run, cid, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", ACCURACY)
def test_efficient_matches_baseline_cuda(name, policy):
    test_efficient.check_matches_baseline(ACCURACY[name], Run(2, 128, policy), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_phases_cuda(variant, claims):
    """On CUDA, Qwen3-0.6B's shape at two layers (16 heads of 128 over a hidden of 1024): every memory phase against
    max_memory_allocated and the allocator trace, as test_live_claims checks its drawn configs; the efficient
    model's attention backward is the fused rope_qkv_norm's (d(qkv), both weight gradients, their fp32 partials)."""
    from llm_anatomy.measure.memory import measure_phases
    from validations.test_live_claims import test_live_phase_memory

    # the process's cuBLAS workspaces are made by its first matmuls and stay: a throwaway step makes them first
    warm = ModelConfig(name="warm-up", hidden=256, layers=1, heads=4, intermediate=512, vocab=1000)
    measure_phases(warm, Run(1, 256), variant, "adamw")
    cfg = dataclasses.replace(from_hf_config(HF_CONFIGS["Qwen3-0.6B"]), layers=2)
    test_live_phase_memory((cfg, Run(2, 1024, "amp")), variant, claims)
