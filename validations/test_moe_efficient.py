"""The efficient MoE block (llm_anatomy/efficient/moe.py): the same function as the contract's readable block
(validations/moe_reference.py) to within that block's own error, on the grouped-GEMM path and on the fallback;
wired into the efficient Transformer under every recompute policy and the lean block; the load-balancing loss
equal to transformers' own."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.efficient import moe as moe_mod
from llm_anatomy.efficient.moe import MoE
from llm_anatomy.kernels.moe_unpermute import moe_unpermute
from llm_anatomy.models import autocast_ctx, build_model, init_weights, make_batch, param_dtype
from llm_anatomy.kernels import triton_on_cpu
from validations.configs import POLICIES
from validations.kernel_cases import needs_interpreter
from validations.moe_reference import ReferenceMoE, bias_term_scales, moe_configs, reference_state_dict

NAMED_MOE = {  # widths multiples of 8: bf16 and amp run torch._grouped_mm; fp32 the loop of mm
    "mixtral-like": ModelConfig(name="mixtral-like", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48,
                                vocab=64, experts=8, experts_per_token=2, expert_intermediate=24),
    "qwen-moe-like": ModelConfig(name="qwen-moe-like", hidden=32, layers=2, heads=4, intermediate=48, vocab=64,
                                 experts=6, experts_per_token=4, expert_intermediate=16, shared_experts=2,
                                 shared_intermediate=8, norm_topk=False, router_aux_coef=0.01),
    "gptoss-like": ModelConfig(name="gptoss-like", hidden=32, layers=2, heads=4, kv_heads=1, intermediate=32,
                               vocab=64, mlp="gpt-oss", experts=4, experts_per_token=2, expert_intermediate=16,
                               router="topk-softmax", router_bias=True, expert_bias=True, router_aux_coef=0.02),
    "odd-widths": ModelConfig(name="odd-widths", hidden=30, layers=2, heads=3, intermediate=20, vocab=50,
                              experts=5, experts_per_token=3, expert_intermediate=13, shared_experts=1,
                              shared_intermediate=7, expert_bias=True),
}


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def _run_block(block, x, dout, policy, retain_graph=False):
    """(output, gradients by name, the routing weights (T, K) fp32 with their gradient retained)."""
    x = x.detach().requires_grad_()
    weights = []

    def unpermute(y, pos, w):  # the efficient block's routing weights, as the unpermute receives them
        w.retain_grad()
        weights.append(w)
        return moe_unpermute(y, pos, w)
    with mock.patch.object(moe_mod, "moe_unpermute", unpermute), autocast_ctx(Run(1, 1, policy), x.device.type):
        y = block(x)
    y.backward(dout.to(y.dtype), retain_graph=retain_graph)
    grads = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    return y, grads, (weights or [block.last_w])[0]


ROUTER = ("router.weight", "router.bias")


def check_block_matches_reference(cfg: ModelConfig, policy: str, tokens: int = 24, seed: int = 0, device="cpu"):
    """error(efficient) <= 2 x error(reference, same dtype) + floor, both against the reference in float64: the
    output, every gradient the block computes and the routing weights' gradient d(w) (test_efficient.py's rule,
    at the block). The floor is 4 eps(fp32), and for the expert biases' gradients one unit of the compute
    dtype's rounding at their terms' magnitude (moe_reference.bias_term_scales): there the two errors are
    independent roundings of short sums, whose ratio no kernel controls. float64 follows the low-precision
    routing, so that a near-tie decided the other way does not compare two different functions.

    The router's own gradients are torch's router backward (linear, softmax, top-k, division) applied to d(w),
    a cancelling sum (with K = 1 and norm_topk it is exactly zero) whose error no ratio can judge: they must
    equal, bit for bit, that backward applied to the efficient block's own d(w)."""
    eff = MoE(cfg).to(device, param_dtype(Run(1, 1, policy)))
    init_weights(eff, seed)
    state = reference_state_dict(eff.state_dict())
    ref64, ref = (ReferenceMoE(cfg).to(device, dt) for dt in (torch.float64, param_dtype(Run(1, 1, policy))))
    ref64.load_state_dict(state)
    ref.load_state_dict(state)
    ref64.keep_terms = True
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if policy == "fp32" else torch.bfloat16  # the normed input arrives in the compute dtype
    x = torch.randn(1, tokens, cfg.hidden, generator=g).to(device, dt)
    dout = torch.randn(1, tokens, cfg.hidden, generator=g).to(device)
    yb, gb, wb = _run_block(ref, x, dout, policy, retain_graph=True)
    ref64.forced_idx = ref.last_idx
    y64, g64, w64 = _run_block(ref64, x.double(), dout.double(), "fp32")
    ye, ge, we = _run_block(eff, x, dout, policy)
    ge = reference_state_dict(ge)
    terms = bias_term_scales(ref64)
    floor = 4 * torch.finfo(torch.float32).eps
    for name in ["out", "d(w)", *(n for n in g64 if n not in ROUTER)]:
        r, b, e = {"out": (y64, yb, ye), "d(w)": (w64.grad, wb.grad, we.grad)}.get(name) or (g64[name], gb[name],
                                                                                             ge[name])
        err_b, err_e = _rel(b, r), _rel(e, r)
        fl = max(floor, torch.finfo(dt).eps * terms[name] / r.double().norm().clamp_min(1e-300).item()) \
            if name in terms else floor
        assert err_e <= 2 * err_b + fl, f"{name}: efficient error {err_e:.3e} > 2 x reference's {err_b:.3e} + {fl:.3e}"
    router = [n for n in ROUTER if n in gb]
    expected = torch.autograd.grad(wb, [ref.get_parameter(n) for n in router], we.grad)
    for n, want in zip(router, expected):
        torch.testing.assert_close(ge[n], want, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", NAMED_MOE)
def test_block_matches_reference_named(name, policy):
    check_block_matches_reference(NAMED_MOE[name], policy)


@settings(max_examples=25, deadline=None)
@given(cfg=moe_configs(), policy=st.sampled_from(POLICIES), tokens=st.integers(8, 96))
def test_block_matches_reference_hypothesis(cfg, policy, tokens):
    check_block_matches_reference(cfg, policy, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", NAMED_MOE)
def test_block_matches_reference_cuda(name, policy):
    """On the GPU: CUTLASS's grouped GEMM (sm90+) and the Triton unpermute and activation kernels."""
    check_block_matches_reference(NAMED_MOE[name], policy, tokens=512, device="cuda")


@needs_interpreter
@pytest.mark.parametrize("name", NAMED_MOE)
def test_block_matches_reference_through_triton(name):
    """The block with its Triton kernels (activation, unpermute, the permute's sum) under the interpreter: the
    path CUDA runs, on CPU. fp32 only: the interpreter rounds fp32 -> bf16 stores toward zero (numpy), not to
    nearest as the GPU does, which doubles every bf16 output's rounding error; bf16 and amp through the kernels
    are test_block_matches_reference_cuda's."""
    with triton_on_cpu():
        check_block_matches_reference(NAMED_MOE[name], "fp32", tokens=16)


def test_block_matches_reference_on_the_fallback(monkeypatch):
    """The loop-of-mm fallback, where torch._grouped_mm would run (bf16, aligned widths): the same contract."""
    monkeypatch.setattr(moe_mod, "_native", lambda *a: False)
    for policy in ("bf16", "amp"):
        check_block_matches_reference(NAMED_MOE["mixtral-like"], policy)


def _matmul_ops(cfg, policy):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    block = MoE(cfg).to(param_dtype(Run(1, 1, policy)))
    init_weights(block)
    x = torch.randn(1, 8, cfg.hidden, dtype=torch.float32 if policy == "fp32" else torch.bfloat16)
    with Ops(), autocast_ctx(Run(1, 1, policy), "cpu"):
        block(x).float().sum().backward()
    return seen & {"_grouped_mm", "mm", "addmm"}


@pytest.mark.parametrize("name,policy,expected", [
    ("mixtral-like", "bf16", {"_grouped_mm"}), ("mixtral-like", "amp", {"_grouped_mm"}),
    ("gptoss-like", "amp", {"_grouped_mm"}), ("mixtral-like", "fp32", {"mm"}), ("odd-widths", "bf16", {"addmm"}),
    ("gptoss-like", "bf16", {"_grouped_mm"})])
def test_grouped_path_is_chosen_by_capability(name, policy, expected):
    """bf16 operands with 16-byte strides run torch._grouped_mm (forward and backward), expert biases folded
    in where the weights are cast (amp), added after it on bf16 weights; fp32 or a width that is not a multiple
    of 8, the loop of mm (addmm with biases). (The shared experts' dense MLP is a plain mm too.)"""
    cfg = NAMED_MOE[name]
    ops = _matmul_ops(cfg, policy)
    assert expected <= ops
    if "_grouped_mm" not in expected:
        assert "_grouped_mm" not in ops


def _loss_and_grads(cfg, run):
    model = build_model(cfg, "efficient", dtype=param_dtype(run), recompute=run.recompute, lean=run.lean)
    ids, targets = make_batch(cfg, run)
    with autocast_ctx(run, "cpu"):
        loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["qwen-moe-like", "gptoss-like"])
def test_recompute_and_lean_change_no_bit(name, policy):
    """Run.recompute mlp/full and the lean block run the same kernels on the same values: loss and every
    gradient bitwise equal to the plain block's (the routing is deterministic: a stable sort)."""
    cfg = NAMED_MOE[name]
    loss0, grads0 = _loss_and_grads(cfg, Run(2, 8, policy))
    for recompute, lean in (("mlp", False), ("full", False), ("none", True)):
        loss, grads = _loss_and_grads(cfg, Run(2, 8, policy, recompute=recompute, lean=lean))
        assert torch.equal(loss, loss0), (recompute, lean)
        for n, g in grads0.items():
            assert torch.equal(grads[n], g), (recompute, lean, n)


@pytest.mark.parametrize("name", ["qwen-moe-like", "gptoss-like"])
def test_load_balancing_loss_is_transformers(name):
    """loss = ce + coef * transformers' load_balancing_loss_func over every layer's router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg, run = NAMED_MOE[name], Run(2, 8, "fp32")
    model = build_model(cfg, "efficient")
    logits = []
    for layer in model.layers:
        layer.mlp.router.register_forward_hook(lambda m, a, out: logits.append(out))
    ids, targets = make_batch(cfg, run)
    loss = model(ids, targets)
    with torch.no_grad():
        ce = model(ids, targets, reduction="none").mean()
    aux = load_balancing_loss_func(tuple(logits[:cfg.layers]), cfg.experts, cfg.experts_per_token)
    torch.testing.assert_close(loss, ce + cfg.router_aux_coef * aux, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert all(layer.mlp.aux is None for layer in model.layers)  # the stash is consumed


def test_state_dict_round_trips_through_the_baseline_names():
    """The contract's names: the shared experts' gate_up splits into gate and up (to_baseline_state_dict), and a
    state dict under those names loads back into the efficient model unchanged (its pre-hook fuses them)."""
    from llm_anatomy.efficient.transformer import to_baseline_state_dict

    cfg = NAMED_MOE["qwen-moe-like"]
    model = build_model(cfg, "efficient")
    base = to_baseline_state_dict(model)
    Is = cfg.shared_experts * cfg.shared_intermediate
    assert base["layers.0.mlp.shared.gate.weight"].shape == base["layers.0.mlp.shared.up.weight"].shape == (Is, 32)
    assert base["layers.0.mlp.experts.gate_up"].shape == (cfg.experts, 2 * cfg.expert_intermediate, cfg.hidden)
    assert not any("shared.gate_up" in k for k in base)
    other = build_model(cfg, "efficient", seed=1)
    other.load_state_dict(base)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
