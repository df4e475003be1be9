"""Fused kernels (anatomy/kernels): accuracy, saved tensors, autocast, fake/meta, torch.compile.

Accuracy is judged against the reference's own error (DESIGN.md): for every output and gradient,
    err(op in dtype vs fp64) <= 2 * err(plain torch in dtype vs fp64) + floor,
err = max abs difference, the fp64 reference being the same plain-torch code run on the
dtype-rounded inputs in float64. floor = eps(dtype) * max|fp64 value| is one unit of rounding at
the tensor's largest magnitude: no result stored in that dtype can be promised closer than half of
it, and it keeps the bound meaningful where the plain code happens to be exact (v in rope_qkv is a
pure copy; some fp32 elementwise results round identically), where 2 * 0 would demand the
impossible of any implementation that rounds differently.

Paths: "reference" runs the ops as CPU CI does (plain-torch implementations); "triton" runs them
inside triton_on_cpu(), i.e. through the Triton kernels under TRITON_INTERPRET=1; gpu-marked tests
run the Triton kernels on CUDA in bf16.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from anatomy.calculator.fused import RMS_MIN_ROWS, rms_norm_programs
from anatomy.kernels import (HAS_TRITON, INTERPRET, rms_norm, rms_norm_backward_triton, rms_norm_triton, rope_qkv,
                             swiglu, triton_on_cpu)
from anatomy.kernels.rms_norm import MAX_BLOCK, backward_programs
from anatomy.kernels.swiglu import _disjoint

# The interpreter evaluates sigmoid as 1/(1+exp(-x)) in numpy: exp overflows to inf for very
# negative x and the result is the correct 0, with a numpy warning.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="TRITON_INTERPRET=1 is not set (conftest sets it where nvidia-smi is absent): "
                          "the Triton kernels are checked on CUDA by the gpu-marked tests instead")
PATHS = ["reference", pytest.param("triton", marks=needs_interpreter)]


def _path(name: str):
    return triton_on_cpu() if name == "triton" else contextlib.nullcontext()


# ---- plain-torch implementations: the same-dtype baseline, and in fp64 the reference -----------
def plain_rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def plain_swiglu(gate, up, variant):
    if variant == "gpt-oss":
        return (up.clamp(-7.0, 7.0) + 1) * F.silu(gate.clamp(max=7.0))
    return F.silu(gate) * up


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain_rope_qkv(qkv, cos, sin, heads, kv_heads):  # Hugging Face style: tables cast to the activation dtype
    B, S, W = qkv.shape
    D = W // (heads + 2 * kv_heads)
    q, k, v = (t.transpose(1, 2) for t in qkv.view(B, S, -1, D).split([heads, kv_heads, kv_heads], dim=2))
    c, s = cos.to(qkv.dtype), sin.to(qkv.dtype)
    return (q * c + _rotate_half(q) * s).contiguous(), (k * c + _rotate_half(k) * s).contiguous(), v.contiguous()


def rope_tables(S, D, dtype=FP32, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=FP64) / D)
    emb = torch.outer(torch.arange(S, dtype=FP64), inv).repeat(1, 2)  # cat(freqs, freqs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ---- cases: inputs (leaves), the op, and its plain-torch twin ----------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def rms_case(dtype, wdtype=None, device="cpu", shape=(2, 7, 48), seed=0):
    g = _gen(seed)
    x = torch.randn(shape, generator=g).to(device, dtype) * 3
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, wdtype or dtype)
    return (dict(x=x, w=w), (lambda t: (rms_norm(t["x"], t["w"]),)), (lambda t: (plain_rms_norm(t["x"], t["w"]),)),
            _rms_dx_scale)


def _rms_dx_scale(ref_in, dref):
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w: a projection that cancels when x has few
    columns (for N = 1 it is exactly eps-sized), so rounding is set by the terms, of size rstd * |g|."""
    x, w = ref_in["x"].detach(), ref_in["w"].detach()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return {"dx": (rstd * dref[0] * w).abs().max().item()}


def swiglu_case(dtype, variant, device="cpu", shape=(2, 7, 40), seed=0):
    g = _gen(seed)
    gate, up = (torch.randn(shape, generator=g) * 4 for _ in range(2))  # |.| > 7 happens: both clamps act
    gate.view(-1)[:3] = torch.tensor([7.0, -7.0, 8.0])  # the clamp boundaries, where the gradient passes
    up.view(-1)[:3] = torch.tensor([7.0, -7.0, -8.0])
    # .clone() makes them non-leaf activations, so the in-place backward path is the one exercised
    op = lambda t: (swiglu(t["gate"].clone(), t["up"].clone(), variant),)  # noqa: E731
    return (dict(gate=gate.to(device, dtype), up=up.to(device, dtype)), op,
            lambda t: (plain_swiglu(t["gate"], t["up"], variant),), None)


