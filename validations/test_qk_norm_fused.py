"""Qwen3's q/k RMSNorm fused into the RoPE kernel (llm_anatomy/kernels/rope_norm.py, anatomy::rope_qkv_norm).

Numerics: the op's outputs and every gradient (qkv, q_norm's and k_norm's weights) against the unfused
computation, norm then RoPE, both as plain torch against fp64 (kernel_cases.check_accuracy: within twice plain
torch's own error) and as our own unfused ops (rms_norm on the head views, then rope_qkv), through the CPU
reference and the Triton kernels (interpreter), on named and hypothesis-drawn shapes. Saved tensors: exactly
qkv, the weights and the tables, their bytes as the calculator says, on drawn shapes. The efficient attention
runs the fused op only with qk_norm, and without it the same rope_qkv path as before. The fast path, opcheck,
meta/fake tensors and torch.compile(fullgraph=True) agree with the op. gpu-marked: the CUDA kernel.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from llm_anatomy.calculator.attention import qk_norm_saved_efficient
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.kernels import INTERPRET, rms_norm, rope_qkv, rope_qkv_norm
from validations.kernel_cases import (BF16, FP32, PATHS, check_accuracy, gen, path_ctx, plain_rms_norm, plain_rope_qkv,
                                      rope_tables)

EPS = 1e-6


def unfused(qkv, q_weight, k_weight, cos, sin, H, KV, eps=EPS, norm=plain_rms_norm, rope=plain_rope_qkv):
    """The unfused computation: RMSNorm over each q and k head, a cat, then RoPE. By default in plain torch
    (Hugging Face's RoPE); with norm=rms_norm, rope=rope_qkv, what the efficient attention ran before the fusion:
    our rms_norm on the head views and rope_qkv."""
    B, S, W = qkv.shape
    D = W // (H + 2 * KV)
    q, k, v = qkv.view(B, S, H + 2 * KV, D).split([H, KV, KV], dim=2)
    normed = torch.cat([norm(q, q_weight, eps), norm(k, k_weight, eps), v], dim=2)
    return rope(normed.view(B, S, W), cos, sin, H, KV)


def unfused_ops(qkv, q_weight, k_weight, cos, sin, H, KV, eps=EPS):
    return unfused(qkv, q_weight, k_weight, cos, sin, H, KV, eps, rms_norm, rope_qkv)


def case(dtype, device="cpu", B=2, S=7, H=6, KV=2, D=8, seed=0):
    g = gen(seed)
    cos, sin = (t.to(device) for t in rope_tables(S, D))
    qkv = (torch.randn(B, S, (H + 2 * KV) * D, generator=g) * 2).to(device, dtype)
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=g)).to(device, dtype) for _ in range(2))
    inputs = dict(qkv=qkv, q_weight=qw, k_weight=kw)
    return (inputs, lambda t: rope_qkv_norm(t["qkv"], t["q_weight"], t["k_weight"], cos, sin, H, KV, EPS),
            lambda t: unfused(t["qkv"], t["q_weight"], t["k_weight"], cos, sin, H, KV), _dqkv_scale(H, KV))


def _dqkv_scale(H, KV):
    """d(qkv)'s q and k columns are each head's rstd * (g - x_hat * mean(g * x_hat)), g = w * (the rotated dy): a
    projection that cancels for narrow heads, so rounding is set by its terms, of size rstd * |w| * |dy|."""
    def scale(ref_in, dref):
        x = ref_in["qkv"].detach()
        D = dref[0].shape[-1]
        xq, xk, _ = x.view(*x.shape[:2], H + 2 * KV, D).split([H, KV, KV], dim=2)
        terms = [torch.rsqrt(t.pow(2).mean(-1) + EPS).max() * ref_in[w].detach().abs().max() * d.abs().max()
                 for t, w, d in ((xq, "q_weight", dref[0]), (xk, "k_weight", dref[1]))]
        return {"dqkv": max(*(t.item() for t in terms), dref[2].abs().max().item())}
    return scale


SHAPES = {"gqa": dict(H=6, KV=2, D=8), "mha-odd": dict(H=3, KV=3, D=6), "mqa-d2": dict(H=4, KV=1, D=2),
          "tail": dict(B=1, S=13, H=4, KV=2, D=16),  # 13 tokens: the backward's last program redoes one
          "many-heads": dict(B=1, S=2, H=80, KV=16, D=128)}  # several head blocks in forward and backward


# ---- numerics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_accuracy_against_plain_torch(path, dtype, shape):
    """Forward and d(qkv), d(q_weight), d(k_weight): error against fp64 within twice plain torch's own."""
    q, k, v = check_accuracy(*case(dtype, **SHAPES[shape]), path=path_ctx(path))["op"][0]
    assert q.transpose(1, 2).is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert all(t.dtype == dtype for t in (q, k, v))


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 5), kv=st.integers(1, 3), group=st.integers(1, 3), half=st.integers(1, 9))
def test_accuracy_hypothesis(B, S, kv, group, half):
    """Head counts and widths around the kernels' power-of-two tiles, token counts around the backward's
    programs; both paths (Triton under the interpreter)."""
    for path in ["reference"] + (["triton"] if INTERPRET else []):
        check_accuracy(*case(FP32, B=B, S=S, H=kv * group, KV=kv, D=2 * half), path=path_ctx(path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_the_unfused_ops(path, shape):
    """The fused op against our unfused ops (rms_norm per head view, cat, rope_qkv) on the same path, fp32:
    outputs and all three gradients within torch's fp32 tolerances (another summation order)."""
    inputs, _, _, _ = case(FP32, **SHAPES[shape])
    B, S, D = inputs["qkv"].shape[0], inputs["qkv"].shape[1], inputs["q_weight"].shape[0]
    H, KV = SHAPES[shape]["H"], SHAPES[shape]["KV"]
    cos, sin = rope_tables(S, D)
    dy = [torch.randn(s, generator=gen(5)) for s in ((B, H, S, D), (B, KV, S, D), (B, KV, S, D))]
    results = []
    for fn in (rope_qkv_norm, unfused_ops):
        leaves = [t.clone().requires_grad_() for t in inputs.values()]
        with path_ctx(path):
            out = fn(*leaves, cos, sin, H, KV, EPS)
            grads = torch.autograd.grad(out, leaves, dy)
        results.append([*out, *grads])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


# ---- saved tensors ------------------------------------------------------------------------------
def _saved(fn):
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = fn()
    return kept, out


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), S=st.integers(1, 9), kv=st.integers(1, 4), group=st.integers(1, 4),
       half=st.integers(1, 16), policy=st.sampled_from(["fp32", "bf16", "amp"]))
