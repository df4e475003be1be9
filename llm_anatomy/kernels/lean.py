"""Matmuls that keep the fp32 weight, not its bf16 cast, for backward; SwiGLU + down that keeps only gate_up.

Why. Under autocast nn.Linear's fp32 weight is cast to bf16 by autocast, which caches the cast for
the region, and the matmul's autograd node saves it: an (out, in) bf16 copy of every weight lives
from forward to backward. `linear` casts the weight itself, outside autocast's cache, multiplies,
and lets the cast go; its node saves the input and the fp32 parameter (resident anyway, so no new
storage), and backward casts the weight again. The cast is deterministic: bitwise the forward's.

`swiglu_down` is h = swiglu(gate_up) followed by down's matmul, in one node that saves gate_up and
down's fp32 weight: not h, the (T, I) activation that down's matmul would keep. Backward computes d(h)
first, then one pass over gate_up (`remake_grad`) makes both what down's weight gradient needs and what
gate_up's needs: h, bitwise the forward's, written over d(h) (each element read before it is written),
and d(gate_up) written over gate_up. Why one pass: making h with the forward kernel and then running the
SwiGLU backward reads gate_up twice; the fused pass moves 12·T·I bytes (bf16) instead of 16·T·I, and
allocates nothing (h lives in d(h)'s storage).

Neither adds a GEMM, and on CPU neither changes a number: every aten call is the one nn.Linear's autograd
makes (mm / addmm forward; dW = dYᵀ X and dX = dY W_c in backward; a bias's gradient the column sum of dY),
on the same operands. On CUDA, under autocast over an fp32 weight, dW is the same GEMM written in fp32
(mm's out_dtype: cuBLAS's fp32 accumulator, not rounded to bf16), handed to the weight directly. Why: nn.Linear's
dW is written in bf16 and then cast to fp32 by the cast's autograd node, a separate pass that reads 2 and writes
4 bytes per weight (1.4 ms per step at llama3.2-1b, predicted); the fp32 output costs the GEMM 2 more bytes per
weight of write and drops the bf16 rounding, so this dW is nearer the fp32 product than nn.Linear's.
The cost of the lean nodes: one more read of the fp32 weight and write of its cast per matmul in backward,
and one more write of (T, I) in the MLP's backward.

Gradient order, kept from nn.Linear on CPU: the weight's bf16 gradient leaves the node as the gradient of
the cast (an autograd ToCopy node made in forward, w.to(bf16)), whose backward makes the fp32
gradient after this node has released what it saved, as nn.Linear's does; the node takes the fp32
weight as a further input only to save it (its gradient there is None). On CUDA (fp32_grad) the cast is
made outside autograd and the node returns the fp32 gradient for the weight itself.

Where a checkpoint re-runs the region (Run.recompute), the efficient model keeps nn.Linear: a
checkpoint's early stop halts a re-run when the last saved tensor is packed, which for an
autograd.Function is after its forward, so the last matmul of the region would run twice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, autocast_floating, fast_path, launches_triton, no_autocast,
                                       register_autocast_rule)
from llm_anatomy.kernels.swiglu import (_eager, _packed_forward, _swiglu_packed_op, packed_grad, swiglu_backward_reference,
                                    swiglu_backward_triton, swiglu_packed, swiglu_reference)


def _off(t: Tensor):
    """Autocast off for t's device type: the forward and backward ops run on explicit dtypes."""
    return torch.autocast(t.device.type, enabled=False)


def _2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def fp32_grad(x: Tensor, weight: Tensor, dt: torch.dtype) -> bool:
    """Is dW written in fp32 by the GEMM itself (CUDA: mm's out_dtype; module docstring)?"""
    return x.device.type == "cuda" and weight.dtype == torch.float32 and dt in (torch.bfloat16, torch.float16)


def _cast(weight: Tensor, dt: torch.dtype, native: bool) -> Tensor:
    """The weight's compute-dtype cast: an autograd ToCopy node, or (native) made outside autograd."""
    if not native:
        return weight.to(dt)
    with torch.no_grad():
        return weight.to(dt)


