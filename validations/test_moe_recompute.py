"""Claims: the efficient MoE block under Run.recompute "mlp" and "full" (efficient/moe.py in efficient/mlp.py's
recomputed_tail, or in efficient/transformer.py's BlockCheckpoint: torch.utils.checkpoint, non-reentrant), on CPU
against the live storage (llm_anatomy.measure.liveness) under a forced routing (measure/routing.py: balanced, skewed):

  - the numbers: loss and every gradient bitwise the plain block's, on drawn configs (test_moe_efficient.py holds
    the named ones), and the load-balancing statistics stashed by the model's forward only, so a re-run in backward
    leaves nothing past the step;
  - the memory phases (calculator/memory.py): forward end, backward end and optimizer end exact, the peak inside
    backward exact where the walk puts it in an MoE stage (backward_moe_recompute.py: the checkpoint's re-run, then
    backward_moe.py's stages), on the named aligned configs, a router-bound one and 30 drawn configs per policy;
  - the largest moment inside the last layer's checkpoint in forward (calculator/moe_region.py) and inside a
    layer's re-run in backward, exact;
  - the timing kernel list (calculator/timing/kernels_moe.py): the re-run's forward kernels again in backward,
    at their forward FLOPs and bytes, but those the early stop leaves out, and its matmul FLOPs the calculator's
    extra counter FLOPs."""
from __future__ import annotations

from dataclasses import replace
from math import prod
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from llm_anatomy.calculator import estimate, memory, moe
from llm_anatomy.calculator.timing.kernels_efficient import efficient_kernels
from llm_anatomy.calculator.timing.kernels_moe import NOT_RERUN
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import Run
from llm_anatomy.efficient.moe import MoE
from llm_anatomy.measure.liveness import LiveStorage
from llm_anatomy.measure.memory import setup_step
from llm_anatomy.measure.routing import force
from llm_anatomy.models import autocast_ctx
from validations.moe_reference import moe_configs
from validations.test_moe_efficient import NAMED_MOE, _loss_and_grads
from validations.test_moe_memory import ALIGNED, ROUTER_BOUND, check

POLICIES = ("mlp", "full")
SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(max_examples=10, **SETTINGS)
@given(cfg=moe_configs(layers=2, aligned=True), policy=st.sampled_from(["amp", "bf16"]),
       recompute=st.sampled_from(POLICIES))
def test_same_loss_and_gradients_as_without_recompute_drawn(cfg, policy, recompute):
    loss0, grads0 = _loss_and_grads(cfg, Run(2, 8, policy))
    loss, grads = _loss_and_grads(cfg, Run(2, 8, policy, recompute=recompute))
    assert torch.equal(loss, loss0)
    for n, g in grads0.items():
        assert torch.equal(grads[n], g), n


@pytest.mark.parametrize("recompute", POLICIES)
def test_rerun_stashes_nothing(recompute):
    """The checkpoint's re-run in backward computes the router's softmax again (it saves) but stashes no (f, P):
    a stash would hold P's graph and the re-run's tensors until the next forward."""
    cfg, run = NAMED_MOE["qwen-moe-like"], Run(2, 8, "amp", recompute=recompute)
    model, ids, targets, _ = setup_step(cfg, run, "efficient", None, "cpu")
    with autocast_ctx(run, "cpu"):
        loss = model(ids, targets)
    assert all(layer.mlp.aux is None for layer in model.layers)
    loss.backward()
    assert all(layer.mlp.aux is None and not layer.mlp.collect for layer in model.layers)


# ---- the memory phases ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("optimizer", [None, "adamw"])
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("name", list(ALIGNED))
def test_moe_recompute_phases_named(name, recompute, policy, optimizer, skewed, claims):
    cfg = ALIGNED[name]
    check(claims, cfg, Run(2, 16, policy, recompute=recompute), optimizer,
          f"{name}/B2S16/{policy}/{optimizer}/recompute={recompute}", skewed)