def test_saved_bytes_exact_hypothesis(B, S, kv, group, half, policy, claims):
    """30 drawn shapes and dtype policies: the op keeps qkv (its input, whole), the two weights and the tables
    and nothing else (no rstd, no normed q or k); qkv's bytes are calculator.attention.qk_norm_saved_efficient's."""
    H, D = kv * group, 2 * half
    cfg = ModelConfig(hidden=8, layers=1, heads=H, kv_heads=kv, head_dim=D, intermediate=8, vocab=8, qk_norm=True)
    run = Run(B, S, policy)
    dt = FP32 if policy == "fp32" else BF16  # the compute dtype: the qkv matmul's output
    g = gen(B * 1000 + S)
    qkv = torch.randn(B, S, (H + 2 * kv) * D, generator=g).to(dt).requires_grad_()
    qw, kw = (torch.ones(D, dtype=BF16 if policy == "bf16" else FP32, requires_grad=True) for _ in range(2))
    cos, sin = rope_tables(S, D)
    kept, _ = _saved(lambda: rope_qkv_norm(qkv, qw, kw, cos, sin, H, kv, EPS))
    assert {id(t) for t in kept} == {id(t) for t in (qkv, qw, kw, cos, sin)} and len(kept) == 5
    predicted = sum(s.bytes for s in qk_norm_saved_efficient(cfg, run, 1))
    claims.check("memory.saved by rope_qkv_norm", component="attention", config=f"B{B}S{S}H{H}KV{kv}D{D}/{policy}",
                 variant="efficient", predicted=predicted, measured=qkv.untyped_storage().nbytes(), device="cpu",
                 unit="B")


