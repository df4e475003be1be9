"""The fused linear cross-entropy's backward (llm_anatomy/kernels/linear_ce.py): the saved gradients scaled by the
incoming one in place and handed on, and the scale kernel (`scale_`), which leaves them untouched when the
incoming gradient is 1 and otherwise rounds as torch's mul_ by a 0-d CUDA tensor does (the gradient cast to
the tensor's dtype first). Paths as in test_linear_ce.py: "reference" (torch's mul_) and "triton" (the kernel
under TRITON_INTERPRET=1, inside triton_on_cpu())."""
from __future__ import annotations

import pytest
import torch

from llm_anatomy.kernels import linear_ce as lce
from llm_anatomy.kernels.linear_ce import linear_cross_entropy
from validations.kernel_cases import BF16, FP32
from validations.test_linear_ce import _path, case, needs_interpreter


def _tensor(dtype, n=lce.SCALE_BLOCK * 2 + 37, seed=0):
    """n values (no multiple of the kernel's block), with an inf, a NaN and a -0."""
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    t[:3] = torch.tensor([float("inf"), float("nan"), -0.0]).to(dtype)
    return t


@needs_interpreter
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_scale_by_one_leaves_every_bit(dtype):
    """s == 1: the tensor keeps every bit (NaN payload and -0 included): the kernel returned before its loads."""
    t = _tensor(dtype)
    want = t.clone()
    with _path("triton"):
        assert lce.scale_(t, torch.tensor(1.0)) is t
    assert torch.equal(t.view(torch.int16 if dtype == BF16 else torch.int32),
                       want.view(torch.int16 if dtype == BF16 else torch.int32))


@needs_interpreter
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("s", [0.7, 1 / 3, 0.0, 2.0], ids=["0.7", "1/3", "0", "2"])
def test_scale_rounds_as_torch_on_cuda(dtype, s):
    """s != 1: x * s in fp32, s first cast to x's dtype, the product rounded to x's dtype: what torch's mul_
    computes for a 0-d CUDA tensor (a CPU 0-d tensor is a scalar there and skips the cast). fp32 bitwise;
    bf16 within two bf16 units, as the interpreter rounds fp32 to bf16 toward zero, twice here (s, then the
    product); on the GPU both round to nearest (test_cuda_scale_is_torchs_mul: bitwise)."""
    t = _tensor(dtype)
    want = (t.float() * torch.tensor(s).to(dtype).float()).to(dtype)
    with _path("triton"):
        lce.scale_(t, torch.tensor(s))
    assert t.isnan().equal(want.isnan())
    t, want = t.nan_to_num(), want.nan_to_num()
    if dtype == FP32:
        assert torch.equal(t, want)
    else:
        ulp = torch.finfo(BF16).eps * want.float().abs().clamp(min=torch.finfo(BF16).tiny)
        assert ((t.float() - want.float()).abs() <= 2 * ulp).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("s", [1.0, 0.7, 1 / 3], ids=["1", "0.7", "1/3"])
def test_cuda_scale_is_torchs_mul(cuda_device, dtype, s):
    """On the GPU the kernel is bitwise torch's own mul_ by the same 0-d CUDA tensor, at a size with a tail."""
    t = _tensor(dtype).to(cuda_device)
    want = t.clone().mul_(torch.tensor(s, device=cuda_device))
    lce.scale_(t, torch.tensor(s, device=cuda_device))
    assert torch.equal(t.nan_to_num(), want.nan_to_num()) and t.isnan().equal(want.isnan())


@needs_interpreter
def test_scale_falls_back_off_the_kernel():
    """A non-contiguous tensor, or the reference path, takes torch's mul_; an empty one launches nothing."""
    t = torch.randn(8, 6)
    col = t[:, 1]
    want = t.clone()
    want[:, 1] *= 0.5
    with _path("triton"):
        lce.scale_(col, torch.tensor(0.5))
        assert lce.scale_(torch.empty(0), torch.tensor(0.5)).numel() == 0
    assert torch.equal(t, want)
    u = torch.ones(5)
    assert torch.equal(lce.scale_(u, torch.tensor(3.0)), torch.full((5,), 3.0))


def test_backward_returns_the_saved_buffers():
    """Eager backward scales the saved gradients in place and hands them on: w.grad is the very (V, H)
    buffer the forward filled (no copy, no new allocation); a second backward fails loudly rather than
    scaling twice; inplace_backward=False keeps them for retain_graph."""
    x, w, t = case()
    xl, wl = x.to(BF16).requires_grad_(), w.float().requires_grad_()
    ptrs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: ptrs.append(v.data_ptr()) or v, lambda v: v):
        loss = linear_cross_entropy(xl, wl, t)
    loss.backward(torch.tensor(0.5))
    assert [xl.grad.data_ptr(), wl.grad.data_ptr()] == ptrs
    loss = linear_cross_entropy(xl, wl, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(retain_graph=True)
    loss = linear_cross_entropy(xl, wl, t, inplace_backward=False)
    a = torch.autograd.grad(loss, (xl, wl), retain_graph=True)
    assert all(map(torch.equal, a, torch.autograd.grad(loss, (xl, wl))))
