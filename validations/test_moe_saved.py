"""The baseline mixture-of-experts block (baseline/moe.py) and gpt-oss's attention, against the calculator: saved
bytes exact on CPU, per component and in total, on hypothesis-drawn configs (experts 2-64, top-k 1-8, shared experts
0-2, widths, both routers, the gpt-oss activation and biases, sinks and sliding windows, OLMoE's whole q/k norm, the
load-balancing loss), under the routing each layer actually took (read by a forward hook on each router, and given
to the calculator as per-layer histograms), and under a forced skewed routing (every token to experts 0..k-1);
counter FLOPs exact per component; parameters and their layout (names, shapes, order) the model's own.

Saved bytes are measured as validations/test_saved.py measures them (SavedTensorTracer: every storage autograd
keeps, once, attributed to the component that saved it first).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.baseline import moe as baseline_moe
from llm_anatomy.calculator import estimate, moe, param_count
from llm_anatomy.calculator.param_layout import param_shapes
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.saved import SavedTensorTracer
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations import test_flops
from validations.configs import POLICIES, runs


@st.composite
def moe_configs(draw) -> ModelConfig:
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.integers(2, 64))
    shared = draw(st.integers(0, 2))
    qk_norm = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    return ModelConfig(
        name="hypothesis-moe", hidden=heads * draw(st.sampled_from([2, 4, 8])), layers=draw(st.integers(1, 2)),
        heads=heads, kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        intermediate=draw(st.integers(1, 32)), vocab=draw(st.integers(2, 64)), tie_embeddings=draw(st.booleans()),
        mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])), qkv_bias=draw(st.booleans()), o_bias=draw(st.booleans()),
        qk_norm=qk_norm, qk_norm_whole=qk_norm and draw(st.booleans()), attn_sinks=draw(st.booleans()),
        window=window, window_pattern=draw(st.sampled_from(["all", "even"])) if window else "all",
        experts=experts, experts_per_token=draw(st.integers(1, min(8, experts))),
        expert_intermediate=draw(st.integers(1, 24)), shared_experts=shared,
        shared_intermediate=draw(st.integers(1, 16)) if shared else None,
        router=draw(st.sampled_from(["softmax-topk", "topk-softmax"])), norm_topk=draw(st.booleans()),
        router_bias=draw(st.booleans()), expert_bias=draw(st.booleans()),
        router_aux_coef=draw(st.sampled_from([0.0, 0.01, 0.5])))


def measure(cfg: ModelConfig, run: Run, skew: bool = False):
    """(saved-tensor report, the routing histogram each layer took). skew: a forward hook adds 8k, ..., 8 to the
    logits of experts 0..k-1, so every token goes to them (an add of a constant keeps nothing for backward)."""
    model = build_model(cfg, dtype=param_dtype(run))
    ids, targets = make_batch(cfg, run)
    hists = []

    def hook(mod, inputs, logits):
        if skew:
            boost = torch.zeros(cfg.experts, dtype=logits.dtype)
            # apart by 8 (the logits themselves are within ±1), and at most 64 up: no probability underflows to a tie
            boost[: cfg.experts_per_token] = 8 * torch.arange(cfg.experts_per_token, 0, -1, dtype=logits.dtype)
            logits = logits + boost
        with torch.no_grad():
            idx = baseline_moe.route(logits, cfg)[1]
        hists.append(tuple(torch.bincount(idx.flatten(), minlength=cfg.experts).tolist()))
        return logits

    for layer in model.layers:
        layer.mlp.router.register_forward_hook(hook)
    with SavedTensorTracer(model) as tracer, autocast_ctx(run, "cpu"):
        loss = model(ids, targets)
    del loss
    return tracer.report, hists


def check_saved(claims, cfg: ModelConfig, run: Run, cid: str, skew: bool = False) -> list:
    report, hists = measure(cfg, run, skew)
    est = estimate(cfg, run, device="cpu")
    est.components["moe"] = moe.baseline(cfg, run, "cpu", hists)
    claims.check("memory.saved.total", component="model", config=cid, variant="baseline",
                 predicted=est.total("saved_bytes"), measured=report.storage_bytes(), unit="B")
    measured = report.by_component()
    assert set(measured) <= set(est.components), f"saved outside any component: {measured}"
    for comp, c in est.components.items():
        claims.check("memory.saved", component=comp, config=cid, variant="baseline", predicted=c.saved_bytes,
                     measured=measured.get(comp, 0), unit="B")
    return hists


@settings(max_examples=30, deadline=None)
@given(cfg=moe_configs(), run=runs())
def test_saved_exact_hypothesis(cfg, run, claims):
    """30 drawn configs, each under the routing its layers took."""
    check_saved(claims, cfg, run, f"{cfg}/{run}")


@settings(max_examples=30, deadline=None)
@given(cfg=moe_configs(), run=runs())
def test_saved_exact_skewed_hypothesis(cfg, run, claims):
    """30 drawn configs under the skewed routing: every token to experts 0..k-1 (k experts hit, each with all T
    rows), which is calculator/moe.py's skewed() histogram in every layer."""
    hists = check_saved(claims, cfg, run, f"{cfg}/{run}/skewed", skew=True)
    assert hists == [moe.skewed(cfg, run)] * cfg.layers


