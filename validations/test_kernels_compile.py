"""The kernel ops under meta and fake tensors, torch.library.opcheck, and torch.compile(fullgraph=True).

Split from test_kernels.py (accuracy, saved tensors, in-place backward, autocast, CUDA), whose
cases and helpers it reuses."""
from __future__ import annotations

import pytest
import torch

from llm_anatomy.kernels import linear_cross_entropy, rms_norm, rope_qkv, swiglu
from validations.kernel_cases import BF16, FP32, gen, rope_tables


# ---- fake / meta / opcheck ---------------------------------------------------------------------
def test_meta_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for make in (lambda t: t.to("meta"), FakeTensorMode().from_tensor):
        x, w = make(torch.randn(2, 7, 48, dtype=BF16)), make(torch.randn(48))
        assert (rms_norm(x, w).shape, rms_norm(x, w).dtype) == ((2, 7, 48), BF16)
        g = make(torch.randn(2, 7, 40, dtype=BF16))
        assert (swiglu(g, g, "gpt-oss").shape, swiglu(g, g).dtype) == ((2, 7, 40), BF16)
        q, k, v = rope_qkv(make(torch.randn(2, 7, 10 * 8)), make(torch.randn(7, 8)), make(torch.randn(7, 8)), 6, 2)
        assert (q.shape, k.shape, v.shape) == ((2, 6, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8))


def _opcheck_cases():
    x, w, dy = torch.randn(2, 7, 48), torch.randn(48), torch.randn(2, 7, 48)
    g, u, dh = torch.randn(2, 7, 40), torch.randn(2, 7, 40), torch.randn(2, 7, 40)
    qkv, (cos, sin) = torch.randn(2, 7, 80), rope_tables(7, 8)
    dq, dk = torch.randn(2, 6, 7, 8), torch.randn(2, 2, 7, 8)
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    ops = torch.ops.anatomy
    return {
        "rms_norm": (ops.rms_norm.default, (rg(x), rg(w), 1e-5, None)),
        "rms_norm-bf16-out": (ops.rms_norm.default, (rg(x), rg(w), 1e-5, BF16)),
        "rms_norm_backward": (ops.rms_norm_backward.default, (dy, x, w, 1e-5)),
        "swiglu": (ops.swiglu.default, (rg(g), rg(u), "gpt-oss", True)),
        "swiglu_backward": (ops.swiglu_backward.default, (dh, g, u, "swiglu")),
        "swiglu_backward_": (ops.swiglu_backward_.default, (dh, g.clone(), u.clone(), "gpt-oss")),
        "rope_qkv": (ops.rope_qkv.default, (rg(qkv), cos, sin, 6, 2)),
        "rope_qkv_backward": (ops.rope_qkv_backward.default, (dq, dk, dk.clone(), cos, sin)),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# ---- torch.compile -----------------------------------------------------------------------------
TARGETS = torch.randint(0, 80, (14,), generator=gen(4))


def _block(x, wn, wqkv, wgu, cos, sin):
    h = rms_norm(x, wn)
    q, k, v = rope_qkv(h @ wqkv, cos, sin, 6, 2)
    g, u = (h @ wgu).chunk(2, -1)
    loss = linear_cross_entropy(h, wgu.t(), TARGETS.view(2, 7), chunk=8)  # a (80, 48) head, two chunks
    return swiglu(g, u, "gpt-oss"), q, k, v, loss


def _block_args():
    g = gen(3)
    return (torch.randn(2, 7, 48, generator=g, requires_grad=True), torch.randn(48, generator=g, requires_grad=True),
            torch.randn(48, 80, generator=g, requires_grad=True), torch.randn(48, 80, generator=g, requires_grad=True),
            *rope_tables(7, 8))


@pytest.mark.parametrize("backend,amp", [("aot_eager", True), pytest.param("inductor", False, marks=pytest.mark.slow)])
def test_compile_fullgraph(backend, amp):
    """fullgraph=True raises on any graph break. The ops are opaque to the compiler, so compiled code
    runs the same kernels on the same matmul outputs: values and gradients equal eager's."""
    torch._dynamo.reset()
    args = _block_args()
    compiled = torch.compile(_block, fullgraph=True, backend=backend)
    results = []
    for fn in (_block, compiled):
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            outs = fn(*args)
        douts = [torch.ones_like(o) for o in outs]
        results.append((outs, torch.autograd.grad(outs, args[:4], douts)))
    (eager, geager), (comp, gcomp) = results
    for a, b in zip(comp + gcomp, eager + geager):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [t.dtype for t in gcomp] == [FP32] * 4 and comp[0].dtype == (BF16 if amp else FP32)
