"""The fused ops' eager fast path (llm_anatomy.kernels._dispatch.fast_path) against their custom ops.

Eager calls on plain tensors run a torch.autograd.Function over the implementations the custom ops
call; everything that must see the op (a trace, a dispatch or function mode, a tensor subclass,
meta tensors) goes through ``torch.ops.anatomy.*``. The two paths must agree bit for bit, in the
output, every gradient and what autograd saves, with and without autocast, on the plain-torch
reference and on the Triton kernels (interpreter); and each test checks which path actually ran.
What the fast path buys is host time on the GPU machine: calibrate's host_custom_us.
"""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from llm_anatomy.kernels import rms_norm, rope_qkv, swiglu_packed, triton_on_cpu
from llm_anatomy.kernels._dispatch import fast_path
from validations.kernel_cases import IGNORE_OVERFLOW, PATHS

pytestmark = IGNORE_OVERFLOW


class _Dispatcher(TorchFunctionMode):
    """A mode that changes nothing but is a mode: under it every call takes the custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _case(op: str, device: str = "cpu"):
    """(inputs requiring grad, fn(*inputs) -> outputs) of one op, on a small odd-sized shape."""
    torch.manual_seed(0)
    dev = dict(device=device)
    if op == "rms_norm":
        x, w = torch.randn(3, 5, 48, **dev) * 2, 1 + torch.randn(48, **dev) * 0.1
        return [x.requires_grad_(), w.requires_grad_()], lambda x, w: (rms_norm(x, w, 1e-5),)
    if op == "rope_qkv":
        B, S, nh, nkv, D = 2, 7, 4, 2, 16
        qkv = torch.randn(B, S, (nh + 2 * nkv) * D, **dev)
        ang = torch.arange(S, **dev)[:, None] * torch.rand(D // 2, **dev).repeat(2)[None]
        cos, sin = ang.cos(), ang.sin()
        return [qkv.requires_grad_()], lambda qkv: rope_qkv(qkv, cos, sin, nh, nkv)
    w = (torch.randn(24, 16, **dev) * 0.5).requires_grad_()
    x = torch.randn(2, 5, 16, **dev)
    return [w], lambda w: (swiglu_packed(x @ w.t(), "swiglu"),)  # a non-leaf gate_up: in-place backward


def _run(op: str, path: str, autocast: bool, dispatcher: bool, device: str = "cpu"):
    inputs, fn = _case(op, device)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t
    mode = _Dispatcher() if dispatcher else contextlib.nullcontext()
    amp = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with (triton_on_cpu() if path == "triton" else contextlib.nullcontext()), mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
            outs = fn(*inputs)
        nodes = {type(o.grad_fn).__name__ for o in outs}
        torch.manual_seed(1)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    return [o.detach() for o in outs], [i.grad for i in inputs], saved, nodes


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("op", ["rms_norm", "rope_qkv", "swiglu_packed"])
@pytest.mark.parametrize("path", PATHS + [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fast_path_equals_the_custom_op(path, op, autocast):
    """cuda: the Triton kernels on the GPU, through both paths."""
    dev = "cuda" if path == "cuda" else "cpu"
    fast, slow = _run(op, path, autocast, False, dev), _run(op, path, autocast, True, dev)
    fname = {"rms_norm": "_RMSNormFn", "rope_qkv": "_RopeQKVFn", "swiglu_packed": "_SwiGLUPackedFn"}[op]
    assert all(n.startswith(fname) for n in fast[3]), fast[3]  # the fast path ran ...
    assert not any(n.startswith(fname) for n in slow[3]), slow[3]  # ... and here the custom op did
    for a, b in zip(fast[0] + fast[1], slow[0] + slow[1], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast[2] == slow[2] and fast[2]  # the same saved tensors (shape, dtype), in the same order
    if autocast:  # the autocast rule applied inline: outputs in bf16, as through the Autocast key
        assert all(o.dtype == torch.bfloat16 for o in fast[0])


def test_fast_path_only_for_plain_eager_tensors():
    x = torch.randn(4, 8)
    assert fast_path(x, torch.nn.Parameter(torch.ones(8)))
    assert not fast_path(torch.empty(4, 8, device="meta"))
    with _Dispatcher():
        assert not fast_path(x)
    with FlopCounterMode(display=False):
        assert not fast_path(x)
    with FakeTensorMode() as fm:
        fake = fm.from_tensor(x)
        assert not fast_path(fake)
        assert rms_norm(fake, torch.ones(8)).shape == (4, 8)  # the op's fake implementation
    traced = torch.compile(lambda t: t * (2.0 if fast_path(t) else 3.0), backend="eager", fullgraph=True)
    assert torch.equal(traced(x), x * 3.0)  # a trace takes the custom op


def test_a_dispatch_mode_still_sees_the_ops():
    """A TorchDispatchMode (FakeTensorMode, FlopCounterMode, the liveness walk's) sees anatomy::* in
    forward and backward, as before the fast path; without a mode the same call dispatches none."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    with Spy():
        rms_norm(x, w).sum().backward()
    assert "anatomy.rms_norm.default" in seen and "anatomy.rms_norm_backward.default" in seen, seen
    y = rms_norm(x, w)
    assert type(y.grad_fn).__name__.startswith("_RMSNormFn")
