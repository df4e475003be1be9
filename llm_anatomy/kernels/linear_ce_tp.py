"""Vocab-parallel fused linear cross-entropy: linear_ce.linear_cross_entropy with the head's (V, H) weight split by
rows over a tensor-parallel group, the (T, V) logits never made, not even as (T, V / tp) on a rank.

Rank r holds W_r, rows [r·V/tp, (r+1)·V/tp) of the weight (ColwiseParallel's Shard(0) of the head), and the whole
(T, H) input x (the head's all-gathered input), and computes, per chunk of C rows (linear_ce_chunks.chunk_rows on its
V / tp columns):
    logits = x_c W_rᵀ              (C, V/tp) in the compute dtype, one buffer for every chunk
    stats                          per row, over the rank's columns: the max m_r, d_r = Σ exp(z - m_r), the target's
                                   logit z_y where the target is one of them (else 0), and Σ z with label smoothing
    all-reduce max   m_r  (C,)     M = max over ranks
    all-reduce sum   d    (C,)     Σ_r d_r · exp(m_r - M); lse = M + log of it
    all-reduce sum   z_y  (C,)     the target's logit (one rank adds it, the others 0)
    all-reduce sum   Σz   (C,)     with label smoothing only
    row loss                       lse - (1 - ε)·z_y - (ε/V)·Σz, 0 where the target is ignore_index
    gradient, in place             (exp(z - lse) - ε/V - (1 - ε)·onehot)·scale over the rank's logits
    grad_x[c] = g W_r              (C, H): the rank's share of d(loss)/d(x), a partial sum over the vocabulary
    grad_w (+)= gᵀ x_c             (V/tp, H): the rank's rows of d(loss)/d(W), complete
The all-reduces are torch's functional collectives over the group, in fp32 (fp64 for fp64 logits): for one chunk the
same three T-element reductions torch's loss_parallel makes for a vocab-sharded baseline head.

Gradients in forward, as in linear_ce (its module docstring): each rank has the chunk's global lse before it writes
the chunk's gradient, so grad_x and grad_w are made in forward and are all autograd keeps; backward scales them by
the incoming gradient, in place. grad_x is a partial sum: the caller hands it back as a Partial gradient
(DTensor.to_local(grad_placements=[Partial()]), distributed/tp_head.py), which DTensor reduce-scatters (sequence
parallel: the backward of the head input's all-gather) or all-reduces. That reduction runs in backward, where
autograd runs the redistribution; the op itself issues no collective in backward.

The row passes: plain torch on CPU (an fp32 working copy of the chunk, as linear_ce.ce_rows_reference), Triton on
CUDA and on CPU under triton_on_cpu (two kernels: the stats in one read of the chunk, the gradient in one read and
one write). Loss and gradients equal linear_cross_entropy's on the whole weight up to the order of the sums
(validations/test_linear_ce_tp.py).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from llm_anatomy.kernel_shapes import LCE_ROW_BLOCK, lce_vocab
from llm_anatomy.kernels._dispatch import check_launchable, cpu_uses_triton, jit, num_warps, tl, triton
from llm_anatomy.kernels.linear_ce import (IGNORE_INDEX, REDUCTIONS, _check, accumulate_grad_weight, call_buffers,
                                           row_stats, scale_, total, valid_count, write_row_grad)


# ---- the row passes (grid: one program per row of a chunk); yl is the target's column on this rank, -1 if none ----
@jit
def _tp_stats_kernel(L, stride_l, YL, M, D, ZY, SZ, V, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    yl = tl.load(YL + row)
    m, d, sz = row_stats(base, V, SMOOTH, BLOCK_V)
    tl.store(M + row, m)
    tl.store(D + row, d)
    zy = tl.load(base + tl.maximum(yl, 0)).to(tl.float32)  # column 0 when the target is elsewhere: in range
    tl.store(ZY + row, tl.where(yl >= 0, zy, 0.0))
    if SMOOTH:
        tl.store(SZ + row, sz)


@jit
def _tp_grad_kernel(L, stride_l, YL, LSE, S, V, eps_v, keep, BLOCK_V: tl.constexpr):
    # logits := (exp(z - lse) - ε/V - (1 - ε)·onehot)·s, s = the row's scale (0 where ignored); yl = -1 matches no
    # column
    row = tl.program_id(0).to(tl.int64)
    write_row_grad(L + row * stride_l, V, tl.load(YL + row), tl.load(LSE + row), tl.load(S + row), eps_v, keep,
                   BLOCK_V)


def _block(V: int) -> int:
    return min(LCE_ROW_BLOCK, triton.next_power_of_2(V))


def stats_outputs(rows: int, smooth: bool, device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The stats kernel's outputs, allocated: m, d, z_y and, with label smoothing, Σz, each (rows,) fp32."""
    out = [torch.empty(rows, dtype=torch.float32, device=device) for _ in range(3 + smooth)]
    return out[0], out[1], out[2], (out[3] if smooth else None)


