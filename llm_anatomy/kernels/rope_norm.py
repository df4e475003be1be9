"""Fused split + per-head q/k RMSNorm + RoPE + transpose of one fused QKV projection (Qwen3's qk-norm).

qkv (B, S, (H + 2*KV) * D), q_weight (D,), k_weight (D,), cos, sin (S, D) -> q (B, H, S, D), k (B, KV, S, D),
v (B, KV, S, D): the layouts and rotation of rope_qkv (kernels/rope.py), with each q and k head normed first,
    n = x * rsqrt(mean(x^2) + eps) * weight   (over the D elements of one head of one token),
q and k sharing one weight per kind (q_weight for every query head, k_weight for every key head).

Why fused: bytes not written or read. Unfused (the rms_norm op on each head view, a cat, then rope_qkv),
forward copies each strided q and k head view into rows, norms the rows into new tensors, concatenates normed
q, k and v into a new (T, (H + 2KV)·D) tensor and only then reads that for RoPE: with Q = H·D, K = KV·D and
W = Q + 2K, 4·T·(Q + K) + 4·T·W elements moved against the fused 2·T·W (Qwen3-8B's 32 + 8 heads of 128:
45,056 against 12,288 elements a token, 3.7x). Backward mirrors it: rope_qkv's d(qkv), row copies of its
q and k columns and of the saved input, the norms' backward, and a cat into the d(qkv) the qkv matmul reads,
4·T·W + 7·T·(Q + K) against the fused T·W + T·(Q + K) read and T·W written (60,416 against 17,408, 3.5x).
Here forward reads qkv once and writes q, k, v once; backward reads dq, dk, dv and qkv's q and k columns once
and writes d(qkv) once, plus a (programs, D) fp32 row of weight-gradient partials per weight, summed by
rms_norm's second kernel. Each head's reduction runs in the registers of the program that rotates it.

What is saved. qkv (the projection's output: its q and k columns are the norms' input; its v columns ride
along in the same storage, as they did unfused), both weights and the cos/sin tables. rstd (one fp32 per
head-row) is recomputed: backward reads each head of x anyway, so recomputing moves no extra bytes, while
saving it would keep 4·T·(H + KV) bytes alive. The normed q and k are never materialised. (The outputs q and
k, which SDPA keeps, are not used instead: recovering x_hat from them divides by the weight and carries the
outputs' rounding.)
Saved bytes = T·(H + 2KV)·D·qkv.element_size() + S·D·(cos + sin element sizes)   (weights are parameters).

Dtype rule. Math is fp32. q, k, v and d(qkv) have qkv's dtype; d(q_weight), d(k_weight) the weights' dtypes.
Under autocast qkv is cast to the autocast dtype (as rope_qkv); the weights and tables are not.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, autocast_floating, check_launchable, fast_path, jit,
                                       launches_triton, no_autocast, register_autocast_rule, tl, triton)
from llm_anatomy.kernels.rms_norm import _acc, _sum_block, _sum_partials_kernel, backward_programs
from llm_anatomy.kernels.rope import (TILE, _bsh, _check, _outputs, _rope_section, _rotate_half, _rotate_half_t,
                                  _table_row, _tables)


# ---- Triton kernels --------------------------------------------------------------------------
@jit
def _norm_rope_section(X, Y, W, x_sh, y_sh, c1, c2, s1, s2, eps, N_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # X, Y point at this token's first head (heads x_sh / y_sh elements apart, D unit-stride): norm, then rotate.
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    w1 = tl.load(W + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + d, mask=dm, other=0.0).to(tl.float32)
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < N_HEADS) & dm
        x1 = tl.load(X + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + h * x_sh + HALF + d, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        n1 = x1 * rstd * w1
        n2 = x2 * rstd * w2
        tl.store(Y + h * y_sh + d, (n1 * c1 - n2 * s1).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + h * y_sh + HALF + d, (n2 * c2 + n1 * s2).to(Y.dtype.element_ty), mask=mask)


@jit
def _rope_norm_kernel(XQ, XK, XV, YQ, YK, YV, WQ, WK, COS, SIN,
                      xq_sb, xq_ss, xq_sh, xk_sb, xk_ss, xk_sh, xv_sb, xv_ss, xv_sh,  # qkv's column blocks
                      yq_sb, yq_ss, yq_sh, yk_sb, yk_ss, yk_sh, yv_sb, yv_ss, yv_sh,  # q, k, v
                      stride_cos, stride_sin, S, eps,
                      H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # grid: one program per (b, s) token
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    c1, c2, s1, s2 = _table_row(COS, SIN, s, stride_cos, stride_sin, HALF, BLOCK_HALF)
    _norm_rope_section(XQ + b * xq_sb + s * xq_ss, YQ + b * yq_sb + s * yq_ss, WQ, xq_sh, yq_sh, c1, c2, s1, s2, eps,
                       H, HALF, BLOCK_H, BLOCK_HALF)
    _norm_rope_section(XK + b * xk_sb + s * xk_ss, YK + b * yk_sb + s * yk_ss, WK, xk_sh, yk_sh, c1, c2, s1, s2, eps,
                       KV, HALF, BLOCK_H, BLOCK_HALF)
    _rope_section(XV + b * xv_sb + s * xv_ss, YV + b * yv_sb + s * yv_ss, xv_sh, yv_sh, c1, c2, s1, s2,
                  KV, HALF, 2, BLOCK_H, BLOCK_HALF)


@jit
def _norm_rope_bwd_section(DY, X, DX, W, dy_sh, x_sh, dx_sh, c1, c2, s1, s2, eps, N_HEADS: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One token's heads: d(x) written, the token's weight-gradient terms (sum over heads of g * x_hat) returned.
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    w1 = tl.load(W + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + d, mask=dm, other=0.0).to(tl.float32)
    dw1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < N_HEADS) & dm
        dy1 = tl.load(DY + h * dy_sh + d, mask=mask, other=0.0).to(tl.float32)
        dy2 = tl.load(DY + h * dy_sh + HALF + d, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(X + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + h * x_sh + HALF + d, mask=mask, other=0.0).to(tl.float32)
        g1 = dy1 * c1 + dy2 * s2  # the transposed rotation: d loss / d n
        g2 = dy2 * c2 - dy1 * s1
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        gw1 = g1 * w1  # d loss / d x_hat
        gw2 = g2 * w2
        mean = ((tl.sum(gw1 * xh1, axis=1) + tl.sum(gw2 * xh2, axis=1)) / (2 * HALF))[:, None]
        tl.store(DX + h * dx_sh + d, (rstd * (gw1 - xh1 * mean)).to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + h * dx_sh + HALF + d, (rstd * (gw2 - xh2 * mean)).to(DX.dtype.element_ty), mask=mask)
        dw1 += tl.sum(g1 * xh1, axis=0)
        dw2 += tl.sum(g2 * xh2, axis=0)
    return dw1, dw2


@jit
def _rope_norm_bwd_kernel(DQ, DK, DV, XQ, XK, DXQ, DXK, DXV, WQ, WK, PQ, PK, COS, SIN,
                          dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,  # dq, dk, dv
                          xq_sb, xq_ss, xq_sh, xk_sb, xk_ss, xk_sh,  # qkv's q and k column blocks
                          gq_sb, gq_ss, gq_sh, gk_sb, gk_ss, gk_sh, gv_sb, gv_ss, gv_sh,  # d(qkv)'s column blocks
                          stride_cos, stride_sin, S, M, per, eps,
                          H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Each program owns `per` consecutive tokens and sums their weight-gradient terms in fp32 registers; it
    # writes one row of partials per weight. The trip count is fixed: past the last token a program redoes
    # token M - 1 (the same values stored again) and adds nothing to its partials.
    pid = tl.program_id(0)
    q1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    q2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    k1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    k2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    for i in tl.range(0, per):
        t = pid.to(tl.int64) * per + i
        keep = (t < M).to(tl.float32)
        t = tl.minimum(t, M - 1)
        b = t // S
        s = t % S
        c1, c2, s1, s2 = _table_row(COS, SIN, s, stride_cos, stride_sin, HALF, BLOCK_HALF)
        a1, a2 = _norm_rope_bwd_section(DQ + b * dq_sb + s * dq_ss, XQ + b * xq_sb + s * xq_ss,
                                        DXQ + b * gq_sb + s * gq_ss, WQ, dq_sh, xq_sh, gq_sh, c1, c2, s1, s2, eps,
                                        H, HALF, BLOCK_H, BLOCK_HALF)
        q1 += a1 * keep
        q2 += a2 * keep
        a1, a2 = _norm_rope_bwd_section(DK + b * dk_sb + s * dk_ss, XK + b * xk_sb + s * xk_ss,
                                        DXK + b * gk_sb + s * gk_ss, WK, dk_sh, xk_sh, gk_sh, c1, c2, s1, s2, eps,
                                        KV, HALF, BLOCK_H, BLOCK_HALF)
        k1 += a1 * keep
        k2 += a2 * keep
        _rope_section(DV + b * dv_sb + s * dv_ss, DXV + b * gv_sb + s * gv_ss, dv_sh, gv_sh, c1, c2, s1, s2,
                      KV, HALF, 2, BLOCK_H, BLOCK_HALF)
    c = tl.arange(0, BLOCK_HALF)
    cm = c < HALF
    row = pid.to(tl.int64) * (2 * HALF)
    tl.store(PQ + row + c, q1, mask=cm)
    tl.store(PQ + row + HALF + c, q2, mask=cm)
    tl.store(PK + row + c, k1, mask=cm)
    tl.store(PK + row + HALF + c, k2, mask=cm)


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ------------------------
# The backward's head block holds ten fp32 tiles live (dy, x, the rotated gradient, x_hat and g, two halves each)
# against the forward's six: a quarter of rope_qkv's tile keeps them in a 4-warp program's registers.
BWD_TILE = TILE // 4


def _blocks(H: int, KV: int, D: int, tile: int = TILE) -> tuple[int, int]:
    """(heads per block, D/2 rounded up to a power of two): a head block of at most `tile` elements per half."""
    block_half = triton.next_power_of_2(D // 2)
    return max(1, min(triton.next_power_of_2(max(H, KV)), tile // block_half)), block_half


def _split(qkv: Tensor, B: int, S: int, H: int, KV: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    return qkv.view(B, S, H + 2 * KV, D).split([H, KV, KV], dim=2)  # (B, S, heads, D) views


def rope_qkv_norm_triton(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, heads: int,
                         kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_launchable(qkv)
    B, S, D = _check_norm(qkv, q_weight, k_weight, cos, sin, heads, kv_heads)
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    src = _split(qkv, B, S, heads, kv_heads, D)
    q, k, v = _outputs(qkv, B, S, heads, kv_heads, D)
    if B * S:
        block_h, block_half = _blocks(heads, kv_heads, D)
        cos, sin = _tables(cos, sin)
        strides = [x for t in src for x in _bsh(t, 1, 2)] + [x for t in (q, k, v) for x in _bsh(t, 2, 1)]
        _rope_norm_kernel[(B * S,)](*src, q, k, v, q_weight.contiguous(), k_weight.contiguous(), cos, sin, *strides,
                                    cos.stride(0), sin.stride(0), S, eps, H=heads, KV=kv_heads, HALF=D // 2,
                                    BLOCK_H=block_h, BLOCK_HALF=block_half)
    return q, k, v


def rope_qkv_norm_backward_triton(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, q_weight: Tensor, k_weight: Tensor,
                                  cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_launchable(dq)
    B, H, S, D = dq.shape
    KV = dk.shape[1]
    dq, dk, dv, qkv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv, qkv))
    dqkv = dq.new_empty(B, S, (H + 2 * KV) * D)
    M = B * S
    if M == 0:
        return dqkv, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    xq, xk, _ = _split(qkv, B, S, H, KV, D)
    dx = _split(dqkv, B, S, H, KV, D)
    programs, per = backward_programs(dq.device, M, 2 * D)  # 2·D fp32 accumulator columns per program
    # transient: a (programs, D) fp32 row of weight-gradient partials per weight
    pq, pk = (torch.empty((programs, D), dtype=torch.float32, device=dq.device) for _ in range(2))
    block_h, block_half = _blocks(H, KV, D, BWD_TILE)
    cos, sin = _tables(cos, sin)
    strides = ([x for t in (dq, dk, dv) for x in _bsh(t, 2, 1)] + [x for t in (xq, xk) for x in _bsh(t, 1, 2)]
               + [x for t in dx for x in _bsh(t, 1, 2)])
    _rope_norm_bwd_kernel[(programs,)](dq, dk, dv, xq, xk, *dx, q_weight.contiguous(), k_weight.contiguous(), pq, pk,
                                       cos, sin, *strides, cos.stride(0), sin.stride(0), S, M, per, eps, H=H, KV=KV,
                                       HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half)
    grads = []
    for p, w in ((pq, q_weight), (pk, k_weight)):
        g = torch.empty(D, dtype=w.dtype, device=dq.device)
        bn = _sum_block(triton.next_power_of_2(D))
        _sum_partials_kernel[(triton.cdiv(D, bn),)](p, g, programs, D, BLOCK_R=4096 // bn, BLOCK_N=bn)
        grads.append(g)
    return dqkv, *grads


# ---- plain-torch references (the CPU implementation) -----------------------------------------
def _xhat(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd, rstd


def rope_qkv_norm_reference(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, heads: int,
                            kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    B, S, D = _check_norm(qkv, q_weight, k_weight, cos, sin, heads, kv_heads)
    acc = _acc(qkv)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]  # (S, 1, D) against (B, S, heads, D)
    q, k, v = _split(qkv.contiguous(), B, S, heads, kv_heads, D)
    q, k = ((_xhat(t.to(acc), eps)[0] * w.to(acc)) for t, w in ((q, q_weight), (k, k_weight)))
    q, k = ((t * c + _rotate_half(t) * s).to(qkv.dtype) for t in (q, k))
    outs = _outputs(qkv, B, S, heads, kv_heads, D)  # fresh buffers: an op's output never aliases its input
    for o, t in zip(outs, (q, k, v)):
        o.copy_(t.transpose(1, 2))
    return outs


def rope_qkv_norm_backward_reference(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, q_weight: Tensor,
                                     k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
                                     ) -> tuple[Tensor, Tensor, Tensor]:
    B, H, S, D = dq.shape
    KV = dk.shape[1]
    acc = _acc(dq)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
    xq, xk, _ = _split(qkv.contiguous(), B, S, H, KV, D)
    out, dws = [], []
    for dy, x, w in ((dq, xq, q_weight), (dk, xk, k_weight)):
        dy = dy.transpose(1, 2).to(acc)  # (B, S, heads, D), as x
        g0 = dy * c + _rotate_half_t(dy * s)  # d loss / d n, n = x_hat * w
        xhat, rstd = _xhat(x.to(acc), eps)
        g = g0 * w.to(acc)
        out.append((rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(dq.dtype))
        dws.append((g0 * xhat).reshape(-1, D).sum(0).to(w.dtype))
    dqkv = torch.cat([*out, dv.transpose(1, 2).to(dq.dtype)], dim=2)  # (B, S, H + 2KV, D)
    return dqkv.reshape(B, S, -1).contiguous(), *dws


# ---- custom ops --------------------------------------------------------------------------------
def _check_norm(qkv, q_weight, k_weight, cos, sin, heads, kv_heads) -> tuple[int, int, int]:
    B, S, D = _check(qkv, cos, sin, heads, kv_heads)
    for n, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (D,):
            raise ValueError(f"rope_qkv_norm: {n} shape {tuple(w.shape)} must be (head_dim,) = {(D,)}")
    return B, S, D


def _forward(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
    impl = rope_qkv_norm_triton if launches_triton(qkv) else rope_qkv_norm_reference
    return impl(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps)


def _backward_impl(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps):
    impl = rope_qkv_norm_backward_triton if launches_triton(dq) else rope_qkv_norm_backward_reference
    return impl(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps)


@torch.library.custom_op("anatomy::rope_qkv_norm", mutates_args=())
def _rope_qkv_norm_op(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, heads: int,
                      kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps)


_rope_qkv_norm_op.register_kernel("cuda")(_forward)


@_rope_qkv_norm_op.register_fake
def _(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
    B, S, D = _check_norm(qkv, q_weight, k_weight, cos, sin, heads, kv_heads)
    return _outputs(qkv, B, S, heads, kv_heads, D)


@torch.library.custom_op("anatomy::rope_qkv_norm_backward", mutates_args=())
def _rope_qkv_norm_backward_op(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, q_weight: Tensor, k_weight: Tensor,
                               cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps)


_rope_qkv_norm_backward_op.register_kernel("cuda")(_backward_impl)


@_rope_qkv_norm_backward_op.register_fake
def _(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps):
    B, H, S, D = dq.shape
    return dq.new_empty(B, S, (H + 2 * dk.shape[1]) * D), q_weight.new_empty(D), k_weight.new_empty(D)


def _setup_context(ctx, inputs, output):
    qkv, q_weight, k_weight, cos, sin, _, _, eps = inputs
    ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin)  # rstd and the normed q, k are recomputed
    ctx.eps = eps


def _grads(ctx, dq, dk, dv, impl):
    qkv, q_weight, k_weight, cos, sin = ctx.saved_tensors
    dqkv, dqw, dkw = impl(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, ctx.eps)
    need = ctx.needs_input_grad
    # cos/sin are constant tables: no gradient flows to them
    return dqkv, (dqw if need[1] else None), (dkw if need[2] else None), None, None, None, None, None


def _backward(ctx, dq, dk, dv):
    return _grads(ctx, dq, dk, dv, _rope_qkv_norm_backward_op)


_rope_qkv_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_rule(dtype, device_type, qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
    return autocast_floating(qkv, device_type, dtype), q_weight, k_weight, cos, sin, heads, kv_heads, eps


register_autocast_rule(_rope_qkv_norm_op, _autocast_rule)
register_autocast_rule(_rope_qkv_norm_backward_op)


class _RopeQKVNormFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementations, saves and backward,
    without the dispatcher."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
        with no_autocast(qkv):
            out = _forward(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps)
        _setup_context(ctx, (qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps), out)
        return out

    @staticmethod
    def backward(ctx, dq, dk, dv):
        with no_autocast(dq):
            return _grads(ctx, dq, dk, dv, _backward_impl)


def rope_qkv_norm(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, heads: int,
                  kv_heads: int, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, S, (heads + 2*kv_heads)*D), q_weight, k_weight (D,), cos/sin (S, D) -> q, k, v as rope_qkv's, with
    each q and k head RMS-normed (its weight) before RoPE. Saves qkv, the weights and the tables."""
    args = (qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps)
    if fast_path(qkv, q_weight, k_weight, cos, sin):
        dt = autocast_dtype(qkv)
        return _RopeQKVNormFn.apply(*(_autocast_rule(dt, qkv.device.type, *args) if dt else args))
    return _rope_qkv_norm_op(*args)
