"""Fused RMSNorm: y = x * rsqrt(mean(x^2) + eps) * weight, one read of x and one write of y.

Why fused. Unfused, RMSNorm is pow, mean, add, rsqrt, mul, mul (and casts): each op writes a
full (M, N) tensor to memory and autograd saves most of them (x, x^2's input, rstd, x*rstd, ...).
Here one program holds a tile of rows (one row from hidden 4096 up) in registers, reduces each in
fp32 and writes y once.

What is saved. Only x (in its input dtype, fp32 for the residual stream under amp) and weight.
rstd (one fp32 per row) is recomputed: backward reads each row of x anyway and the reduction runs
in registers, so recomputing moves no extra bytes, while saving it would keep 4*M bytes alive.
x*rstd (the "normalized" tensor the unfused graph saves) is never materialized.
Saved bytes = M*N*x.element_size() + N*weight.element_size()   (the weight is a parameter).

Dtype rule. Math is fp32 whatever the inputs (fp64 inputs get fp64 math in the plain-torch
reference only; the Triton kernels accumulate in fp32).
  * Outside autocast: y has x's dtype; the weight's dtype (fp32 master or bf16) never changes it.
  * Under autocast: y has the autocast dtype (bf16). Its only consumer is a matmul, which would cast
    it anyway; writing bf16 directly saves that cast kernel and half of y's bytes. x is NOT cast:
    it stays the saved tensor at full precision.
  dx has x's dtype, dweight has weight's dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, check_launchable, fast_path, jit, launches_triton, no_autocast,
                                       num_warps, reduction_programs, register_autocast_rule, rows, tl, triton)

MAX_BLOCK = 65536  # a row lives in one program's registers; hidden sizes of real models are <= 16K


# ---- Triton kernels --------------------------------------------------------------------------
@jit
def _rms_norm_fwd_kernel(X, W, Y, stride_x, stride_y, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalizes BLOCK_M rows as one (BLOCK_M, BLOCK_N) tile. Narrow rows are packed
    # (_fwd_tile): one 1 KB row per program (hidden 512) keeps too few bytes in flight to fill HBM;
    # a tile of several rows gives each program enough.
    rws = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    mask = (rws < M) & (cols < N)
    x = tl.load(X + rws * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]  # (BLOCK_M, 1)
    tl.store(Y + rws * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@jit
def _row_grads(x, dy, w, N, eps):
    # one tile of rows (fp32): dx, and the rows' dweight terms dy * xhat; add_rms_norm's backward shares it
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]  # recomputed: rstd is not saved
    xhat = x * rstd
    g = dy * w  # d loss / d xhat
    # d/dx of xhat = x*rstd(x): rstd * (g - xhat * mean(g * xhat))
    return rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]), dy * xhat


@jit
def _rms_norm_bwd_kernel(DY, X, W, DX, DW, stride_dy, stride_x, stride_dx, M, N, eps, rows_per_program,
                         NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Each program owns `rows_per_program` consecutive rows, walks them BLOCK_M rows at a time
    # (_bwd_tile) and accumulates their share of dweight in fp32 registers; the (programs, N)
    # partials are summed by _sum_partials_kernel. The loop is software-pipelined (NUM_STAGES=3: the
    # next tile's loads are in flight while one is reduced): 3.5-3.7 TB/s on the H200 at hidden >= 2048,
    # 2.6 unpipelined.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):  # fixed trip count; tails masked
        j = i + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1): rows of this program's share
        rws = first + j
        m = (j < rows_per_program) & (rws < M) & (cols < N)
        x = tl.load(X + rws * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + rws * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        dx, dw_rows = _row_grads(x, dy, w, N, eps)
        tl.store(DX + rws * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=m)
        dw += dw_rows
    c1 = tl.arange(0, BLOCK_N)
    tl.store(DW + pid * N + c1, tl.sum(dw, axis=0), mask=c1 < N)


@jit
def _sum_partials_kernel(P, DW, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # dweight = the (R, N) partials summed over R: each program owns BLOCK_N columns and walks the rows
    # in (BLOCK_R, BLOCK_N) tiles. (torch's sum(0) over R >= ~1K rows stages through a new buffer of
    # up to twice the partials, 8 MiB at the seed shapes, in the middle of backward; this allocates
    # nothing.)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rws = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in tl.range(0, R, BLOCK_R):
        m = ((r0 + rws)[:, None] < R) & (cols[None, :] < N)
        acc += tl.load(P + (r0 + rws)[:, None].to(tl.int64) * N + cols[None, :], mask=m, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cols < N)


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ------------------------
def _fwd_tile(block: int) -> tuple[int, int]:
    """(rows per tile, warps) of the forward: 2048-element tiles of narrow rows, one row from 2048 up.
    The best setting of the H200 tuning (docs/history.md; x fp32, y bf16, 16,384 and 65,536 rows):
    at hidden 512, 4 rows and 8 warps reach 4.04 TB/s against 3.75 for one row per program; from
    2048 up, one row (8 warps) is fastest."""
    bm = max(1, 2048 // block)
    return bm, num_warps(bm * block)


def _bwd_tile(block: int) -> tuple[int, int]:
    """(rows per tile, warps) of the backward's row loop (3 pipeline stages), from the same tuning:
    one row and 4 warps up to hidden 4096 (3.54-3.94 TB/s), two rows at 1024 (3.55 and 3.47 TB/s
    at 65,536 and 16,384 rows, against 2.86 for one row at 16,384); num_warps(block) above 4096."""
    bm = 2 if block == 1024 else 1
    return bm, 4 if block <= 4096 else num_warps(block)


def _sum_block(block: int) -> int:
    """Columns per program of the dw partial sum, each program walking all partial rows in 4096-element
    tiles: latency-bound, so the more programs the better (64-column blocks leave 8 programs at hidden
    512). 8-column blocks (16 from hidden 4096) are the fastest of 8-64 on the H200 at 24 of 25 shapes
    of 1,024-16,384 rows of 256-4096, the 25th within 3%: 1.7-8.2 us
    a sum, against 4.2-14.0 us for 16-64-column blocks (docs/history.md)."""
    return 8 if block <= 2048 else 16


def _block(N: int) -> int:
    block = triton.next_power_of_2(N)
    if block > MAX_BLOCK:
        raise ValueError(f"rms_norm: hidden size {N} exceeds the one-block limit {MAX_BLOCK}")
    return block


def backward_programs(device: torch.device, M: int, N: int) -> tuple[int, int]:
    """(programs, rows per program) of the backward's row pass: each program a whole number of rows
    (_dispatch.reduction_programs); one fp32 row of dw partials per program."""
    per = triton.cdiv(M, reduction_programs(device, M, N))
    return triton.cdiv(M, per), per


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    check_launchable(x)
    N = x.shape[-1]
    x2 = rows(x)  # (M, N)
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)  # (M, N)
    M = x2.shape[0]
    if M:
        block = _block(N)
        bm, warps = _fwd_tile(block)
        _rms_norm_fwd_kernel[(triton.cdiv(M, bm),)](x2, weight.contiguous(), y, x2.stride(0), y.stride(0), M, N,
                                                   eps, BLOCK_M=bm, BLOCK_N=block, num_warps=warps)
    return y.view(x.shape)


def rms_norm_backward_triton(dy: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    check_launchable(x)
    N = x.shape[-1]
    x2, dy2 = rows(x), rows(dy)  # (M, N) each
    M = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if M == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    block = _block(N)
    programs, per = backward_programs(x.device, M, N)
    # transient: (programs, N) fp32 partial dweights, at most about 8192 x SMs x 4 B (4.3 MB on an H200)
    dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    bm, warps = _bwd_tile(block)
    _rms_norm_bwd_kernel[(programs,)](dy2, x2, weight.contiguous(), dx, dw_partial, dy2.stride(0), x2.stride(0),
                                      dx.stride(0), M, N, eps, per, NUM_STAGES=3, BLOCK_M=bm, BLOCK_N=block,
                                      num_warps=warps)
    dw = torch.empty(N, dtype=weight.dtype, device=x.device)
    bn = _sum_block(block)
    _sum_partials_kernel[(triton.cdiv(N, bn),)](dw_partial, dw, programs, N, BLOCK_R=4096 // bn, BLOCK_N=bn)
    return dx.view(x.shape), dw


# ---- plain-torch references (the CPU implementation) -----------------------------------------
def _acc(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    acc = _acc(x)
    xf = x.contiguous().to(acc)  # contiguous: torch's reduction order, and so the bits, depend on layout
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xf * rstd * weight.to(acc)).to(out_dtype or x.dtype).contiguous()


def rms_norm_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    acc = _acc(x)
    xf, g0 = x.contiguous().to(acc), dy.contiguous().to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = g0 * weight.to(acc)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (g0 * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype).contiguous(), dw.to(weight.dtype)


# ---- custom ops --------------------------------------------------------------------------------
def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def _forward(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    _check(x, weight)
    return (rms_norm_triton if launches_triton(x) else rms_norm_reference)(x, weight, eps, out_dtype)


def _backward_impl(dy: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return (rms_norm_backward_triton if launches_triton(x) else rms_norm_backward_reference)(dy, x, weight, eps)


@torch.library.custom_op("anatomy::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    return _forward(x, weight, eps, out_dtype)


_rms_norm_op.register_kernel("cuda")(_forward)


@_rms_norm_op.register_fake
def _(x, weight, eps, out_dtype=None):
    _check(x, weight)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.custom_op("anatomy::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _backward_impl(dy, x, weight, eps)


_rms_norm_backward_op.register_kernel("cuda")(_backward_impl)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs[:3]
    ctx.save_for_backward(x, weight)  # x in its own dtype; rstd and x*rstd are recomputed
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, ctx.eps)
    return dx, (dw if ctx.needs_input_grad[1] else None), None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_rule(dtype, device_type, x, weight, eps, out_dtype=None):
    # Only the output dtype changes: x stays full precision (it is what backward reads).
    if out_dtype is None and dtype is not None and x.device.type == device_type and x.dtype is not torch.float64:
        out_dtype = dtype
    return x, weight, eps, out_dtype


register_autocast_rule(_rms_norm_op, _autocast_rule)
register_autocast_rule(_rms_norm_backward_op)


class _RMSNormFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementations, saves and backward,
    without the dispatcher."""

    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        with no_autocast(x):
            y = _forward(x, weight, eps, out_dtype)
        _setup_context(ctx, (x, weight, eps, out_dtype), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with no_autocast(x):
            dx, dw = _backward_impl(dy, x, weight, ctx.eps)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dim. x (..., N), weight (N,) -> y (..., N), contiguous.

    y has x's dtype, or the autocast dtype under autocast. Saves x and weight only."""
    if fast_path(x, weight):
        return _RMSNormFn.apply(*_autocast_rule(autocast_dtype(x), x.device.type, x, weight, eps))
    return _rms_norm_op(x, weight, eps)