def rope_case(dtype, device="cpu", B=2, S=7, H=6, KV=2, D=8, seed=0):
    cos, sin = (t.to(device) for t in rope_tables(S, D))
    qkv = torch.randn(B, S, (H + 2 * KV) * D, generator=_gen(seed)).to(device, dtype)
    return (dict(qkv=qkv), lambda t: rope_qkv(t["qkv"], cos, sin, H, KV),
            lambda t: plain_rope_qkv(t["qkv"], cos, sin, H, KV), None)


def _err(a, ref):
    return (a.double() - ref).abs().max().item() if a.numel() else 0.0


def check_accuracy(inputs, op, plain, term_scale=None, path=contextlib.nullcontext(), seed=1):
    """Forward outputs and gradients of every input: op vs plain, both against fp64.

    The floor's scale is the fp64 value's max magnitude, or, where term_scale names a tensor, the
    magnitude of the terms it is computed from (when those cancel, their rounding is the floor)."""
    leaf = lambda t, dt=None: t.detach().to(dt or t.dtype).requires_grad_()  # noqa: E731
    ref_in = {k: leaf(v, FP64) for k, v in inputs.items()}
    ref_out = plain(ref_in)
    g = _gen(seed)
    grads = [torch.randn(o.shape, generator=g).to(o.device) for o in ref_out]
    results = {}
    for name, fn in (("op", op), ("plain", plain)):
        t_in = {k: leaf(v) for k, v in inputs.items()}
        with path if name == "op" else contextlib.nullcontext():
            out = fn(t_in)
            dout = [gr.to(o.dtype) for gr, o in zip(grads, out)]
            results[name] = (list(out), list(torch.autograd.grad(out, list(t_in.values()), dout)))
    # the reference sees the exact upstream gradients the others saw (rounded to the output dtype)
    dref = [gr.to(o.dtype).double() for gr, o in zip(grads, results["op"][0])]
    ref = list(ref_out), list(torch.autograd.grad(ref_out, list(ref_in.values()), dref))
    names = [f"out{i}" for i in range(len(ref_out))] + [f"d{k}" for k in inputs]
    scales = term_scale(ref_in, dref) if term_scale else {}
    for name, o, p, r in zip(names, sum(results["op"], []), sum(results["plain"], []), sum(ref, [])):
        assert o.dtype == p.dtype or name.startswith("out"), (name, o.dtype, p.dtype)
        e_op, e_plain = _err(o, r), _err(p, r)
        floor = torch.finfo(o.dtype).eps * scales.get(name, r.abs().max().item())
        assert e_op <= 2 * e_plain + floor, \
            f"{name}: op error {e_op:.3g} > 2 x plain {e_plain:.3g} + floor {floor:.3g}"
    return results


# ---- accuracy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,wdtype", [(FP32, FP32), (BF16, BF16), (BF16, FP32)], ids=["fp32", "bf16", "bf16-w32"])
def test_rms_norm_accuracy(path, dtype, wdtype):
    out = check_accuracy(*rms_case(dtype, wdtype), path=_path(path))["op"]
    assert out[0][0].dtype == dtype and out[1][0].dtype == dtype and out[1][1].dtype == wdtype


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_swiglu_accuracy(path, variant, dtype):
    check_accuracy(*swiglu_case(dtype, variant), path=_path(path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 8), (3, 3, 6), (4, 1, 2)], ids=["gqa", "mha-odd", "mqa-d2"])
def test_rope_qkv_accuracy(path, dtype, heads, kv_heads, head_dim):
    q, k, v = check_accuracy(*rope_case(dtype, H=heads, KV=kv_heads, D=head_dim), path=_path(path))["op"][0]
    assert k.is_contiguous() and v.is_contiguous() and all(t.dtype == dtype for t in (q, k, v))
    assert q.transpose(1, 2).is_contiguous()  # q is laid out (B, S, heads, D): SDPA's output follows it
    assert q.shape == (2, heads, 7, head_dim) and k.shape == v.shape == (2, kv_heads, 7, head_dim)


