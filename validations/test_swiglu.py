"""The fused SwiGLU op (llm_anatomy/kernels/swiglu.py): accuracy of both variants against the reference's
own error (validations/kernel_cases.py), gpt-oss's inclusive clamps, and the in-place backward (exact,
and never silent). The packed form is validations/test_swiglu_packed.py."""
from __future__ import annotations

import pytest
import torch

from llm_anatomy.kernels import swiglu
from llm_anatomy.kernels.swiglu import _disjoint
from validations.kernel_cases import (BF16, FP32, IGNORE_OVERFLOW, PATHS, check_accuracy, path_ctx, plain_swiglu,
                                      swiglu_case)

pytestmark = IGNORE_OVERFLOW


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_swiglu_accuracy(path, variant, dtype):
    check_accuracy(*swiglu_case(dtype, variant), path=path_ctx(path))


@pytest.mark.parametrize("path", PATHS)
def test_gpt_oss_clamp_gradient_is_inclusive(path):
    """torch's clamp_backward passes the gradient where min <= x <= max: at exactly 7 and -7 too."""
    gate = torch.tensor([[6.0, 7.0, 7.5, -9.0]], requires_grad=True)
    up = torch.tensor([[-7.5, -7.0, 7.0, 7.5]], requires_grad=True)
    with path_ctx(path):
        dg, du = torch.autograd.grad(swiglu(gate, up, "gpt-oss").sum(), (gate, up))
    eg, eu = torch.autograd.grad(plain_swiglu(gate, up, "gpt-oss").sum(), (gate, up))
    assert (dg != 0).tolist() == (eg != 0).tolist() == [[True, True, False, True]]
    assert (du != 0).tolist() == (eu != 0).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("path", PATHS)
def test_swiglu_inplace_backward(path):
    x = torch.randn(2, 7, 16)
    wgu = torch.randn(16, 80, requires_grad=True)
    with path_ctx(path):
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


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("shape", [(2, 7, 40), (4, 512, 5632)], ids=["small", "tinyllama"])
def test_gpu_swiglu(variant, shape):
    check_accuracy(*swiglu_case(BF16, variant, device="cuda", shape=shape))