def _grad_weight(dy2: Tensor, h2: Tensor, native: bool) -> Tensor:
    """dW = dYᵀ H: (out, T) x (T, in), in the compute dtype, or in fp32 straight from the GEMM (native)."""
    return torch.mm(dy2.t(), h2, out_dtype=torch.float32) if native else dy2.t().mm(h2)


class _RecastLinear(torch.autograd.Function):
    """y = x w_cᵀ (+ b_c). Inputs: x (..., in) in the compute dtype, w_c = w.to(compute) (autograd's cast
    node, or made outside autograd when native), w the fp32 parameter (saved; differentiated here only when
    native), b_c the cast bias or None."""

    @staticmethod
    def forward(ctx, x, w_c, w, b_c, native):
        with _off(x):
            y = F.linear(x, w_c, b_c)  # (..., out): mm, or addmm with the bias, as nn.Linear
        ctx.save_for_backward(x, w)  # the input and the fp32 parameter: no (out, in) cast is kept
        ctx.dtype, ctx.bias, ctx.native = w_c.dtype, b_c is not None, native
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = _2d(dy)  # (T, out), a view
        with _off(dy):  # MmBackward's two products on the same operands: dW = dYᵀ X, dX = dY W_c
            dw = _grad_weight(dy2, _2d(x), ctx.native)  # (out, in), before the cast exists
            w_c = w.to(ctx.dtype)  # (out, in): the forward's cast, made again
            dx = dy2.mm(w_c)  # (T, in)
            del w_c
            db = dy2.sum(0, keepdim=True).view(-1) if ctx.bias else None  # addmm's bias gradient, as autograd sums it
        if ctx.native:
            return dx.view(x.shape), None, dw, db, None
        return dx.view(x.shape), dw, None, db, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) with the same numbers; under autocast, with an fp32 weight that needs a
    gradient, the weight's bf16 cast is not kept for backward (module docstring). x: (..., in)."""
    dt = autocast_dtype(x)
    if dt is None or weight.dtype == dt or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    x = autocast_floating(x, x.device.type, dt)
    native = fp32_grad(x, weight, dt)
    with _off(x):  # explicit casts: autocast would cache the weight's for the region
        w_c = _cast(weight, dt, native)
        b_c = bias.to(dt) if bias is not None else None
    return _RecastLinear.apply(x, w_c, weight, b_c, native)


def _swiglu(gate_up: Tensor, variant: str) -> Tensor:
    """The packed SwiGLU forward, through the op unless the fast path holds (as swiglu_packed picks)."""
    if fast_path(gate_up):
        with no_autocast(gate_up):
            return _packed_forward(gate_up, variant)
    return _swiglu_packed_op(gate_up, variant)


def _remake_grad_inplace(dh: Tensor, gate: Tensor, up: Tensor, variant: str) -> None:
    """dh := swiglu(gate, up) (the forward's h), gate := d(gate), up := d(up), from the incoming dh: one
    Triton pass (CUDA, or CPU under triton_on_cpu), else the references (CPU is not the target)."""
    if launches_triton(gate):
        swiglu_backward_triton(dh, gate, up, variant, inplace=True, h_out=dh)
        return
    h = swiglu_reference(gate, up, variant)
    dg, du = swiglu_backward_reference(dh, gate, up, variant)
    dh.copy_(h)
    gate.copy_(dg)
    up.copy_(du)


@torch.library.custom_op("anatomy::swiglu_remake_backward_", mutates_args=("dh", "gate", "up"))
def _remake_grad_op(dh: Tensor, gate: Tensor, up: Tensor, variant: str) -> None:
    """Overwrites dh with h, gate with d(gate) and up with d(up)."""
    _remake_grad_inplace(dh, gate, up, variant)


_remake_grad_op.register_kernel("cuda")(_remake_grad_inplace)
_remake_grad_op.register_fake(lambda dh, gate, up, variant: None)
register_autocast_rule(_remake_grad_op)