@pytest.mark.parametrize("path", PATHS)
def test_gpt_oss_clamp_gradient_is_inclusive(path):
    """torch's clamp_backward passes the gradient where min <= x <= max: at exactly 7 and -7 too."""
    gate = torch.tensor([[6.0, 7.0, 7.5, -9.0]], requires_grad=True)
    up = torch.tensor([[-7.5, -7.0, 7.0, 7.5]], requires_grad=True)
    with _path(path):
        dg, du = torch.autograd.grad(swiglu(gate, up, "gpt-oss").sum(), (gate, up))
    eg, eu = torch.autograd.grad(plain_swiglu(gate, up, "gpt-oss").sum(), (gate, up))
    assert (dg != 0).tolist() == (eg != 0).tolist() == [[True, True, False, True]]
    assert (du != 0).tolist() == (eu != 0).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs_and_nan(path):
    """Non-contiguous inputs give bit-identical results to their contiguous copies (the launchers
    take row strides, or copy); NaN propagates through the gpt-oss clamps as through torch.clamp."""
    x, w = torch.randn(48, 7, 2).transpose(0, 2), torch.randn(48)  # (2, 7, 48), last dim strided
    gu = torch.randn(2, 7, 80)
    qkv = torch.randn(2, 80, 7).transpose(1, 2)  # (2, 7, 80)
    cos, sin = rope_tables(7, 8)
    with _path(path):
        assert torch.equal(rms_norm(x, w), rms_norm(x.contiguous(), w))
        g, u = gu.chunk(2, -1)
        assert torch.equal(swiglu(g, u, "gpt-oss"), swiglu(g.contiguous(), u.contiguous(), "gpt-oss"))
        assert all(map(torch.equal, rope_qkv(qkv, cos, sin, 6, 2), rope_qkv(qkv.contiguous(), cos, sin, 6, 2)))
        nan = torch.tensor([[float("nan"), 1.0]])
        assert swiglu(nan, nan.flip(-1), "gpt-oss").isnan().tolist() == [[True, True]]
        # the in-place backward on a tensor rows() cannot view (transposed) writes its result back
        leaf = torch.randn(40, 7, requires_grad=True)
        gate = leaf.T * 1  # non-leaf, (7, 40) with strides (1, 7)
        up = torch.randn(7, 40)
        dref = torch.autograd.grad(plain_swiglu(gate, up, "swiglu").sum(), leaf, retain_graph=True)[0]
        swiglu(gate, up.requires_grad_()).sum().backward()
    torch.testing.assert_close(leaf.grad, dref)


@given(rows=st.integers(1, 6), n=st.integers(1, 80), dtype=st.sampled_from([FP32, BF16]), seed=st.integers(0, 9))
def test_rms_norm_shapes_hypothesis(rows, n, dtype, seed):
    """Any row count and hidden size (powers of two or not): the op, and the Triton launchers called
    directly on CPU tensors where the interpreter is on."""
    inputs, op, plain, scale = rms_case(dtype, shape=(rows, n), seed=seed)
    check_accuracy(inputs, op, plain, scale)
    if INTERPRET:
        launch = lambda t: (_RmsTriton.apply(t["x"], t["w"]),)  # noqa: E731
        check_accuracy(inputs, launch, plain, scale)


@pytest.mark.skipif(not INTERPRET, reason="the Triton launchers run on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows,n", [(50, 1000), (37, 300), (9, 5000), (130, 33)])
def test_rms_norm_row_tiles(rows, n):
    """The kernels pack narrow rows into tiles (_fwd_tile, _bwd_tile): the backward's 2-row tiles over a
    program's 7 rows with a masked tail (50 x 1000), forward tiles of 4 and 32 rows with a masked last
    tile, one row per tile (5000 wide), and the dw sum's narrow column blocks, all against the
    reference's error."""
    inputs, _, plain, scale = rms_case(FP32, shape=(rows, n), seed=rows)
    check_accuracy(inputs, lambda t: (_RmsTriton.apply(t["x"], t["w"]),), plain, scale)


