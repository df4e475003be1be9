"""The calculator's saved bytes of the efficient MoE block (llm_anatomy/calculator/moe_efficient.py) equal what
autograd keeps in the efficient model's "moe" component, exactly, on drawn configs (experts 2-64, top-k 1-8,
shared experts 0-2, both activations and routers, every dtype policy, recompute policy and the lean block),
under the router's own routing and under a skewed one."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.calculator.moe_efficient import (added_bias, check_histogram, efficient_moe_saved,
                                                  efficient_moe_transients, fold, grouped_path)
from llm_anatomy.config import ConfigError, Run
from llm_anatomy.measure.saved import SavedTensorTracer
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations.configs import POLICIES
from validations.moe_reference import moe_configs
from validations.test_moe_efficient import NAMED_MOE


def _skew(model) -> list[int]:
    """Zero every router: all logits tie and top-k sends every token to the same K experts. Returns the
    rows per expert of one layer (every layer routes alike)."""
    cfg = model.cfg
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.router.weight.zero_()
            if layer.mlp.router.bias is not None:
                layer.mlp.router.bias.zero_()
    return [0] * cfg.experts  # filled by the caller from the measured routing


def measured_moe_bytes(cfg, run: Run, skewed: bool = False, device="cpu") -> tuple[int, list[int]]:
    """(storage bytes the "moe" component saves over one training forward, rows per expert of layer 0)."""
    model = build_model(cfg, "efficient", device=device, dtype=param_dtype(run), recompute=run.recompute,
                        lean=run.lean)
    if skewed:
        _skew(model)
    rows: list[int] = []

    def record(module, args, out):
        if not rows:
            with torch.no_grad():  # the block's own top-k on the same logits, saving nothing
                idx = out.float().topk(cfg.experts_per_token, -1).indices
            rows.extend(torch.bincount(idx.flatten(), minlength=cfg.experts).tolist())
    model.layers[0].mlp.router.register_forward_hook(record)
    ids, targets = make_batch(cfg, run, device)
    with SavedTensorTracer(model) as tracer, autocast_ctx(run, torch.device(device).type):
        loss = model(ids, targets)
    del loss
    return tracer.report.by_component().get("moe", 0), rows


def check(cfg, run: Run, skewed: bool = False, device="cpu"):
    measured, rows = measured_moe_bytes(cfg, run, skewed, device)
    predicted = sum(efficient_moe_saved(cfg, run, histogram=rows if run.recompute == "none" else None,
                                        device=device).values())
    assert predicted == measured, f"predicted {predicted:,} B, measured {measured:,} B ({cfg}, {run})"
    return rows


@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
@pytest.mark.parametrize("recompute", ["none", "mlp", "full"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", NAMED_MOE)
def test_saved_exact_named(name, policy, recompute, lean):
    check(NAMED_MOE[name], Run(2, 7, policy, recompute=recompute, lean=lean))


@settings(max_examples=40, deadline=None)
@given(cfg=moe_configs(max_experts=64, layers=2), policy=st.sampled_from(POLICIES),
       recompute=st.sampled_from(["none", "none", "mlp", "full"]), lean=st.booleans(), skewed=st.booleans(),
       batch=st.integers(1, 2), seq=st.integers(1, 12))
def test_saved_exact_hypothesis(cfg, policy, recompute, lean, skewed, batch, seq):
    check(cfg, Run(batch, seq, policy, recompute=recompute, lean=lean), skewed)


@pytest.mark.parametrize("policy", POLICIES)
def test_saved_exact_under_skewed_routing(policy):
    """Every token on the same K experts (the others get no rows): the same bytes as the balanced prediction."""
    cfg, run = NAMED_MOE["qwen-moe-like"], Run(2, 9, policy)
    rows = check(cfg, run, skewed=True)
    assert sorted(rows, reverse=True)[: cfg.experts_per_token] == [run.tokens] * cfg.experts_per_token
    assert sum(efficient_moe_saved(cfg, run, rows, "cpu").values()) == sum(efficient_moe_saved(cfg, run).values())


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", NAMED_MOE)
def test_saved_exact_cuda(name, policy, skewed):
    check(NAMED_MOE[name], Run(2, 256, policy), skewed, device="cuda")


def test_grouped_path_rule():
    """The calculator's path rule is the block's (validations/test_moe_efficient.py checks the block's ops)."""
    run = Run(1, 4, "bf16")
    assert grouped_path(NAMED_MOE["mixtral-like"], run) and not grouped_path(NAMED_MOE["odd-widths"], run)
    gptoss, amp = NAMED_MOE["gptoss-like"], Run(1, 4, "amp")
    assert grouped_path(gptoss, run) and added_bias(gptoss, run) and not fold(gptoss, run)  # bf16 weights: added
    assert grouped_path(gptoss, amp) and fold(gptoss, amp) == 8 and not added_bias(gptoss, amp)  # folded in casts
    assert not fold(NAMED_MOE["mixtral-like"], amp) and not added_bias(NAMED_MOE["mixtral-like"], run)
    assert not grouped_path(NAMED_MOE["mixtral-like"], Run(1, 4, "fp32"))


def test_histogram_is_checked_and_transients_named():
    cfg, run = NAMED_MOE["mixtral-like"], Run(1, 4, "amp")
    assert check_histogram(cfg, run, None) == [1] * 8  # 4 tokens x 2 slots over 8 experts
    for bad in ([8] + [0] * 6, [9] + [-1] + [0] * 6, [8.0] + [0] * 7):
        with pytest.raises(ConfigError, match="histogram"):
            efficient_moe_saved(cfg, run, bad)
    t = efficient_moe_transients(cfg, run)
    N, H, I = 8, cfg.hidden, cfg.expert_intermediate
    assert t["backward.unpermute.d_y"] == N * H * 2 and t["backward.experts.d_h"] == N * I * 2
    assert "forward.experts.loop_blocks" not in t  # the grouped path writes one (N, M) output
    assert efficient_moe_transients(cfg, Run(1, 4, "fp32"))["forward.experts.loop_blocks"] == N * (2 * I + H) * 4
