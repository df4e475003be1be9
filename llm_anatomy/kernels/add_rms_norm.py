"""Fused residual add + RMSNorm: x_new = x + branch, y = rmsnorm(x_new) * weight, in one pass.

Why fused. A block's residual add and the next norm read the same row: unfused, the add reads x
(fp32) and the branch (bf16) and writes x_new (fp32), then the norm reads x_new again and writes y.
In backward autograd adds the residual path's gradient to the norm's (another read of two fp32
tensors and a write), and the add's backward casts that sum to the branch dtype (a read and a
write). Here the forward reads x and branch and writes x_new and y once; the backward reads
d_x_new, d_y and x_new and writes d_x and d_branch once (plus the norm's dw partial-sum scheme).

What is saved. x_new (the residual dtype) and the weight, exactly what the unfused norm saved
(its input x); rstd is recomputed in backward as in rms_norm.py. The add saved nothing.

Numerics. The same fp32 ops in the same order as the unfused pair: x_new = x + branch.to(x.dtype)
(torch's promotion), rounded to x's dtype, then rms_norm's reduction on the rounded x_new. Backward:
the norm's dx rounded to x's dtype, plus d_x_new (autograd's sum of two terms, exact in either
order), rounded to x's dtype; d_branch is that sum cast to the branch dtype. So the CPU reference
is bitwise the unfused model, and the Triton kernels round at the same points.

Dtypes: x_new and d_x have x's dtype; d_branch the branch's; y x's dtype or out_dtype (the autocast
dtype under autocast, as rms_norm); dw the weight's. d_x_new may be absent (None): the last block's
x_new feeds only the final norm.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, check_launchable, fast_path, jit, launches_triton, no_autocast,
                                       register_autocast_rule, rows, tl, triton)
from llm_anatomy.kernels.rms_norm import (_block, _bwd_tile, _fwd_tile, _row_grads, _sum_block, _sum_partials_kernel,
                                      backward_programs, rms_norm_backward_reference, rms_norm_reference)


# ---- Triton kernels --------------------------------------------------------------------------
@jit
def _add_rms_norm_fwd_kernel(X, B, W, XN, Y, stride_x, stride_b, stride_xn, stride_y, M, N, eps,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rms_norm's forward tile, with the add in front: x_new rounded to XN's dtype before the reduction
    rws = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    mask = (rws < M) & (cols < N)
    x = tl.load(X + rws * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
    b = tl.load(B + rws * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    xn = (x + b).to(XN.dtype.element_ty)
    tl.store(XN + rws * stride_xn + cols, xn, mask=mask)
    xn = xn.to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xn * xn, axis=1) / N + eps)[:, None]  # (BLOCK_M, 1)
    tl.store(Y + rws * stride_y + cols, (xn * rstd * w).to(Y.dtype.element_ty), mask=mask)


@jit
def _add_rms_norm_bwd_kernel(DXN, DY, XN, W, DX, DB, DW, stride_dxn, stride_dy, stride_xn, stride_dx, stride_db,
                             M, N, eps, rows_per_program, HAS_DXN: tl.constexpr, ADD_RN: tl.constexpr,
                             NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rms_norm's backward row loop; each row's dx (rounded to DX's dtype, as the unfused norm wrote it)
    # plus d_x_new goes to DX and, cast, to DB: one write each, no separate sum or cast kernel.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, BLOCK_M, num_stages=NUM_STAGES):  # fixed trip count; tails masked
        j = i + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
        rws = first + j
        m = (j < rows_per_program) & (rws < M) & (cols < N)
        x = tl.load(XN + rws * stride_xn + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + rws * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        dx, dw_rows = _row_grads(x, dy, w, N, eps)
        dx = dx.to(DX.dtype.element_ty).to(tl.float32)
        if HAS_DXN:
            dxn = tl.load(DXN + rws * stride_dxn + cols, mask=m, other=0.0).to(tl.float32)
            if ADD_RN:  # PTX add.rn is never contracted with rstd * (...) into an fma, which would skip
                dx = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [dxn, dx],  # dx's rounding
                                               dtype=tl.float32, is_pure=True, pack=1)
            else:
                dx = dxn + dx
        dx = dx.to(DX.dtype.element_ty)
        tl.store(DX + rws * stride_dx + cols, dx, mask=m)
        tl.store(DB + rws * stride_db + cols, dx.to(DB.dtype.element_ty), mask=m)
        dw += dw_rows
    c1 = tl.arange(0, BLOCK_N)
    tl.store(DW + pid * N + c1, tl.sum(dw, axis=0), mask=c1 < N)


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ------------------------
def add_rms_norm_triton(x: Tensor, branch: Tensor, weight: Tensor, eps: float,
                        out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    check_launchable(x)
    N = x.shape[-1]
    x2, b2 = rows(x), rows(branch)  # (M, N) each
    M = x2.shape[0]
    xn = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # (M, N) residual dtype
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)  # (M, N)
    if M:
        block = _block(N)
        bm, warps = _fwd_tile(block)
        _add_rms_norm_fwd_kernel[(triton.cdiv(M, bm),)](x2, b2, weight.contiguous(), xn, y, x2.stride(0), b2.stride(0),
                                                       xn.stride(0), y.stride(0), M, N, eps, BLOCK_M=bm,
                                                       BLOCK_N=block, num_warps=warps)
    return xn.view(x.shape), y.view(x.shape)


def add_rms_norm_backward_triton(dxn: Tensor | None, dy: Tensor, xn: Tensor, weight: Tensor, eps: float,
                                 branch_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    check_launchable(xn)
    N = xn.shape[-1]
    x2, dy2 = rows(xn), rows(dy)  # (M, N) each
    dxn2 = rows(dxn) if dxn is not None else x2  # x2: a placeholder pointer, never read (HAS_DXN=False)
    M = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=xn.dtype, device=xn.device)
    db = torch.empty(x2.shape, dtype=branch_dtype, device=xn.device)
    if M == 0:
        return dx.view(xn.shape), db.view(xn.shape), torch.zeros_like(weight)
    block = _block(N)
    programs, per = backward_programs(xn.device, M, N)
    # transient: (programs, N) fp32 partial dweights, as rms_norm's backward
    dw_partial = torch.empty((programs, N), dtype=torch.float32, device=xn.device)
    bm, warps = _bwd_tile(block)
    _add_rms_norm_bwd_kernel[(programs,)](dxn2, dy2, x2, weight.contiguous(), dx, db, dw_partial, dxn2.stride(0),
                                          dy2.stride(0), x2.stride(0), dx.stride(0), db.stride(0), M, N, eps, per,
                                          HAS_DXN=dxn is not None, ADD_RN=xn.device.type == "cuda", NUM_STAGES=3,
                                          BLOCK_M=bm, BLOCK_N=block,
                                          num_warps=warps)
    dw = torch.empty(N, dtype=weight.dtype, device=xn.device)
    bn = _sum_block(block)
    _sum_partials_kernel[(triton.cdiv(N, bn),)](dw_partial, dw, programs, N, BLOCK_R=4096 // bn, BLOCK_N=bn)
    return dx.view(xn.shape), db.view(xn.shape), dw


# ---- plain-torch references (the CPU implementation): the unfused add and rms_norm's references --------
def add_rms_norm_reference(x: Tensor, branch: Tensor, weight: Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    xn = x + branch.to(x.dtype)  # torch's promotion of x + branch, bit for bit
    return xn, rms_norm_reference(xn, weight, eps, out_dtype)


def add_rms_norm_backward_reference(dxn: Tensor | None, dy: Tensor, xn: Tensor, weight: Tensor, eps: float,
                                    branch_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw = rms_norm_backward_reference(dy, xn, weight, eps)
    if dxn is not None:  # autograd's sum of the residual path's gradient and the norm's, into dx (a new tensor)
        dx = dx.add_(dxn)  # in place, as autograd's input buffer adds: no second (T, H) buffer
    return dx.contiguous(), dx.to(branch_dtype, copy=True).contiguous(), dw  # copy: an op's outputs never alias


# ---- custom ops --------------------------------------------------------------------------------
def _check(x: Tensor, branch: Tensor, weight: Tensor) -> None:
    if branch.shape != x.shape:
        raise ValueError(f"add_rms_norm: branch shape {tuple(branch.shape)} does not match x {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"add_rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def _forward(x: Tensor, branch: Tensor, weight: Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    _check(x, branch, weight)
    return (add_rms_norm_triton if launches_triton(x) else add_rms_norm_reference)(x, branch, weight, eps, out_dtype)


def _backward_impl(dxn: Tensor | None, dy: Tensor, xn: Tensor, weight: Tensor, eps: float,
                   branch_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    impl = add_rms_norm_backward_triton if launches_triton(xn) else add_rms_norm_backward_reference
    return impl(dxn, dy, xn, weight, eps, branch_dtype)


@torch.library.custom_op("anatomy::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, branch: Tensor, weight: Tensor, eps: float,
                     out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    return _forward(x, branch, weight, eps, out_dtype)


_add_rms_norm_op.register_kernel("cuda")(_forward)


@_add_rms_norm_op.register_fake
def _(x, branch, weight, eps, out_dtype=None):
    _check(x, branch, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.custom_op("anatomy::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(dxn: Tensor | None, dy: Tensor, xn: Tensor, weight: Tensor, eps: float,
                              branch_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(dxn, dy, xn, weight, eps, branch_dtype)


_add_rms_norm_backward_op.register_kernel("cuda")(_backward_impl)


@_add_rms_norm_backward_op.register_fake
def _(dxn, dy, xn, weight, eps, branch_dtype):
    return xn.new_empty(xn.shape), xn.new_empty(xn.shape, dtype=branch_dtype), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, branch, weight, eps = inputs[:4]
    ctx.save_for_backward(output[0], weight)  # x_new in the residual dtype; rstd is recomputed
    ctx.eps, ctx.branch_dtype = eps, branch.dtype
    ctx.set_materialize_grads(False)  # an unused x_new (the last block's) sends no zeros through backward


def _grads(ctx, dxn, dy, dx, db, dw):
    return dx, db, (dw if ctx.needs_input_grad[2] else None), None, None


def _backward(ctx, dxn, dy):
    xn, weight = ctx.saved_tensors
    if dy is None:  # y unused: only the residual path's gradient flows
        return dxn, (None if dxn is None else dxn.to(ctx.branch_dtype)), None, None, None
    dx, db, dw = _add_rms_norm_backward_op(dxn, dy, xn, weight, ctx.eps, ctx.branch_dtype)
    return _grads(ctx, dxn, dy, dx, db, dw)


_add_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_rule(dtype, device_type, x, branch, weight, eps, out_dtype=None):
    # rms_norm's rule: only y's dtype changes; x, branch and x_new keep theirs.
    if out_dtype is None and dtype is not None and x.device.type == device_type and x.dtype is not torch.float64:
        out_dtype = dtype
    return x, branch, weight, eps, out_dtype


register_autocast_rule(_add_rms_norm_op, _autocast_rule)
register_autocast_rule(_add_rms_norm_backward_op)


class _AddRMSNormFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementations without the dispatcher."""

    @staticmethod
    def forward(ctx, x, branch, weight, eps, out_dtype):
        with no_autocast(x):
            out = _forward(x, branch, weight, eps, out_dtype)
        _setup_context(ctx, (x, branch, weight, eps, out_dtype), out)
        return out

    @staticmethod
    def backward(ctx, dxn, dy):
        xn, weight = ctx.saved_tensors
        if dy is None:
            return dxn, (None if dxn is None else dxn.to(ctx.branch_dtype)), None, None, None
        with no_autocast(xn):
            dx, db, dw = _backward_impl(dxn, dy, xn, weight, ctx.eps, ctx.branch_dtype)
        return _grads(ctx, dxn, dy, dx, db, dw)


def add_rms_norm(x: Tensor, branch: Tensor, weight: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """x (..., N) residual dtype, branch (..., N), weight (N,) -> (x_new = x + branch in x's dtype,
    y = rmsnorm(x_new) * weight in x's dtype, or the autocast dtype under autocast). Saves x_new and
    the weight only."""
    if fast_path(x, branch, weight):
        return _AddRMSNormFn.apply(*_autocast_rule(autocast_dtype(x), x.device.type, x, branch, weight, eps))
    return _add_rms_norm_op(x, branch, weight, eps)
