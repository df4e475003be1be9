"""Fused kernels (llm_anatomy/kernels), all three ops together: strided inputs and NaN, saved tensors, autocast.

Per op: test_rms_norm.py, test_swiglu.py, test_rope.py; fake/meta and torch.compile:
test_kernels_compile.py. The accuracy rule and the two CPU paths ("reference", "triton") are
validations/kernel_cases.py's.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from llm_anatomy.kernels import rms_norm, rope_qkv, swiglu
from validations.kernel_cases import BF16, FP32, IGNORE_OVERFLOW, PATHS, path_ctx, plain_swiglu, rope_tables

pytestmark = IGNORE_OVERFLOW


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs_and_nan(path):
    """Non-contiguous inputs give bit-identical results to their contiguous copies (the launchers
    take row strides, or copy); NaN propagates through the gpt-oss clamps as through torch.clamp."""
    x, w = torch.randn(48, 7, 2).transpose(0, 2), torch.randn(48)  # (2, 7, 48), last dim strided
    gu = torch.randn(2, 7, 80)
    qkv = torch.randn(2, 80, 7).transpose(1, 2)  # (2, 7, 80)
    cos, sin = rope_tables(7, 8)
    with path_ctx(path):
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
        with path_ctx(path), amp_ctx:
            saved, _ = _saved(fn)
        assert [spec(t) for t in saved] == [spec(t, cast) for t in expect], component
        if cast in (None, FP32):  # not copies: the very tensors passed in
            assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in expect], component
        claims.check("saved bytes", component=component, config="B2-S7-N48-I40", variant=f"efficient-{path}",
                     predicted=nbytes, measured=_bytes(saved), unit="B", note="autocast" if amp else "")


# ---- autocast ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_autocast_dtypes(path):
    x, w = torch.randn(2, 7, 48, requires_grad=True), torch.randn(48, requires_grad=True)
    gate, up = torch.randn(2, 7, 40, requires_grad=True), torch.randn(2, 7, 40, requires_grad=True)
    qkv = torch.randn(2, 7, 80, requires_grad=True)
    with path_ctx(path), torch.autocast("cpu", dtype=BF16):
        y, h, (q, k, v) = rms_norm(x, w), swiglu(gate, up), rope_qkv(qkv, *rope_tables(7, 8), 6, 2)
        assert y.dtype == h.dtype == q.dtype == k.dtype == v.dtype == BF16
        (y.float().sum() + h.float().sum() + q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert all(t.grad.dtype == FP32 for t in (x, w, gate, up, qkv))  # gradients in the leaves' dtypes
    assert rms_norm(x, w).dtype == FP32  # and outside autocast, x's dtype


# ---- CUDA: the Triton kernels compiled for the GPU, in bf16 ------------------------------------
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