def stats_triton(lc: Tensor, yl: Tensor, smooth: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(m, d, z_y, Σz or None) of each row of lc (R, V_r), fp32 (R,) each."""
    check_launchable(lc)
    R, V = lc.shape
    m, d, zy, sz = stats_outputs(R, smooth, lc.device)
    if R:
        block = _block(V)
        _tp_stats_kernel[(R,)](lc, lc.stride(0), yl, m, d, zy, sz if smooth else m, V, SMOOTH=smooth, BLOCK_V=block,
                               num_warps=num_warps(block))
    return m, d, zy, sz


def grad_triton(lc: Tensor, yl: Tensor, lse: Tensor, s: Tensor, eps: float, vocab: int) -> None:
    check_launchable(lc)
    R, V = lc.shape
    if R:
        block = _block(V)
        _tp_grad_kernel[(R,)](lc, lc.stride(0), yl, lse, s, V, eps / vocab, 1.0 - eps, BLOCK_V=block,
                              num_warps=num_warps(block))


def _work(lc: Tensor) -> Tensor:
    return lc.to(torch.promote_types(lc.dtype, torch.float32))  # fp32 rows (a copy unless lc is fp32 already)


def stats_reference(lc: Tensor, yl: Tensor, smooth: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The stats kernel in plain torch (CPU)."""
    z = _work(lc)
    m = z.amax(-1)
    e = z - m[:, None]
    d = e.exp_().sum(-1)
    del e
    zy = z.gather(1, yl.clamp(min=0)[:, None])[:, 0].where(yl >= 0, 0.0)
    return m, d, zy, (z.sum(-1) if smooth else None)


def grad_reference(lc: Tensor, yl: Tensor, lse: Tensor, s: Tensor, eps: float, vocab: int) -> None:
    """The gradient kernel in plain torch (CPU)."""
    g = _work(lc) - lse[:, None]  # a new tensor: the logits are read here and written once below
    g.exp_()
    if eps:
        g.sub_(eps / vocab)
    g.scatter_add_(1, yl.clamp(min=0)[:, None], torch.where(yl >= 0, eps - 1.0, 0.0).to(g.dtype)[:, None])
    lc.copy_(g.mul_(s[:, None]))


def _all_reduce(t: Tensor, op: str, group) -> Tensor:
    """torch's functional all-reduce (the op funcol.all_reduce dispatches: a new tensor, the input left as it is),
    waited on at once, without funcol's AsyncCollectiveTensor wrapper, which nothing here would overlap."""
    return funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(t, op, group.group_name))


def _chunk(lc: Tensor, yl: Tensor, valid: Tensor, scale: Tensor, losses: Tensor, eps: float, vocab: int, group,
           stats, grad, grads: bool) -> None:
    """One chunk's rows: losses := the row losses; with grads, lc := d(loss)/d(logits). The (R,) vectors are
    updated in place where they can be, and all are freed on return."""
    m, d, zy, sz = stats(lc, yl, eps != 0)
    big = _all_reduce(m, "max", group)
    lse = _all_reduce(m.sub_(big).exp_().mul_(d), "sum", group)  # Σ_r d_r·exp(m_r - M)
    del m, d
    lse.log_().add_(big)
    del big
    loss = _all_reduce(zy, "sum", group).mul_(eps - 1.0).add_(lse)  # lse - (1 - ε)·z_y
    del zy
    if eps:
        loss.sub_(_all_reduce(sz, "sum", group).mul_(eps / vocab))
        del sz
    losses.copy_(loss.masked_fill_(valid.logical_not(), 0.0))
    del loss
    if grads:
        grad(lc, yl, lse, torch.where(valid, scale, 0.0), eps, vocab)


