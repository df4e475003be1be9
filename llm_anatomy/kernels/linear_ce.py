"""Fused linear cross-entropy: loss = CE(x Wᵀ, targets) without the (T, V) logits, gradients in forward.

x (T, H) in the compute dtype, weight (V, H) (fp32 master weights under amp, or the compute dtype),
targets (T,) int64. Reduction "mean" over the targets that are not ignore_index, or "sum"; "none"
(per-row losses) for evaluation. label_smoothing ε as torch's (and Liger's): the target distribution is
(1 - ε)·onehot + ε/V, so the row loss is lse - (1 - ε)·z_y - (ε/V)·Σ z.

Why the gradients are computed in forward. The loss is the last op, so d(loss)/d(logits) =
(softmax - (1 - ε)·onehot - ε/V)·scale (scale = 1/n for the mean, 1 for the sum) is known as soon as
a chunk's logits are. Per chunk of C rows (C from linear_ce_chunks.chunk_rows):
    logits = x_c Wᵀ                 cuBLAS, (C, V) in the compute dtype, one buffer for every chunk
    row kernel                      per row: logsumexp, the row loss, and the gradient written over the
                                    logits in place (Triton, fp32 math: two passes over V in blocks of
                                    LCE_ROW_BLOCK lanes, or one read when the row fits one block)
    grad_x[c] = g W                 (C, H) in x's dtype
    grad_w (+)= gᵀ x_c              (V, H); an fp32 accumulator is written by bf16 x bf16 GEMMs with an
                                    fp32 output (mm/addmm out_dtype on CUDA; the first chunk writes, the
                                    others accumulate), so it never round-trips through bf16; a bf16
                                    weight's grad_w is rounded once per chunk (T / C times, C >= 4096)
What is saved. Only grad_x (T, H) and grad_w (V, H), in x's and the weight's dtypes: backward scales
them by the incoming gradient, in place in eager mode, so it allocates nothing. Neither x, nor the
weight, nor any logits are kept.

No host sync. The count of non-ignored targets stays a device tensor; the row kernel reads the scale
(1 / max(n, 1)) through a pointer; the loss is the per-row losses' sum over max(n, 1), on the device;
backward multiplies by the incoming gradient instead of testing it against 1 on the host: its kernel
reads the gradient on the device and, when it is 1 (a plain loss.backward()), returns without touching
grad_x or grad_w, so the usual backward moves no bytes. All targets ignored:
the loss and both gradients are 0, not NaN. A target outside [0, V) other than ignore_index is the
caller's error: it is clamped into range (checking it would need a sync).

The weight is cast to the compute dtype once per call (a (V, H) transient), never per chunk. With align > 1
the cast writes a (V', H) buffer, V' = V rounded up to a multiple of align, its extra rows zeros: a vocabulary
that is not a multiple of 8 puts every GEMM on the misaligned rates (a third of the aligned ones or less), and
the pad columns' logits are exact zeros that the row kernel never reads, so every output is unchanged. Every
byte the call allocates, and the chunk rule's derivation: llm_anatomy/kernel_shapes.py (no torch, so the
calculator can count the same bytes).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry, register_flop_formula

from llm_anatomy.kernels._dispatch import (autocast_floating, check_launchable, cpu_uses_triton, jit, launches_triton,
                                       num_warps, register_autocast_rule, tl, triton)
from llm_anatomy.kernel_shapes import LCE_ROW_BLOCK, lce_vocab
from llm_anatomy.kernels.linear_ce_chunks import chunk_rows

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")


# ---- the row kernel (grid: one program per row of a chunk) -----------------------------------
@jit
def row_stats(base, V, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr):
    """A row's max m, sum of exp(z - m) and (SMOOTH) sum of z over its V logits at base, online over blocks of
    BLOCK_V lanes, the tail masked. Inlined into the kernels that call it (here and linear_ce_tp.py)."""
    cols0 = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    sz = 0.0
    for off in tl.range(0, V, BLOCK_V):  # trip count from a scalar argument
        cols = off + cols0
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        if SMOOTH:
            sz += tl.sum(tl.where(mask, z, 0.0), 0)
        m = m_new
    return m, d, sz


@jit
def write_row_grad(base, V, y, lse, s, eps_v, keep, BLOCK_V: tl.constexpr):
    """The row's logits at base := (exp(z - lse) - eps_v - keep·[column == y])·s, in blocks of BLOCK_V lanes
    (eps_v = ε/V, keep = 1 - ε; s the row's gradient scale, 0 where its target is ignored)."""
    cols0 = tl.arange(0, BLOCK_V)
    for off in tl.range(0, V, BLOCK_V):
        cols = off + cols0
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - eps_v
        g = tl.where(cols == y, g - keep, g) * s
        tl.store(base + cols, g.to(base.dtype.element_ty), mask=mask)


@jit
def _ce_rows_kernel(L, stride_l, TGT, LOSS, SCALE, V, ignore_index, smoothing,
                    WRITE_GRAD: tl.constexpr, SMOOTH: tl.constexpr, SINGLE: tl.constexpr, BLOCK_V: tl.constexpr):
    # SINGLE (V <= BLOCK_V): the row stays in registers between the passes, so it is read once, not twice
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    y = tl.load(TGT + row)
    valid = y != ignore_index
    y = tl.minimum(tl.maximum(tl.where(valid, y, 0), 0), V - 1)  # in range, so the loads below are safe
    cols0 = tl.arange(0, BLOCK_V)
    # pass 1: max m and sum of exp(z - m) (online over blocks); Σz for the smoothing term
    if SINGLE:
        zr = tl.load(base + cols0, mask=cols0 < V, other=float("-inf")).to(tl.float32)
        m = tl.max(zr, 0)
        d = tl.sum(tl.exp(zr - m), 0)
        if SMOOTH:
            sz = tl.sum(tl.where(cols0 < V, zr, 0.0), 0)
    else:
        m, d, sz = row_stats(base, V, SMOOTH, BLOCK_V)
    lse = m + tl.log(d)
    loss = lse - (1.0 - smoothing) * tl.load(base + y).to(tl.float32)
    if SMOOTH:
        loss -= smoothing / V * sz
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        # pass 2: (softmax - (1 - ε)·onehot - ε/V)·scale over the logits; ignored rows get zeros
        s = tl.where(valid, tl.load(SCALE), 0.0)
        if SINGLE:
            g = tl.exp(zr - lse) - smoothing / V
            g = tl.where(cols0 == y, g - (1.0 - smoothing), g) * s
            tl.store(base + cols0, g.to(L.dtype.element_ty), mask=cols0 < V)
        else:
            write_row_grad(base, V, y, lse, s, smoothing / V, 1.0 - smoothing, BLOCK_V)


def ce_rows_triton(logits: Tensor, targets: Tensor, losses: Tensor, scale: Tensor, ignore_index: int = IGNORE_INDEX,
                   label_smoothing: float = 0.0, write_grad: bool = True, block: int | None = None) -> None:
    """logits (R, V), unit column stride: losses[r] := row r's loss (0 where ignored); with write_grad,
    logits := d(loss)/d(logits) in place. scale: a 0-d fp32 tensor (read on the device)."""
    check_launchable(logits)
    R, V = logits.shape
    if R == 0:
        return
    block = block or min(LCE_ROW_BLOCK, triton.next_power_of_2(V))  # why this width: kernel_shapes
    _ce_rows_kernel[(R,)](logits, logits.stride(0), targets, losses, scale, V, ignore_index, float(label_smoothing),
                          WRITE_GRAD=write_grad, SMOOTH=label_smoothing != 0, SINGLE=V <= block, BLOCK_V=block,
                          num_warps=num_warps(block))


def ce_rows_reference(logits: Tensor, targets: Tensor, losses: Tensor, scale: Tensor, ignore_index: int = IGNORE_INDEX,
                      label_smoothing: float = 0.0, write_grad: bool = True) -> None:
    """The row kernel in plain torch (fp32 copies of the chunk: CPU only)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (R, V), fp32 copies (fp64 stays fp64)
    V, eps = z.shape[1], label_smoothing
    valid = targets != ignore_index
    y = targets.where(valid, 0).clamp(0, V - 1)[:, None]  # (R, 1)
    lse = z.logsumexp(-1)  # (R,)
    loss = lse - (1.0 - eps) * z.gather(1, y)[:, 0]
    if eps:
        loss = loss - eps / V * z.sum(-1)
    losses.copy_(loss.where(valid, 0.0))
    if write_grad:
        g = torch.exp(z - lse[:, None]) - eps / V
        g.scatter_add_(1, y, torch.full_like(lse[:, None], -(1.0 - eps)))
        logits.copy_(g * torch.where(valid, scale, 0.0)[:, None])


# ---- backward: the saved gradients times the incoming one, in place ------------------------------
@jit
def _scale_kernel(X, S, N, BLOCK: tl.constexpr):
    # x := x * s (s cast to x's dtype first, as torch's mul_ by a 0-d CUDA tensor does); s == 1, what a plain
    # loss.backward() sends, leaves x as it is: the program reads s and returns, moving no other byte
    s = tl.load(S).to(X.dtype.element_ty).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + offs, mask=m).to(tl.float32)
        tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=m)


SCALE_BLOCK = 4096  # elements per program of _scale_kernel


def scale_(t: Tensor, s: Tensor) -> Tensor:
    """t *= s in place, s a 0-d tensor on t's device, never read by the host: the Triton kernel (CUDA, or CPU
    under triton_on_cpu) skips the pass when s is 1; elsewhere torch's mul_. Returns t."""
    if not (launches_triton(t) and t.is_contiguous() and s.numel() == 1):
        return t.mul_(s)
    check_launchable(t)
    if t.numel():
        _scale_kernel[(triton.cdiv(t.numel(), SCALE_BLOCK),)](t, s, t.numel(), BLOCK=SCALE_BLOCK, num_warps=8)
    return t