@pytest.mark.skipif(not HAS_TRITON, reason="the launcher's program count is computed with triton.cdiv")
@given(M=st.integers(1, 1 << 20), N=st.integers(1, MAX_BLOCK), sms=st.sampled_from([108, 132, 170]))
def test_rms_norm_backward_programs_are_the_calculators(M, N, sms):
    """The fused backward's programs on a CUDA device (one fp32 row of dw partials each: the memory
    model's transient, and the partial sum's rows in the timing model) are what the calculator computes
    for itself (calculator/fused.rms_norm_programs): the rule lives in both, and must not drift."""
    props = SimpleNamespace(multi_processor_count=sms)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device: props):
        programs, per = backward_programs(torch.device("cuda"), M, N)
    assert programs == rms_norm_programs(N, M, sms)
    assert (programs - 1) * per < M <= programs * per  # every program has rows, and all rows are covered
    assert per >= min(M, RMS_MIN_ROWS) and programs <= sms * max(1, 8192 // N)


class _RmsTriton(torch.autograd.Function):  # the bare launchers, no custom op around them
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return rms_norm_triton(x, w, 1e-5)

    @staticmethod
    def backward(ctx, dy):
        return rms_norm_backward_triton(dy, *ctx.saved_tensors, 1e-5)


@given(B=st.integers(1, 2), S=st.integers(1, 3), kv=st.integers(1, 3), group=st.integers(1, 3), half=st.integers(1, 6))
def test_rope_qkv_shapes_hypothesis(B, S, kv, group, half):
    """Head counts and head dims around the kernel's power-of-two tiles. (B, S) only set the grid, one
    program per token, so they stay small: the interpreter runs programs one after another."""
    paths = ["reference"] + (["triton"] if INTERPRET else [])
    for path in paths:
        check_accuracy(*rope_case(FP32, B=B, S=S, H=kv * group, KV=kv, D=2 * half), path=_path(path))


# ---- what autograd saves -----------------------------------------------------------------------
def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return saved, out


def _bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("amp", [False, True], ids=["plain", "autocast"])
def test_saved_tensors(path, amp, claims):
    B, S, N, I, H, KV = 2, 7, 48, 40, 6, 2
    D = N // H
    x = torch.randn(B, S, N, requires_grad=True)
    w = torch.ones(N, requires_grad=True)
    gate, up = torch.randn(B, S, I, requires_grad=True), torch.randn(B, S, I, requires_grad=True)
    qkv = torch.randn(B, S, (H + 2 * KV) * D, requires_grad=True)
    cos, sin = rope_tables(S, D)
    act = BF16 if amp else FP32  # autocast casts gate/up (not x, not the tables)
    amp_ctx = torch.autocast("cpu", dtype=BF16) if amp else contextlib.nullcontext()
    spec = lambda t, dt=None: (tuple(t.shape), dt or t.dtype)  # noqa: E731
    cases = {  # component: (call, the tensors it must save, their dtype when cast, bytes by formula)
        "norm": (lambda: rms_norm(x, w), [x, w], None, B * S * N * 4 + N * 4),
        "mlp": (lambda: swiglu(gate, up), [gate, up], act, 2 * B * S * I * act.itemsize),
        "attention": (lambda: rope_qkv(qkv, cos, sin, H, KV), [cos, sin], None, 2 * S * D * 4),
    }
    for component, (fn, expect, cast, nbytes) in cases.items():
        with _path(path), amp_ctx:
            saved, _ = _saved(fn)
        assert [spec(t) for t in saved] == [spec(t, cast) for t in expect], component
        if cast in (None, FP32):  # not copies: the very tensors passed in
            assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in expect], component
        claims.check("saved bytes", component=component, config="B2-S7-N48-I40", variant=f"efficient-{path}",
                     predicted=nbytes, measured=_bytes(saved), unit="B", note="autocast" if amp else "")


def test_rope_keeps_no_reference_to_qkv():
    qkv = torch.randn(2, 7, 80, requires_grad=True) * 1.0  # a non-leaf: only the graph could keep it alive
    q, k, v = rope_qkv(qkv, *rope_tables(7, 8), 6, 2)
    assert all(t.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr() for t in (q, k, v))
    ref = weakref.ref(qkv)
    del qkv
    gc.collect()
    assert ref() is None


# ---- swiglu in-place backward ------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_swiglu_inplace_backward(path):
    x = torch.randn(2, 7, 16)
    wgu = torch.randn(16, 80, requires_grad=True)
    with _path(path):
        gate, up = (x @ wgu).chunk(2, -1)  # the two halves of one fused projection
        dh = torch.randn(2, 7, 40)
        dg_ref, du_ref = torch.autograd.grad(plain_swiglu(gate, up, "swiglu"), (gate, up), dh, retain_graph=True)
        v0 = gate._version
        swiglu(gate, up).backward(dh)
    assert gate._version > v0  # the saved buffers now hold the gradients
    torch.testing.assert_close(gate.detach(), dg_ref)
    torch.testing.assert_close(up.detach(), du_ref)
    torch.testing.assert_close(wgu.grad, (x.reshape(-1, 16).T @ torch.cat([dg_ref, du_ref], -1).reshape(-1, 80)))