def _forward(x: Tensor, weight: Tensor, targets: Tensor, start: int, vocab: int, group, ignore_index: int,
             eps: float, reduction: str, chunk: int, grads: bool, align: int = 1, rows=None):
    """(loss, grad_x, grad_w) with grads, else the (T,) fp32 row losses. weight: this rank's (V_r, H) rows, its first
    the vocabulary's row `start`; vocab: V, the whole vocabulary; rows: the (stats, grad) passes, None for the
    device's. Allocation order and sizes: calculator/tensor_parallel.py vocab_parallel_ce_bytes."""
    _check(x, weight, targets, eps, reduction, align)
    T, Vr = x.shape[0], weight.shape[0]
    Vp = lce_vocab(Vr, align)
    if rows is None:
        rows = (stats_triton, grad_triton) if x.is_cuda or cpu_uses_triton() else (stats_reference, grad_reference)
    valid = targets != ignore_index
    # the target's column on this rank, -1 where it is another rank's or ignored (clamped into range, as linear_ce)
    yl = targets.where(valid, 0).clamp_(0, vocab - 1).sub_(start)
    yl.masked_fill_(yl.lt(0).logical_or_(yl.ge(Vr)).logical_or_(valid.logical_not()), -1)
    # then linear_ce's buffers on the rank's rows: (C, V_r') logits are its only vocabulary-wide tensor
    n, scale, w, losses, grad_x, grad_w, C, logits = call_buffers(x, weight, targets, ignore_index, reduction, chunk,
                                                                  align, grads)
    for i, s in enumerate(range(0, T, C)):
        e = min(s + C, T)
        xc, lc = x[s:e], logits[:e - s]
        torch.mm(xc, w.t(), out=lc)
        _chunk(lc[:, :Vr], yl[s:e], valid[s:e], scale, losses[s:e], eps, vocab, group, *rows, grads)
        if grads:
            torch.mm(lc, w, out=grad_x[s:e])
            accumulate_grad_weight(grad_w, lc.t(), xc, i == 0, x.is_cuda)
    if not grads:
        return losses
    return total(losses, n), grad_x, (grad_w if Vp == Vr else grad_w[:Vr])


class _VocabParallelLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, start, vocab, group, ignore_index, eps, reduction, chunk, align):
        loss, grad_x, grad_w = _forward(x, weight, targets, start, vocab, group, ignore_index, eps, reduction, chunk,
                                        True, align)
        ctx.save_for_backward(grad_x, grad_w)  # already d(loss)/d(x) (this rank's share) and d(loss)/d(W_r)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        grad_x, grad_w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: new tensors, so the scaling is itself differentiable
            grad_x, grad_w = grad_x * dloss if need_x else None, grad_w * dloss if need_w else None
        else:  # in place: only autograd holds the buffers; a second backward (retain_graph) fails on their version
            grad_x = scale_(grad_x, dloss) if need_x else None  # counters instead of scaling twice
            grad_w = scale_(grad_w, dloss) if need_w else None
        return grad_x, grad_w, *([None] * 9)


def vocab_parallel_linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, start: int, vocab: int, group,
                                        ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                                        reduction: str = "mean", chunk: int = 0, align: int = 1) -> Tensor:
    """x (..., H) (the whole input, on every rank of `group`), weight (V_r, H) (this rank's rows of the (V, H) head,
    the first of them row `start`), targets (...) -> the fp32 loss of linear_cross_entropy on the whole weight, the
    same on every rank: 0-d for "mean"/"sum", targets' shape for "none" (evaluation). A collective: every rank of
    `group` calls it with its own rows. Gradients: x's is this rank's partial sum (the caller reduces it over the
    group), weight's is its rows' whole gradient. chunk and align: linear_cross_entropy's."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not 0 <= start <= vocab - weight.shape[0]:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: rows [{start}, {start + weight.shape[0]}) are not "
                         f"in a vocabulary of {vocab}")
    x2, t2 = x.reshape(-1, x.shape[-1]), targets.reshape(-1).contiguous()
    ls = float(label_smoothing)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        if reduction == "none":
            raise ValueError("linear_cross_entropy: reduction='none' is for evaluation: run it under torch.no_grad()")
        return _VocabParallelLCE.apply(x2, weight, t2, start, vocab, group, ignore_index, ls, reduction, chunk, align)
    losses = _forward(x2, weight, t2, start, vocab, group, ignore_index, ls, "none", chunk, False, align)
    if reduction == "none":
        return losses.view(targets.shape)
    return total(losses, valid_count(t2, ignore_index) if reduction == "mean" else None)
