"""Fused MoE unpermute: the expert outputs, sorted by expert, back to token order and summed by the router's weights.

    out[t] = sum_j weights[t, j] * y[pos[t*K + j]]        y (N, H) sorted rows, N = T*K; weights (T, K); pos (N,)

pos is the inverse of the stable sort that permuted the (token, slot) pairs by expert: pos[s] is the row of y
that holds slot s = t*K + j. Every slot has exactly one row (dropless routing), so the op is a gather.

Why fused. Unfused, y[pos] materialises a (T*K, H) copy, the multiply by the weights a second one (saved by
autograd, with the weights, for their gradients), and the sum over K reads it again; backward scatters through
index_put. Here one program per token reads its K rows once, sums them in fp32 registers and rounds once.

What is saved. y (N, H), weights (T, K) and pos (N,): backward needs y for d(weights) and pos for the scatter.
Saved bytes = N*H*y.element_size() + T*K*weights.element_size() + N*pos.element_size() (the weights as passed:
fp32 from the router, not a cast).

Backward. d(y)[pos[t*K + j]] = weights[t, j] * d(out)[t] and d(weights)[t, j] = <d(out)[t], y[pos[t*K + j]]>: one
program per token writes its K rows of d(y) (each row belongs to one slot: no atomics) and its K weight
gradients. d(y) has y's dtype, d(weights) weights' dtype; the math is fp32.

Dtype rule. out has y's dtype, and each weight is rounded to y's dtype before it multiplies (the MoE contract:
the weights are cast to the activation dtype before the weighted sum). The op takes the router's fp32 weights
and rounds them itself, so d(weights) comes back in their dtype without a rounding to the activation dtype on
the way (the cast's gradient, done outside, would round it): the router's gradient keeps fp32's precision.
Autocast leaves the op alone; y is a grouped GEMM's output, already in the activation dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (check_launchable, cpu_uses_triton, fast_path, jit, launches_triton,
                                           no_autocast, register_autocast_rule, tl, triton)

BLOCK = 1024  # columns per loop step: a row of H is read in chunks of at most this many


# ---- Triton kernels (grid: one program per token) -----------------------------------------------
@jit
def _unpermute_fwd_kernel(Y, POS, W, OUT, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            p = tl.load(POS + t * K + j).to(tl.int64)
            w = tl.load(W + t * K + j).to(OUT.dtype.element_ty).to(tl.float32)  # the weight in y's dtype
            acc += w * tl.load(Y + p * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@jit
def _unpermute_bwd_kernel(DOUT, Y, POS, W, DY, DW, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        w = tl.load(W + t * K + j).to(DY.dtype.element_ty).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = cols < H
            d = tl.load(DOUT + t * H + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + p * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DY + p * H + cols, (w * d).to(DY.dtype.element_ty), mask=mask)
            dot += d * y
        tl.store(DW + t * K + j, tl.sum(dot, axis=0).to(DW.dtype.element_ty))


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ----------------------------
def _block(H: int) -> int:
    return min(BLOCK, triton.next_power_of_2(max(H, 1)))


def unpermute_triton(y: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
    check_launchable(y)
    y, pos, weights = y.contiguous(), pos.contiguous(), weights.contiguous()
    (T, K), H = weights.shape, y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if out.numel():
        _unpermute_fwd_kernel[(T,)](y, pos, weights, out, H, K=K, BLOCK_H=_block(H))
    return out


def unpermute_backward_triton(dout: Tensor, y: Tensor, pos: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    check_launchable(y)
    dout, y, pos, weights = dout.contiguous(), y.contiguous(), pos.contiguous(), weights.contiguous()
    (T, K), H = weights.shape, y.shape[1]
    dy, dw = torch.empty_like(y), torch.empty_like(weights)
    if dy.numel():
        _unpermute_bwd_kernel[(T,)](dout, y, pos, weights, dy, dw, H, K=K, BLOCK_H=_block(H))
    else:
        dw.zero_()
    return dy, dw


# ---- plain-torch references (the CPU implementation) -------------------------------------------
def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def unpermute_reference(y: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
    T, K = weights.shape
    rows = _acc(y.index_select(0, pos)).view(T, K, y.shape[1])  # (T, K, H) in token order (T may be 0)
    return (_acc(weights.to(y.dtype)).unsqueeze(-1) * rows).sum(1).to(y.dtype)


def unpermute_backward_reference(dout: Tensor, y: Tensor, pos: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    T, K = weights.shape
    d = _acc(dout).unsqueeze(1)  # (T, 1, H)
    rows = _acc(y.index_select(0, pos)).view(T, K, y.shape[1])
    dw = (d * rows).sum(-1).to(weights.dtype)  # (T, K)
    dy = torch.empty_like(y).index_copy_(0, pos, (_acc(weights.to(y.dtype)).unsqueeze(-1) * d).view(T * K, y.shape[1]).to(y.dtype))
    return dy, dw


# ---- custom ops ------------------------------------------------------------------------------------
def _check(y: Tensor, pos: Tensor, weights: Tensor) -> None:
    if y.ndim != 2 or weights.ndim != 2 or pos.shape != (weights.numel(),) or y.shape[0] != weights.numel():
        raise ValueError(f"moe_unpermute: y (T*K, H), pos (T*K,), weights (T, K) expected, got y "
                         f"{tuple(y.shape)}, pos {tuple(pos.shape)}, weights {tuple(weights.shape)}")


@torch.library.custom_op("anatomy::moe_unpermute", mutates_args=())
def _unpermute_op(y: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
    _check(y, pos, weights)
    return unpermute_triton(y, pos, weights) if cpu_uses_triton() else unpermute_reference(y, pos, weights)


@_unpermute_op.register_kernel("cuda")
def _(y, pos, weights):
    _check(y, pos, weights)
    return unpermute_triton(y, pos, weights)


@_unpermute_op.register_fake
def _(y, pos, weights):
    _check(y, pos, weights)
    return y.new_empty(weights.shape[0], y.shape[1])


@torch.library.custom_op("anatomy::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(dout: Tensor, y: Tensor, pos: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    if cpu_uses_triton():
        return unpermute_backward_triton(dout, y, pos, weights)
    return unpermute_backward_reference(dout, y, pos, weights)


_unpermute_backward_op.register_kernel("cuda")(unpermute_backward_triton)


@_unpermute_backward_op.register_fake
def _(dout, y, pos, weights):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _setup_context(ctx, inputs, output):
    y, pos, weights = inputs
    ctx.save_for_backward(y, pos, weights)


def _backward(ctx, dout):
    y, pos, weights = ctx.saved_tensors
    dy, dw = _unpermute_backward_op(dout, y, pos, weights)
    return dy, None, dw


_unpermute_op.register_autograd(_backward, setup_context=_setup_context)
register_autocast_rule(_unpermute_op)
register_autocast_rule(_unpermute_backward_op)


class _UnpermuteFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementations and saves, without the
    dispatcher's four Python layers per call."""

    @staticmethod
    def forward(ctx, y, pos, weights):
        _check(y, pos, weights)
        ctx.save_for_backward(y, pos, weights)
        return (unpermute_triton if launches_triton(y) else unpermute_reference)(y, pos, weights)

    @staticmethod
    def backward(ctx, dout):
        y, pos, weights = ctx.saved_tensors
        fn = unpermute_backward_triton if launches_triton(y) else unpermute_backward_reference
        dy, dw = fn(dout, y, pos, weights)
        return dy, None, dw


def moe_unpermute(y: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
    """y (T*K, H) expert outputs sorted by expert, pos (T*K,) int64 the row of each (token, slot), weights (T, K)
    -> (T, H): sum_j weights[t, j] * y[pos[t*K + j]]. Saves y, pos and weights."""
    if fast_path(y, pos, weights):
        with no_autocast(y):
            return _UnpermuteFn.apply(y, pos, weights)
    return _unpermute_op(y, pos, weights)