def test_swiglu_inplace_is_never_silent():
    # A leaf's data is the user's: never overwritten.
    gate, up = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    g0 = gate.detach().clone()
    swiglu(gate, up).sum().backward()
    assert torch.equal(gate.detach(), g0)
    # retain_graph: the second backward trips autograd's version check, unless the caller opts out.
    for inplace in (True, False):
        g, u = gate * 1, up * 1
        h = swiglu(g, u, inplace_backward=inplace)
        h.sum().backward(retain_graph=True)
        if inplace:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                h.sum().backward()
        else:
            h.sum().backward()
    # Another node that saved gate and runs after ours: autograd's version check, not wrong numbers.
    g, u = gate * 1, up * 1
    other = (g * up).sum()  # MulBackward saves g; created first, so it runs after swiglu's backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (swiglu(g, u).sum() + other).backward()


def test_disjoint():
    gu = torch.empty(2, 7, 80)
    assert _disjoint(*gu.chunk(2, -1))
    assert not _disjoint(gu[..., :40], gu[..., 20:60])
    assert _disjoint(gu[0], gu[1]) and not _disjoint(gu[0, :, :40], gu[0, :, :40])
    assert not _disjoint(gu[:, :, :40], gu[:, :, 1:41])
    assert _disjoint(torch.empty(3, 4), torch.empty(3, 4))


# ---- autocast ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_autocast_dtypes(path):
    x, w = torch.randn(2, 7, 48, requires_grad=True), torch.randn(48, requires_grad=True)
    gate, up = torch.randn(2, 7, 40, requires_grad=True), torch.randn(2, 7, 40, requires_grad=True)
    qkv = torch.randn(2, 7, 80, requires_grad=True)
    with _path(path), torch.autocast("cpu", dtype=BF16):
        y, h, (q, k, v) = rms_norm(x, w), swiglu(gate, up), rope_qkv(qkv, *rope_tables(7, 8), 6, 2)
        assert y.dtype == h.dtype == q.dtype == k.dtype == v.dtype == BF16
        (y.float().sum() + h.float().sum() + q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert all(t.grad.dtype == FP32 for t in (x, w, gate, up, qkv))  # gradients in the leaves' dtypes
    assert rms_norm(x, w).dtype == FP32  # and outside autocast, x's dtype


# ---- CUDA: the Triton kernels compiled for the GPU, in bf16 ------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 7, 48), (4, 512, 4096)], ids=["small", "llama-1b"])
def test_gpu_rms_norm(shape):
    check_accuracy(*rms_case(BF16, FP32, device="cuda", shape=shape))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("shape", [(2, 7, 40), (4, 512, 5632)], ids=["small", "tinyllama"])
def test_gpu_swiglu(variant, shape):
    check_accuracy(*swiglu_case(BF16, variant, device="cuda", shape=shape))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(2, 7, 6, 2, 8), (2, 1024, 32, 4, 64), (1, 512, 32, 8, 128)],
                         ids=["small", "tinyllama", "llama3"])
def test_gpu_rope_qkv(cfg):
    B, S, H, KV, D = cfg
    check_accuracy(*rope_case(BF16, device="cuda", B=B, S=S, H=H, KV=KV, D=D))


@pytest.mark.gpu
def test_gpu_saved_and_autocast():
    x = torch.randn(4, 512, 2048, device="cuda", requires_grad=True)
    w = torch.ones(2048, device="cuda", requires_grad=True)
    gate = torch.randn(4, 512, 5632, device="cuda", requires_grad=True)
    qkv = torch.randn(4, 512, 48 * 64, device="cuda", requires_grad=True)
    cos, sin = (t.cuda() for t in rope_tables(512, 64))
    with torch.autocast("cuda", dtype=BF16):
        saved, y = _saved(lambda: rms_norm(x, w))
        assert y.dtype == BF16 and _bytes(saved) == x.numel() * 4 + w.numel() * 4
        saved, h = _saved(lambda: swiglu(gate, gate * 2))
        assert h.dtype == BF16 and _bytes(saved) == 2 * gate.numel() * 2
        saved, (q, k, v) = _saved(lambda: rope_qkv(qkv, cos, sin, 32, 8))
        assert q.dtype == BF16 and _bytes(saved) == 2 * 512 * 64 * 4
        (y.float().sum() + h.float().sum() + q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert x.grad.dtype == w.grad.dtype == gate.grad.dtype == qkv.grad.dtype == FP32