@pytest.mark.parametrize("recompute", POLICIES)
def test_moe_recompute_phases_router_bound(recompute, claims):
    pred = check(claims, ROUTER_BOUND, Run(4, 64, "amp", recompute=recompute), "adamw",
                 f"router-bound/B4S64/amp/recompute={recompute}")
    assert ".router" in pred["backward_peak_at"], pred["backward_peak_at"]


def _cases(recompute: str):
    @st.composite
    def cases(draw):
        cfg = replace(draw(moe_configs(max_experts=64, aligned=True)), layers=draw(st.integers(1, 3)))
        policy = draw(st.sampled_from(["amp", "bf16"]))
        run = Run(draw(st.integers(1, 3)), draw(st.integers(2, 48)), policy, recompute=recompute)
        return cfg, run, draw(st.sampled_from([None, "adamw"])), draw(st.booleans())
    return cases()


@seed(20261207)
@settings(max_examples=30, **SETTINGS)
@given(case=_cases("mlp"))
def test_moe_recompute_mlp_phases_hypothesis(case, claims):
    cfg, run, optimizer, skewed = case
    check(claims, cfg, run, optimizer, f"hypothesis {cfg.to_dict()} {run}", skewed)


@seed(20261208)
@settings(max_examples=30, **SETTINGS)
@given(case=_cases("full"))
def test_moe_recompute_full_phases_hypothesis(case, claims):
    cfg, run, optimizer, skewed = case
    check(claims, cfg, run, optimizer, f"hypothesis {cfg.to_dict()} {run}", skewed)


# ---- inside the checkpoints ----------------------------------------------------------------------------------------
def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _peaks_inside(cfg, run):
    """Live-storage peaks inside the last layer's checkpoint in forward (the MoE half under "mlp", the block under
    "full"), and inside the last layer's re-run in backward, from its MoE half's norm to the early stop (the
    exception the checkpoint's stop raises through the block). Module hooks and a wrapped MoE._moe mark them."""
    model, ids, targets, _ = setup_step(cfg, run, "efficient", None, "cpu")
    force("balanced")(model)
    live = LiveStorage()
    live.track(*model.parameters(), ids, targets)
    rows, last = {}, model.layers[-1]
    region = last if run.recompute == "full" else last.mlp

    def mark(key: str, in_backward: bool):
        def hook(*_):
            if _in_backward() == in_backward:
                rows[key] = live.phase(key)
        return hook
    region.register_forward_pre_hook(mark("before", False))
    region.register_forward_hook(mark("forward", False))
    last.mlp_norm.register_forward_pre_hook(mark("before", True))
    moe_forward = MoE._moe

    def stopped(self, x):
        try:
            return moe_forward(self, x)
        except BaseException:
            if self is last.mlp and _in_backward():
                rows.setdefault("rerun", live.phase("rerun"))
            raise
    with mock.patch.object(MoE, "_moe", stopped), live:
        with autocast_ctx(run, "cpu"):
            loss = model(ids, targets)
        loss.backward()
    return rows


def _region_predicted(cfg, run, pred) -> int:
    """The calculator's live bytes at the forward's largest moment inside the last layer's checkpoint."""
    if run.recompute == "full":
        return pred["forward_peak_last_block"]
    est = estimate(cfg, run, "efficient", device="cpu")
    after = sum(prod(s.shape) * BYTES[s.dtype] * s.count for n in ("loss", "norm")
                for s in est.components[n].saved if s.name not in memory.INPUTS)
    return pred["forward_end"] - 4 - after + memory._mlp_region(cfg, run, memory._exact)


INSIDE = {**ALIGNED, "router-bound": ROUTER_BOUND,
          "router-bound-shared": replace(ROUTER_BOUND, name="router-bound-shared", shared_experts=1,
                                         shared_intermediate=8, router="topk-softmax", router_aux_coef=0.01)}


