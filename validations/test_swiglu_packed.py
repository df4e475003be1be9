"""swiglu_packed (llm_anatomy.kernels.swiglu): the MLP's activation on one (..., 2I) gate_up tensor.

It must compute exactly what swiglu computes on the two column halves, and its backward must hand
back gate_up's own storage, filled in place with d(gate_up): no SplitBackward, no cat, no new
(M, 2I) buffer. Both paths on CPU: the plain-torch reference and, under TRITON_INTERPRET=1, the
Triton kernels; the CUDA kernels run in the GPU suite through the efficient model.
"""
import contextlib

import pytest
import torch
from torch.library import opcheck

from llm_anatomy.kernels import swiglu, swiglu_packed
from validations.kernel_cases import IGNORE_OVERFLOW, PATHS, path_ctx

pytestmark = IGNORE_OVERFLOW


def _graph(variant: str, packed: bool, autocast: bool):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    w = (torch.randn(24, 16) * 0.5).requires_grad_()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        gate_up = x @ w.t()  # (2, 5, 24): gate and up are its halves, I = 12
        h = swiglu_packed(gate_up, variant) if packed else swiglu(*gate_up.split(12, -1), variant)
    return w, gate_up, h


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("path", PATHS)
def test_packed_equals_the_two_halves(path, variant, autocast):
    """Same output and same weight gradient, bit for bit, as swiglu on the split halves."""
    with path_ctx(path):
        w1, _, h1 = _graph(variant, True, autocast)
        w2, _, h2 = _graph(variant, False, autocast)
        dh = torch.randn_like(h1)
        h1.backward(dh)
        h2.backward(dh)
    assert h1.dtype == (torch.bfloat16 if autocast else torch.float32) and h1.shape == (2, 5, 12)
    assert torch.equal(h1, h2)
    assert torch.equal(w1.grad, w2.grad)


@pytest.mark.parametrize("path", PATHS)
def test_backward_returns_gate_ups_own_storage(path):
    """d(gate_up) is written into the saved gate_up (its version bumps) and handed on as is: the
    graph has the op's backward straight above the matmul's, with no split or cat between."""
    with path_ctx(path):
        w, gate_up, h = _graph("swiglu", True, False)
        assert type(h.grad_fn.next_functions[0][0]).__name__.startswith(("MmBackward", "UnsafeViewBackward",
                                                                         "ViewBackward"))
        dh = torch.randn_like(h)
        ref = torch.autograd.grad(swiglu(*gate_up.split(12, -1), inplace_backward=False), gate_up, dh,
                                  retain_graph=True)[0]
        seen = {}
        gate_up.register_hook(lambda g: seen.setdefault("grad", g))  # after the reference's own backward
        ptr, v0 = gate_up.untyped_storage().data_ptr(), gate_up._version
        h.backward(dh)
    assert gate_up._version > v0
    assert seen["grad"].untyped_storage().data_ptr() == ptr  # the gradient is gate_up's own storage
    torch.testing.assert_close(seen["grad"], ref)


def test_never_overwrites_a_leaf_and_never_silently_reuses():
    gate_up = torch.randn(3, 16, requires_grad=True)
    before = gate_up.detach().clone()
    swiglu_packed(gate_up).sum().backward()
    assert torch.equal(gate_up.detach(), before)  # a leaf is the user's data: the out-of-place path
    for inplace in (True, False):
        h = swiglu_packed(gate_up * 1, inplace_backward=inplace)
        h.sum().backward(retain_graph=True)
        if inplace:  # a second backward would read gradients as activations: autograd refuses
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                h.sum().backward()
        else:
            h.sum().backward()


def test_custom_op_registration_and_bad_input():
    opcheck(torch.ops.anatomy.swiglu_packed.default, (torch.randn(3, 8, requires_grad=True), "swiglu", False))
    opcheck(torch.ops.anatomy.swiglu_packed.default, (torch.randn(2, 3, 10), "gpt-oss", True))
    with pytest.raises(ValueError, match="must be 2 x intermediate"):
        swiglu_packed(torch.randn(3, 7))
    h = swiglu_packed(torch.empty(4, 6, device="meta"))  # the fake implementation: shapes without data
    assert h.shape == (4, 3) and h.device.type == "meta"