def remake_grad(dh: Tensor, gate_up: Tensor, variant: str, inplace: bool) -> tuple[Tensor, Tensor]:
    """(h, d(gate_up)) from d(h) (..., I) and the saved gate_up (..., 2I). inplace (decided in forward, as
    swiglu_packed decides; no graph being made or traced): one pass writes h into dh's storage and d(gate_up)
    into gate_up's. Otherwise h from the forward's op and d(gate_up) from the packed backward, as new tensors."""
    if inplace and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and dh.is_contiguous():
        gate_up = gate_up.detach()  # an alias: the version counter bump stays visible
        gate, up = gate_up.chunk(2, dim=-1)
        if fast_path(dh, gate_up):
            with no_autocast(dh):
                _remake_grad_inplace(dh, gate, up, variant)
            torch.autograd.graph.increment_version(gate_up)  # as the op's mutates_args would
        else:
            _remake_grad_op(dh, gate, up, variant)
        return dh, gate_up  # now h and d(gate_up)
    return _swiglu(gate_up, variant), packed_grad(dh, gate_up, variant, False)


class _SwiGLUDown(torch.autograd.Function):
    """y = swiglu(gate_up) w_cᵀ. Inputs: gate_up (..., 2I) in the compute dtype, w_c the down weight in the
    compute dtype (its cast under autocast, else the parameter), w the parameter, variant, inplace_backward,
    native (dW in fp32 from the GEMM, for w itself: fp32_grad)."""

    @staticmethod
    def forward(ctx, gate_up, w_c, w, variant, inplace_backward, native):
        h = _swiglu(gate_up, variant)  # (..., I): not kept
        with _off(gate_up):
            y = F.linear(h, w_c)  # (..., H)
        ctx.save_for_backward(gate_up, w)  # gate_up: SwiGLU's input; h is made again from it
        ctx.variant, ctx.dtype, ctx.native = variant, w_c.dtype, native
        ctx.inplace = (inplace_backward and not torch.compiler.is_compiling() and _eager(gate_up)
                       and gate_up.grad_fn is not None)  # as swiglu_packed decides
        return y

    @staticmethod
    def backward(ctx, dy):
        gate_up, w = ctx.saved_tensors
        dy2 = _2d(dy)  # (T, H)
        with _off(dy):
            w_c = w.to(ctx.dtype)  # (H, I): the forward's cast, made again
            dh = dy2.mm(w_c)  # (T, I)
            del w_c
        # one pass: h (bitwise the forward's) over d(h), d(gate_up) over gate_up, where that is safe
        h, dgu = remake_grad(dh.view(*gate_up.shape[:-1], -1), gate_up, ctx.variant, ctx.inplace)
        del dh
        with _off(dy):
            dw = _grad_weight(dy2, _2d(h), ctx.native)  # (H, I)
        del h
        if ctx.native:  # the fp32 weight's own gradient
            return dgu, None, dw, None, None, None
        return dgu, dw, None, None, None, None  # dw: the cast's gradient (its ToCopy node makes the fp32 one), or w's


def swiglu_down(gate_up: Tensor, weight: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    """swiglu_packed(gate_up, variant) @ weightᵀ, saving gate_up and the parameter only: h (..., I) is made
    again in backward. gate_up (..., 2I), weight (H, I) -> (..., H)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_down: the last dim ({gate_up.shape[-1]}) must be 2 x intermediate")
    if not torch.is_grad_enabled() or not (gate_up.requires_grad or weight.requires_grad):
        return F.linear(swiglu_packed(gate_up, variant), weight)
    dt = autocast_dtype(gate_up)
    if dt is not None:
        gate_up = autocast_floating(gate_up, gate_up.device.type, dt)
    w_c, native = weight, False
    if dt is not None and weight.dtype != dt:
        native = fp32_grad(gate_up, weight, dt)
        with _off(gate_up):
            w_c = _cast(weight, dt, native)  # explicit: autocast would cache it for the region
    return _SwiGLUDown.apply(gate_up, w_c, weight, variant, inplace_backward, native)