@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("name", list(INSIDE))
def test_peaks_inside_the_checkpoints_exact(name, recompute, policy, claims):
    cfg = INSIDE[name]
    run = Run(2, 16, policy, recompute=recompute)
    meas = _peaks_inside(cfg, run)
    pred = memory.phases(cfg, run, "efficient", device="cpu", hist=moe.balanced(cfg, run))
    stage = {s["name"]: s["live"] for s in pred["backward_stages"]}
    kw = dict(component="model", config=f"{name}/B2S16/{policy}/recompute={recompute}", variant="efficient",
              device="cpu", unit="B")
    claims.check("memory.live at the peak inside the last layer's checkpoint in forward (MoE)",
                 predicted=_region_predicted(cfg, run, pred), measured=meas["forward"]["peak"],
                 note=f"measured after {meas['forward']['peak_op']}", **kw)
    claims.check("memory.live at the peak inside a layer's re-run in backward (MoE)",
                 predicted=stage[f"layer {cfg.layers - 1} recompute moe"], measured=meas["rerun"]["peak"],
                 note=f"measured after {meas['rerun']['peak_op']}", **kw)


# ---- the timing kernel list ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("name", ["mixtral-like", "qwen-moe-like", "gptoss-like"])
def test_backward_reruns_the_moe_forward_kernels(name, recompute, policy):
    """Every forward kernel of the MoE block runs again in backward, once per layer, at the same FLOPs and bytes,
    but the load-balancing mean (the re-run stashes nothing) and, with shared experts, their down matmul and the
    sum after it (the early stop); no dense MLP kernel is listed."""
    cfg = NAMED_MOE[name]
    check_moe_rerun_kernels(cfg, Run(2, 64, policy, recompute))


def check_moe_rerun_kernels(cfg, run: Run) -> None:
    """test_backward_reruns_the_moe_forward_kernels's claim for one config and run (under recompute)."""
    ks = efficient_kernels(cfg, run)
    # the block's output add (ops.residual: "moe.residual_add", in the checkpoint under "mlp") is the region's
    # last op: the early stop leaves it out, as it does the dense MLP's
    fwd = {k.name: k for k in ks if k.phase == "forward" and k.component == "moe" and k.name.startswith("moe.")
           and k.name != "moe.residual_add"}
    again = {k.name.removesuffix(".recompute"): k for k in ks if k.name.endswith(".recompute")
             and k.name.startswith("moe.")}
    left = {"moe.balance.mean"} if cfg.router_aux_coef > 0 else set()
    left |= {"moe.shared.down", "moe.shared.sum"} if cfg.shared_experts else set()
    assert set(fwd) - set(again) == left and left <= set(NOT_RERUN) and set(again) <= set(fwd)
    for n, k in again.items():
        f = fwd[n]
        assert k.phase == "backward" and (k.flops, k.bytes, k.kind, k.count, k.fused) == \
            (f.flops, f.bytes, f.kind, f.count, f.fused), n
    assert not any(k.component == "mlp" or k.name.startswith("mlp.gate_up") for k in ks)


@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("name, run", [("mixtral-like", Run(4, 128)), ("qwen-moe-like", Run(2, 96))])
def test_rerun_matmul_flops_are_the_calculators(name, run, recompute):
    """The re-run's matmul FLOPs in the kernel list are the calculator's extra backward counter FLOPs (SDPA's
    kernel entry is causal, the counter's is not). The balanced rows fill whole tiles of the grouped GEMM (128
    a expert) and the configs fold no bias, so the kernel list's GEMMs carry no padding rows or columns."""
    cfg = NAMED_MOE[name]
    rc = replace(run, recompute=recompute)
    ks, none = efficient_kernels(cfg, rc), efficient_kernels(cfg, run)
    mm = [sum(k.flops * k.count for k in lst if k.kind == "matmul") for lst in (ks, none)]
    sdpa = sum(k.flops * k.count for k in ks if k.kind == "sdpa" and k.name.endswith(".recompute"))
    est = [estimate(cfg, r, "efficient", "cuda").total("flops_counter_bwd") for r in (rc, run)]
    assert mm[0] - mm[1] + 2 * sdpa == est[0] - est[1]
