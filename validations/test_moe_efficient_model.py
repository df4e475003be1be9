"""Claims: the two MoE models side by side. The efficient Transformer (efficient/moe.py) and the baseline's
(baseline/moe.py, the readable per-expert loop) load one state dict and agree on every per-token loss and every
parameter gradient by test_efficient.py's rule, error(efficient) <= 2 x error(baseline) against the baseline in
float64, at every dtype policy; and the whole efficient model's saved bytes, measured by the suite's own tracer,
equal the calculator's, component by component. All three models route as the baseline in the run's dtype does
(moe_reference.Routing): under bf16 a near-tie of the router's logits can go to another expert in another
rounding, which compares two functions, not two roundings (the reduced OLMoE did: one token of 32 in its second
layer picked another eighth expert in the efficient model)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.config import Run
from validations.moe_reference import moe_configs
from validations.test_efficient import check_matches_baseline, check_saved
from validations.test_moe_efficient import NAMED_MOE


@pytest.mark.parametrize("policy", ["fp32", "bf16", "amp"])
@pytest.mark.parametrize("name", NAMED_MOE)
def test_efficient_moe_model_matches_the_baseline_named(name, policy):
    worst = check_matches_baseline(NAMED_MOE[name], Run(2, 24, policy))
    assert any(".mlp.experts." in k for k in worst), "the experts' gradients were compared"


@pytest.mark.parametrize("policy", ["fp32", "bf16", "amp"])
@pytest.mark.parametrize("name", NAMED_MOE)
def test_efficient_moe_model_saved_bytes_exact(name, policy, claims):
    check_saved(claims, NAMED_MOE[name], Run(2, 16, policy), f"{name}/B2S16/{policy}")


@settings(max_examples=30, deadline=None)
@given(cfg=moe_configs(layers=2), policy=st.sampled_from(["fp32", "bf16", "amp"]), lean=st.booleans(),
       recompute=st.sampled_from(["none", "mlp", "full"]))
def test_efficient_moe_model_saved_bytes_exact_drawn(cfg, policy, lean, recompute, claims):
    run = replace(Run(2, 12, policy, recompute=recompute), lean=lean)
    check_saved(claims, cfg, run, f"{cfg}/{run}")


@pytest.mark.parametrize("name", ["qwen-moe-like", "gptoss-like"])  # softmax-topk and topk-softmax routers
def test_routing_imposes_the_recorded_experts(name):
    """Routing's own contract. Imposing a model's recorded routing on that model reproduces its loss and every
    gradient bit for bit (top-k's values are the gather at its own indices; autograd's top-k backward scatters to
    them). Imposing other experts (each layer's recorded choice shifted by one expert) makes every router's top-k
    return those experts, a checkpoint's re-run included: the model under recompute "full" then has the same loss
    and gradients, bit for bit, as the one without recompute."""
    import torch

    from llm_anatomy.efficient import moe
    from llm_anatomy.models import autocast_ctx, build_model, make_batch
    from validations.moe_reference import Routing

    cfg, run = NAMED_MOE[name], Run(2, 12, "bf16")
    plain, rerun = (build_model(cfg, "efficient", dtype=torch.bfloat16, recompute=r) for r in ("none", "full"))
    rerun.load_state_dict(plain.state_dict())
    ids, targets = make_batch(cfg, run, "cpu")
    routing = Routing(plain, rerun)

    def step(model):
        model.zero_grad(set_to_none=True)
        with routing:
            with autocast_ctx(run, "cpu"):
                loss = model(ids, targets)
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def same(a, b) -> bool:
        return torch.equal(a[0], b[0]) and all(torch.equal(a[1][n], b[1][n]) for n in a[1])

    own = step(plain)
    routing.imposing = True
    assert same(own, step(plain))
    routing.indices = {layer: (idx + 1) % cfg.experts for layer, idx in routing.indices.items()}
    shifted = step(plain)
    assert not torch.equal(shifted[0], own[0])
    assert same(shifted, step(rerun))
    logits = torch.randn(ids.numel(), cfg.experts)
    for layer, want in routing.indices.items():
        routing.layer = layer
        with routing:
            _, _, idx = moe.route(logits, cfg)
        assert torch.equal(idx, want), layer