# ---- the chunk loop (shared by the CPU reference and the CUDA path) -------------------------------
def accumulate_grad_weight(grad_w: Tensor, gt: Tensor, xc: Tensor, first: bool, native: bool) -> None:
    """grad_w (V, H) := or += gt (V, C) @ xc (C, H). native: mm/addmm with an fp32 out_dtype (CUDA only in
    torch) for a low-precision product into an fp32 accumulator; otherwise the product is upcast."""
    if gt.dtype == grad_w.dtype:
        torch.mm(gt, xc, out=grad_w) if first else grad_w.addmm_(gt, xc)
    elif native and grad_w.dtype == torch.float32 and gt.dtype in (torch.bfloat16, torch.float16):
        if first:
            torch.mm(gt, xc, out_dtype=torch.float32, out=grad_w)
        else:
            torch.addmm(grad_w, gt, xc, out_dtype=torch.float32, out=grad_w)
    else:
        acc = torch.promote_types(gt.dtype, grad_w.dtype)
        prod = torch.mm(gt.to(acc), xc.to(acc))  # CPU: exact products of the bf16 values, fp32 sums
        grad_w.copy_(prod) if first else grad_w.add_(prod)


def valid_count(targets: Tensor, ignore_index: int) -> Tensor:
    """max(n, 1) as a 0-d fp32 device tensor, n = the count of targets that are not ignore_index."""
    return (targets != ignore_index).sum().clamp(min=1).to(torch.float32)