# ---- the efficient attention: the fused op with qk_norm, rope_qkv (unchanged) without ------------------
class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_runs_the_fused_op_only_with_qk_norm(qk_norm):
    """With qk_norm the attention's forward calls anatomy::rope_qkv_norm and no rms_norm or cat; without, it calls
    anatomy::rope_qkv, whose saved tensors are still the tables alone."""
    from llm_anatomy.efficient.attention import Attention

    torch.manual_seed(0)
    attn = Attention(32, heads=4, kv_heads=2, head_dim=8, qk_norm=qk_norm)
    cos, sin = rope_tables(5, 8)
    x = torch.randn(2, 5, 32, requires_grad=True)
    with _Ops() as ops:
        attn(x, cos, sin).sum().backward()
    anatomy = [n for n in ops.names if n.startswith("anatomy::")]
    if qk_norm:
        assert anatomy == ["anatomy::rope_qkv_norm", "anatomy::rope_qkv_norm_backward"]
        assert attn.q_norm.weight.grad is not None and attn.k_norm.weight.grad is not None
    else:
        assert anatomy == ["anatomy::rope_qkv", "anatomy::rope_qkv_backward"]
        qkv = torch.randn(2, 5, 64, requires_grad=True)
        kept, _ = _saved(lambda: rope_qkv(qkv, cos, sin, 4, 2))
        assert {id(t) for t in kept} == {id(cos), id(sin)}
    assert "aten::cat" not in ops.names[:ops.names.index(anatomy[0])]  # no cat of normed heads before RoPE