SHAPES = {  # one of each family's block, narrow
    "qwen3-moe": ModelConfig(name="qwen3-moe", hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                             intermediate=48, vocab=64, qk_norm=True, experts=16, experts_per_token=4,
                             expert_intermediate=12, norm_topk=True),
    "mixtral": ModelConfig(name="mixtral", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=24, vocab=64,
                           experts=8, experts_per_token=2, router_aux_coef=0.02),
    "gpt-oss": ModelConfig(name="gpt-oss", hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=24,
                           vocab=64, mlp="gpt-oss", qkv_bias=True, o_bias=True, attn_sinks=True, window=5,
                           window_pattern="even", experts=8, experts_per_token=4, router="topk-softmax",
                           router_bias=True, expert_bias=True, norm_topk=False),
    "olmoe": ModelConfig(name="olmoe", hidden=32, layers=2, heads=4, intermediate=16, vocab=64, qk_norm=True,
                         qk_norm_whole=True, experts=16, experts_per_token=8, norm_topk=False, router_aux_coef=0.01),
    "shared": ModelConfig(name="shared", hidden=32, layers=2, heads=4, intermediate=16, vocab=64, experts=6,
                          experts_per_token=2, shared_experts=2, shared_intermediate=8),
}


@pytest.mark.parametrize("skew", [False, True], ids=["routed", "skewed"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", SHAPES)
def test_saved_exact_named(name, policy, skew, claims):
    check_saved(claims, SHAPES[name], Run(2, 16, policy), f"{name}/B2S16/{policy}", skew=skew)


@pytest.mark.parametrize("policy", POLICIES)
def test_worst_histogram_is_the_largest(policy):
    """The worst histogram's saved bytes bound every other's: balanced (every expert hit) against skewed (k hit)
    and against random ones; under autocast strictly more than skewed (each hit expert keeps its weight casts)."""
    cfg, run = SHAPES["mixtral"], Run(2, 16, policy)
    worst = sum(s.bytes for s in moe.saved(cfg, run, moe.worst_histogram(cfg, run)))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = torch.rand(run.tokens, cfg.experts, generator=g).topk(cfg.experts_per_token).indices
        hist = tuple(torch.bincount(idx.flatten(), minlength=cfg.experts).tolist())
        assert sum(s.bytes for s in moe.saved(cfg, run, hist)) <= worst
    skewed = sum(s.bytes for s in moe.saved(cfg, run, moe.skewed(cfg, run)))
    assert skewed < worst if policy == "amp" else skewed <= worst


@pytest.mark.parametrize("hist, message", [
    ((1, 2), "one row count per expert"), ((40, 0, 0, 0, 0, 0, 0, 0), "from 0 to the 32 tokens"),
    ((8, 8, 8, 8, 8, 8, 8, 7), "sums to tokens x experts_per_token = 64"), ((8,) * 7 + (-8,), "from 0 to"),
])
def test_bad_histogram_refused(hist, message):
    from llm_anatomy.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        moe.saved(SHAPES["mixtral"], Run(2, 16), hist)


@settings(max_examples=30, deadline=None)
@given(cfg=moe_configs(), run=runs())
def test_flops_and_params_exact_hypothesis(cfg, run, claims):
    """Counter FLOPs per component (FlopCounterMode on our baseline, on CPU: the routing loop needs real
    tensors), the parameter count, and param_layout's list: the model's named_parameters, in order."""
    test_flops._check(claims, cfg, run, f"{cfg}/{run}", device="cpu")
    model = build_model(cfg, device="meta")
    claims.check("params", component="model", config=str(cfg), variant="baseline", predicted=param_count(cfg),
                 measured=sum(p.numel() for p in model.parameters()))
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(cfg)


@pytest.mark.parametrize("name", ["mixtral", "gpt-oss", "olmoe"])
def test_load_balancing_loss_is_transformers(name):
    """The training loss is the cross-entropy plus coef x transformers' load_balancing_loss_func over the same
    router logits (our term comes from the (f, P) each layer stashes)."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = dataclasses.replace(SHAPES[name], router_aux_coef=0.25)
    model = build_model(cfg)
    logits = []
    for layer in model.layers:
        layer.mlp.router.register_forward_hook(lambda m, i, out: logits.append(out.detach().float()))
    ids, targets = make_batch(cfg, Run(2, 16, "fp32"))
    loss = model(ids, targets)
    ref = load_balancing_loss_func(tuple(logits), cfg.experts, cfg.experts_per_token)
    assert all(layer.mlp.stats is None for layer in model.layers)  # the step's statistics are not kept past it
    plain = build_model(dataclasses.replace(cfg, router_aux_coef=0.0))
    torch.testing.assert_close(loss, plain(ids, targets) + 0.25 * ref)