def total(losses: Tensor, n: Tensor | None = None) -> Tensor:
    """The fp32 loss: the row losses summed in fp64 (as torch's CPU nll_loss accumulates; T values, so the
    cost is nil) and divided by n where given: the sum of T fp32 values would otherwise lose ~log2(T) bits."""
    s = losses.sum(dtype=torch.float64)
    return (s if n is None else s / n).to(torch.float32)


def _check(x: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float, reduction: str, align: int = 1) -> None:
    if align < 1:
        raise ValueError(f"linear_cross_entropy: align must be a positive number of rows, got {align}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or targets.shape != x.shape[:1]:
        raise ValueError(f"linear_cross_entropy: want x (T, H), weight (V, H), targets (T,); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, targets {tuple(targets.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")


def _weight(weight: Tensor, dtype: torch.dtype, align: int) -> Tensor:
    """The weight the GEMMs read: (V', H) in the compute dtype, V' = lce_vocab(V, align). The call's one cast;
    a padded vocabulary's extra rows are zeros, so their logits are exact zeros and add nothing to grad_x."""
    V, H = weight.shape
    Vp = lce_vocab(V, align)
    if Vp == V:
        return weight if weight.dtype == dtype else weight.to(dtype)
    w = torch.empty((Vp, H), dtype=dtype, device=weight.device)
    w[:V].copy_(weight)
    w[V:].zero_()
    return w


def call_buffers(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, reduction: str, chunk: int,
                 align: int = 1, grads: bool = True) -> tuple:
    """What a training call allocates before its chunk loop, in the byte table's order (kernel_shapes): n = max(count
    of valid targets, 1) for the mean (1 for the sum) and scale = 1 / n, 0-d fp32 on the device (the row kernel
    reads the scale through a pointer); the weight in the compute dtype (V', H); the (T,) fp32 row losses; with
    grads, grad_x (T, H) and grad_w (V', H), else None; the rows per chunk C and the (C, V') logits buffer, the only
    vocabulary-wide tensor. Returns (n, scale, w, losses, grad_x, grad_w, C, logits)."""
    T, H = x.shape
    Vp, dev = lce_vocab(weight.shape[0], align), x.device
    n = valid_count(targets, ignore_index) if reduction == "mean" else torch.ones((), dtype=torch.float32, device=dev)
    scale = n.reciprocal()
    w = _weight(weight, x.dtype, align)
    losses = torch.empty(T, dtype=torch.float32, device=dev)
    grad_x = torch.empty((T, H), dtype=x.dtype, device=dev) if grads else None
    grad_w = (torch.empty if T else torch.zeros)((Vp, H), dtype=weight.dtype, device=dev) if grads else None
    C = chunk or chunk_rows(T, H, Vp, x.element_size())
    logits = torch.empty((min(C, T), Vp), dtype=x.dtype, device=dev)
    return n, scale, w, losses, grad_x, grad_w, C, logits


def _forward(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float, reduction: str,
             chunk: int, rows_fn, native: bool, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, grad_x, grad_w). rows_fn: the row kernel (ce_rows_triton or ce_rows_reference); native: the
    CUDA grad_w accumulation (accumulate_grad_weight); align: the GEMMs' vocabulary is a multiple of it
    (kernel_shapes.lce_vocab; grad_w is then the first V rows of the padded accumulator). Allocation order
    and sizes: linear_ce_chunks."""
    _check(x, weight, targets, label_smoothing, reduction, align)
    T, V, Vp = x.shape[0], weight.shape[0], lce_vocab(weight.shape[0], align)
    n, scale, w, losses, grad_x, grad_w, C, logits = call_buffers(x, weight, targets, ignore_index, reduction, chunk,
                                                                  align)
    for i, s in enumerate(range(0, T, C)):
        e = min(s + C, T)
        xc, lc = x[s:e], logits[:e - s]
        torch.mm(xc, w.t(), out=lc)
        # lc[:, :V] := d loss/d logits; the pad columns stay the zeros the GEMM wrote
        rows_fn(lc[:, :V], targets[s:e], losses[s:e], scale, ignore_index, label_smoothing, True)
        torch.mm(lc, w, out=grad_x[s:e])
        accumulate_grad_weight(grad_w, lc.t(), xc, i == 0, native)
    # unpadded, grad_w is the buffer itself, never a view of it: a view (even of all its rows) keeps the whole
    # accumulator alive past the point the byte table frees it, at the backward's peak (docs/history.md has the
    # measurement). Padded, it is a view of the first V rows (docs/peers.md)
    return total(losses, n), grad_x, (grad_w if Vp == V else grad_w[:V])


def _rows_forward(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float, chunk: int,
                  rows_fn, align: int = 1) -> Tensor:
    """(T,) fp32 row losses (0 where ignored), no gradients: evaluation."""
    _check(x, weight, targets, label_smoothing, "none", align)
    T, H = x.shape
    V, dev = weight.shape[0], x.device
    Vp = lce_vocab(V, align)
    w = _weight(weight, x.dtype, align)
    losses = torch.empty(T, dtype=torch.float32, device=dev)
    C = chunk or chunk_rows(T, H, Vp, x.element_size())
    logits = torch.empty((min(C, T), Vp), dtype=x.dtype, device=dev)
    for s in range(0, T, C):
        e = min(s + C, T)
        torch.mm(x[s:e], w.t(), out=logits[:e - s])
        rows_fn(logits[:e - s, :V], targets[s:e], losses[s:e], losses, ignore_index, label_smoothing, False)  # no scale
    return losses


# ---- custom ops ----------------------------------------------------------------------------------
def _cpu_rows():
    return ce_rows_triton if cpu_uses_triton() else ce_rows_reference


@torch.library.custom_op("anatomy::linear_cross_entropy", mutates_args=())
def _lce_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
            reduction: str = "mean", chunk: int = 0, inplace_backward: bool = True,
            align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(x, weight, targets, ignore_index, label_smoothing, reduction, chunk, _cpu_rows(), False, align)


@_lce_op.register_kernel("cuda")
def _(x, weight, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.0, reduction="mean", chunk=0,
      inplace_backward=True, align=1):
    return _forward(x, weight, targets, ignore_index, label_smoothing, reduction, chunk, ce_rows_triton, True, align)


@_lce_op.register_fake
def _(x, weight, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.0, reduction="mean", chunk=0,
      inplace_backward=True, align=1):
    _check(x, weight, targets, label_smoothing, reduction, align)
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    _, grad_x, grad_w = output
    ctx.mark_non_differentiable(grad_x, grad_w)
    ctx.set_materialize_grads(False)  # grad_x/grad_w get no gradient: no zero (V, H) tensor is made for them
    ctx.save_for_backward(grad_x, grad_w)  # everything backward needs, already multiplied by d(loss)/d(logits)
    # In place: the buffers are this op's own outputs, which the public function drops, so only autograd holds
    # them; a second backward (retain_graph) fails on their version counters instead of scaling twice.
    ctx.inplace = (inputs[7] and not torch.compiler.is_compiling() and type(grad_x) is torch.Tensor
                   and grad_x.device.type != "meta")


def _backward(ctx, dloss, _dgrad_x, _dgrad_w):
    grad_x, grad_w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    if dloss is None:
        need_x = need_w = False
    elif ctx.inplace and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        grad_x, grad_w = scale_(grad_x, dloss) if need_x else None, scale_(grad_w, dloss) if need_w else None
    else:
        grad_x, grad_w = grad_x * dloss if need_x else None, grad_w * dloss if need_w else None
    return (grad_x if need_x else None), (grad_w if need_w else None), None, None, None, None, None, None, None


_lce_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("anatomy::linear_cross_entropy_rows", mutates_args=())
def _rows_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX,
             label_smoothing: float = 0.0, chunk: int = 0, align: int = 1) -> Tensor:
    return _rows_forward(x, weight, targets, ignore_index, label_smoothing, chunk, _cpu_rows(), align)


@_rows_op.register_kernel("cuda")
def _(x, weight, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.0, chunk=0, align=1):
    return _rows_forward(x, weight, targets, ignore_index, label_smoothing, chunk, ce_rows_triton, align)


@_rows_op.register_fake
def _(x, weight, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.0, chunk=0, align=1):
    _check(x, weight, targets, label_smoothing, "none", align)
    return x.new_empty(x.shape[:1], dtype=torch.float32)


def _autocast_rule(dtype, device_type, x, weight, *rest):
    # x to the autocast dtype; the weight stays as it is (fp32 master): the op casts it once itself
    return (autocast_floating(x, device_type, dtype), weight, *rest)


register_autocast_rule(_lce_op, _autocast_rule)
register_autocast_rule(_rows_op, _autocast_rule)


# FLOPs for torch's FlopCounterMode (the counter convention), which sees the op and not the GEMMs inside:
# training runs all three matmuls in forward (logits, grad_x, grad_w: 3 x 2·T·H·V) and none in backward,
# which only scales; evaluation runs the logits matmul alone.
def _gemm_flops(matmuls: int):
    def formula(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        return matmuls * 2 * x_shape[0] * x_shape[1] * w_shape[0]
    return formula


for _op, _n in ((torch.ops.anatomy.linear_cross_entropy, 3), (torch.ops.anatomy.linear_cross_entropy_rows, 1)):
    if _op not in flop_registry:
        register_flop_formula(_op)(_gemm_flops(_n))


def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX,
                         label_smoothing: float = 0.0, reduction: str = "mean", chunk: int = 0,
                         inplace_backward: bool = True, align: int = 1) -> Tensor:
    """x (..., H), weight (V, H), targets (...) -> fp32 loss: 0-d for "mean"/"sum", targets' shape for "none".

    With a gradient to compute ("mean"/"sum" only), the gradients are made in forward and saved
    (module docstring); otherwise only the row losses are computed. chunk: rows per chunk, 0 for the
    rule (linear_ce_chunks.chunk_rows). inplace_backward=False keeps the saved gradients unscaled, for
    retain_graph. align: the GEMMs run over the vocabulary padded to a multiple of it (kernel_shapes.lce_vocab;
    8 takes a vocabulary that is not a multiple of 8 off the misaligned GEMM rates); 1 pads nothing."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    x2, t2 = x.reshape(-1, x.shape[-1]), targets.reshape(-1).contiguous()  # (T, H), (T,)
    ls = float(label_smoothing)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        if reduction == "none":
            raise ValueError("linear_cross_entropy: reduction='none' is for evaluation: run it under torch.no_grad()")
        return _lce_op(x2, weight, t2, ignore_index, ls, reduction, chunk, inplace_backward, align)[0]
    losses = _rows_op(x2, weight, t2, ignore_index, ls, chunk, align)
    if reduction == "none":
        return losses.view(targets.shape)
    return total(losses, valid_count(t2, ignore_index) if reduction == "mean" else None)