def test_tensor_parallel_weights_reach_the_op_as_the_ranks_copy():
    """Under tensor parallelism distributed/tensor_parallel.py's qk_norm_plan makes the q/k norm weights DTensors
    replicated over tp, while the fused op takes plain tensors. On a one-rank gloo mesh with that plan: the
    attention's output and weight gradients equal the plain module's, and each weight gradient is Partial over
    tp, as SequenceParallel leaves a norm module's weight gradient (the baseline's RMSNorm on head rows beside it,
    as the baseline runs q_norm and k_norm under that plan)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from llm_anatomy.baseline.norm import RMSNorm
    from llm_anatomy.distributed.tensor_parallel import qk_norm_plan
    from llm_anatomy.efficient.attention import Attention

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    torch.manual_seed(0)
    plain = Attention(32, heads=4, kv_heads=2, head_dim=8, qk_norm=True)
    with torch.no_grad():
        plain.q_norm.weight.normal_(1.0, 0.3)
    cos, sin = rope_tables(5, 8)
    x = torch.randn(2, 5, 32)
    plain(x, cos, sin).sum().backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        block = nn.Module()
        block.attn = Attention(32, heads=4, kv_heads=2, head_dim=8, qk_norm=True)
        block.attn.load_state_dict(plain.state_dict())
        parallelize_module(block, mesh, qk_norm_plan())
        y = block.attn(x, cos, sin)
        y.sum().backward()
        norm = parallelize_module(RMSNorm(8, 1e-6), mesh, SequenceParallel(sequence_dim=2, use_local_output=True))
        norm(torch.randn(2, 5, 4, 8)).sum().backward()
        torch.testing.assert_close(y, plain(x, cos, sin))
        for n in ("q_norm", "k_norm"):
            w = getattr(block.attn, n).weight
            assert isinstance(w, DTensor) and isinstance(w.grad, DTensor)
            assert w.grad.placements == norm.weight.grad.placements
            torch.testing.assert_close(w.grad.full_tensor(), getattr(plain, n).weight.grad)
    finally:
        dist.destroy_process_group()


# ---- the fast path, opcheck, meta / fake tensors, torch.compile ------------------------------------
@pytest.mark.parametrize("amp", [False, True])
def test_fast_path_equals_the_op(amp):
    """rope_qkv_norm's eager fast path against torch.ops.anatomy.rope_qkv_norm through the dispatcher (autocast
    rule included): the same bits in every output and gradient."""
    inputs, _, _, _ = case(FP32)
    cos, sin = rope_tables(7, 8)
    dy = [torch.randn(s, generator=gen(2)) for s in ((2, 6, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8))]
    results = []
    for fn in (rope_qkv_norm, torch.ops.anatomy.rope_qkv_norm):
        leaves = [t.clone().requires_grad_() for t in inputs.values()]
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            out = fn(leaves[0], leaves[1], leaves[2], cos, sin, 6, 2, EPS)
        assert all(o.dtype == (BF16 if amp else FP32) for o in out)
        grads = torch.autograd.grad(out, leaves, [d.to(o.dtype) for d, o in zip(dy, out)])
        results.append([*out, *grads])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _op_args():
    qkv, w = torch.randn(2, 7, 80), torch.randn(8)
    cos, sin = rope_tables(7, 8)
    dq, dk = torch.randn(2, 6, 7, 8), torch.randn(2, 2, 7, 8)
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    ops = torch.ops.anatomy
    return {"rope_qkv_norm": (ops.rope_qkv_norm.default, (rg(qkv), rg(w), rg(w * 2), cos, sin, 6, 2, EPS)),
            "rope_qkv_norm_backward": (ops.rope_qkv_norm_backward.default,
                                       (dq, dk, dk.clone(), qkv, w, w * 2, cos, sin, EPS))}


@pytest.mark.parametrize("name", list(_op_args()))
def test_opcheck(name):
    op, args = _op_args()[name]
    torch.library.opcheck(op, args)


def test_meta_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for make in (lambda t: t.to("meta"), FakeTensorMode().from_tensor):
        w = make(torch.randn(8))
        q, k, v = rope_qkv_norm(make(torch.randn(2, 7, 80, dtype=BF16)), w, w, make(torch.randn(7, 8)),
                                make(torch.randn(7, 8)), 6, 2)
        assert (q.shape, k.shape, v.shape) == ((2, 6, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8)) and q.dtype == BF16
        assert q.transpose(1, 2).is_contiguous()
    with pytest.raises(ValueError, match="q_weight shape"):
        rope_qkv_norm(torch.randn(2, 7, 80), torch.randn(6), torch.randn(8), *rope_tables(7, 8), 6, 2)


@pytest.mark.parametrize("amp", [False, True])
def test_compile_fullgraph(amp):
    """A qkv matmul into the fused op under torch.compile(fullgraph=True) (aot_eager): values and gradients equal
    eager's (the op is opaque to the compiler, so the same kernels run on the same matmul output)."""
    torch._dynamo.reset()
    g = gen(3)
    x, wqkv = torch.randn(2, 7, 24, generator=g), torch.randn(24, 80, generator=g)
    qw, kw = (1 + 0.2 * torch.randn(8, generator=g) for _ in range(2))
    cos, sin = rope_tables(7, 8)

    def block(x, wqkv, qw, kw):
        q, k, v = rope_qkv_norm(x @ wqkv, qw, kw, cos, sin, 6, 2)
        return (q.float().square().sum() + k.float().sum() * 3 + v.float().sum()) / 100

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (x, wqkv, qw, kw)]
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            loss = fn(*leaves)
        results.append([loss, *torch.autograd.grad(loss, leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


# ---- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [dict(B=2, S=256, H=32, KV=8, D=128), dict(B=1, S=1031, H=16, KV=4, D=64),
                                   dict(B=2, S=64, H=14, KV=2, D=128), *SHAPES.values()],
                         ids=["qwen3-8b-heads", "tail-1031", "qwen3-odd-heads", *SHAPES])
def test_cuda_kernel_against_reference(dtype, shape):
    """The Triton kernels on CUDA: outputs and all three gradients within twice plain torch's error against fp64
    (plain torch on the GPU); and the outputs and d(qkv), whose reductions run over one head, equal to the CPU
    reference's on the same inputs within torch's tolerances for the dtype."""
    out, grads = check_accuracy(*case(dtype, device="cuda", **shape))["op"]
    inputs, op, _, _ = case(dtype, **shape)
    leaves = [t.clone().requires_grad_() for t in inputs.values()]
    cpu = op(dict(zip(inputs, leaves)))
    g = gen(1)  # check_accuracy's upstream gradients: the same draws, in order
    dy = [torch.randn(o.shape, generator=g).to(o.dtype) for o in cpu]
    dqkv = torch.autograd.grad(cpu, leaves[0], dy)[0]
    for a, b in zip([*out, grads[0]], [*cpu, dqkv]):
        torch.testing.assert_close(a.cpu(), b)


@pytest.mark.gpu
def test_cuda_matches_unfused_ops():
    """On CUDA in fp32: the fused kernels against our unfused ops (the Triton rms_norm and rope_qkv)."""
    inputs, _, _, _ = case(FP32, device="cuda", B=2, S=64, H=8, KV=2, D=128)
    cos, sin = (t.cuda() for t in rope_tables(64, 128))
    dy = [torch.randn(s, device="cuda") for s in ((2, 8, 64, 128), (2, 2, 64, 128), (2, 2, 64, 128))]
    results = []
    for fn in (rope_qkv_norm, unfused_ops):
        leaves = [t.clone().requires_grad_() for t in inputs.values()]
        out = fn(*leaves, cos, sin, 8, 2, EPS)
        results.append([*out, *torch.autograd.grad(out, leaves, dy)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
