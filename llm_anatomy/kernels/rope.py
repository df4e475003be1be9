"""Fused split + RoPE + transpose of one fused QKV projection.

qkv (B, S, (H + 2*KV) * D) -> q (B, H, S, D), k (B, KV, S, D), v (B, KV, S, D), all contiguous,
with rotary embeddings applied to q and k in the Hugging Face "rotate_half" convention:
    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1],
where cos, sin (S, D) are cat(freqs, freqs).cos() / .sin() tables.

Why fused. Unfused, this is a view/split, two rotary applications (each: two muls, a
rotate_half that is slice + neg + cat, an add; with fp32 math also the casts) and the
transposes plus .contiguous() copies that attention kernels want: every step reads and writes a
full q or k. Here one program per (b, s) token reads its qkv row once, rotates in fp32
registers and writes q, k, v straight into their (B, heads, S, D) places.

What is saved. Only the cos and sin tables (2 * S * D elements, independent of batch and heads).
The map is linear in qkv, so backward needs no activation: it applies the transposed rotation
    dx = dy * cos + rotate_half^T(dy * sin),   rotate_half^T([z1, z2]) = [z2, -z1],
(the inverse rotation when the two halves of the tables agree) and writes dqkv back in the
(B, S, (H + 2*KV) * D) layout. No output view keeps qkv alive: q, k, v are fresh tensors.
Saved bytes = S*D*(cos.element_size() + sin.element_size()).

Dtype rule. Math is fp32. q, k, v and dqkv have qkv's dtype; the tables may be fp32 or bf16 and
are never cast. Under autocast, qkv (normally already a bf16 matmul output) is cast to the
autocast dtype; the tables are not.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, autocast_floating, check_launchable, fast_path, jit,
                                       launches_triton, no_autocast, register_autocast_rule, tl, triton)

TILE = 4096  # elements of one (heads x D/2) tile held in registers


# ---- Triton kernels (grid: one program per (b, s) token) ------------------------------------
@jit
def _rope_section(X, Y, x_sh, y_sh, c1, c2, s1, s2, N_HEADS: tl.constexpr, HALF: tl.constexpr,
                  MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # X, Y point at this token's first head; heads are x_sh / y_sh elements apart, D is unit-stride.
    # MODE 0: rotate (forward), 1: transposed rotation (backward), 2: copy (v).
    d = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
        mask = (h < N_HEADS) & (d < HALF)  # (BLOCK_H, BLOCK_HALF)
        x1 = tl.load(X + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + h * x_sh + HALF + d, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        elif MODE == 1:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1
            y2 = x2
        tl.store(Y + h * y_sh + d, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + h * y_sh + HALF + d, y2.to(Y.dtype.element_ty), mask=mask)


@jit
def _table_row(COS, SIN, s, stride_cos, stride_sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # position s's cos and sin halves, (1, BLOCK_HALF) each, in fp32
    d = tl.arange(0, BLOCK_HALF)[None, :]
    m = d < HALF
    c1 = tl.load(COS + s * stride_cos + d, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + s * stride_cos + HALF + d, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + s * stride_sin + d, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + s * stride_sin + HALF + d, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@jit
def _rope_kernel(XQ, XK, XV, YQ, YK, YV, COS, SIN,
                 xq_sb, xq_ss, xq_sh, xk_sb, xk_ss, xk_sh, xv_sb, xv_ss, xv_sh,  # source (b, s, head) strides
                 yq_sb, yq_ss, yq_sh, yk_sb, yk_ss, yk_sh, yv_sb, yv_ss, yv_sh,  # destination strides
                 stride_cos, stride_sin, S,
                 H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, MODE: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Forward: sources are the three column blocks of qkv, destinations q, k, v.
    # Backward (MODE 1): sources dq, dk, dv, destinations the column blocks of dqkv.
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    c1, c2, s1, s2 = _table_row(COS, SIN, s, stride_cos, stride_sin, HALF, BLOCK_HALF)
    _rope_section(XQ + b * xq_sb + s * xq_ss, YQ + b * yq_sb + s * yq_ss, xq_sh, yq_sh, c1, c2, s1, s2,
                  H, HALF, MODE, BLOCK_H, BLOCK_HALF)
    _rope_section(XK + b * xk_sb + s * xk_ss, YK + b * yk_sb + s * yk_ss, xk_sh, yk_sh, c1, c2, s1, s2,
                  KV, HALF, MODE, BLOCK_H, BLOCK_HALF)
    _rope_section(XV + b * xv_sb + s * xv_ss, YV + b * yv_sb + s * yv_ss, xv_sh, yv_sh, c1, c2, s1, s2,
                  KV, HALF, 2, BLOCK_H, BLOCK_HALF)


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ------------------------
def _bsh(t: Tensor, seq_dim: int, head_dim: int) -> tuple[int, int, int]:
    return t.stride(0), t.stride(seq_dim), t.stride(head_dim)


def _launch(src: tuple[Tensor, ...], dst: tuple[Tensor, ...], src_dims, dst_dims, cos, sin, B, S, H, KV, D, inverse):
    if B * S == 0:
        return
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(H, KV)), TILE // block_half))
    strides = [x for t in src for x in _bsh(t, *src_dims)] + [x for t in dst for x in _bsh(t, *dst_dims)]
    _rope_kernel[(B * S,)](*src, *dst, cos, sin, *strides, cos.stride(0), sin.stride(0), S,
                           H=H, KV=KV, HALF=half, MODE=int(inverse), BLOCK_H=block_h, BLOCK_HALF=block_half)


def _tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return (cos if cos.stride(-1) == 1 else cos.contiguous()), (sin if sin.stride(-1) == 1 else sin.contiguous())


def rope_qkv_triton(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    check_launchable(qkv)
    B, S, D = _check(qkv, cos, sin, heads, kv_heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    x = qkv.view(B, S, heads + 2 * kv_heads, D)  # (B, S, H + 2KV, D): strides (b, s, head, 1)
    xq, xk, xv = x.split([heads, kv_heads, kv_heads], dim=2)
    q, k, v = _outputs(qkv, B, S, heads, kv_heads, D)
    _launch((xq, xk, xv), (q, k, v), (1, 2), (2, 1), *_tables(cos, sin), B, S, heads, kv_heads, D, False)
    return q, k, v


def _outputs(qkv: Tensor, B: int, S: int, heads: int, kv_heads: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    """q is laid out (B, S, heads, D) in memory and returned as a (B, heads, S, D) view: SDPA writes its
    output in q's layout, so out.transpose(1, 2).reshape(B, S, H) is then a view, not a copy, and the o
    projection keeps SDPA's saved output instead of a second (B·S, H) tensor. k, v: contiguous."""
    q = qkv.new_empty(B, S, heads, D).transpose(1, 2)
    return q, qkv.new_empty(B, kv_heads, S, D), qkv.new_empty(B, kv_heads, S, D)


def rope_qkv_backward_triton(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    check_launchable(dq)
    B, H, S, D = dq.shape
    KV = dk.shape[1]
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    dqkv = dq.new_empty(B, S, (H + 2 * KV) * D)
    dx = dqkv.view(B, S, H + 2 * KV, D).split([H, KV, KV], dim=2)
    _launch((dq, dk, dv), dx, (2, 1), (1, 2), *_tables(cos, sin), B, S, H, KV, D, True)
    return dqkv


# ---- plain-torch references (the CPU implementation) -----------------------------------------
def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_t(x: Tensor) -> Tensor:  # the transpose of _rotate_half as a linear map
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def rope_qkv_reference(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    B, S, D = _check(qkv, cos, sin, heads, kv_heads)
    acc = torch.promote_types(qkv.dtype, torch.float32)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]  # (S, 1, D) against (B, S, heads, D)
    q, k, v = qkv.reshape(B, S, heads + 2 * kv_heads, D).split([heads, kv_heads, kv_heads], dim=2)
    q, k = ((t.to(acc) * c + _rotate_half(t.to(acc)) * s).to(qkv.dtype) for t in (q, k))
    outs = _outputs(qkv, B, S, heads, kv_heads, D)  # fresh buffers: an op's output never aliases its input
    for o, t in zip(outs, (q, k, v)):
        o.copy_(t.transpose(1, 2))
    return outs


def rope_qkv_backward_reference(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    B, H, S, D = dq.shape
    acc = torch.promote_types(dq.dtype, torch.float32)
    c, s = cos.to(acc), sin.to(acc)  # (S, D) against (B, heads, S, D)
    dq, dk = ((t.to(acc) * c + _rotate_half_t(t.to(acc) * s)).to(dq.dtype) for t in (dq, dk))
    dx = torch.cat([t.transpose(1, 2) for t in (dq, dk, dv.to(dq.dtype))], dim=2)  # (B, S, H + 2KV, D)
    return dx.reshape(B, S, -1).contiguous()


# ---- custom ops --------------------------------------------------------------------------------
def _check(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[int, int, int]:
    if qkv.dim() != 3:
        raise ValueError(f"rope_qkv: qkv must be (B, S, (heads + 2*kv_heads)*head_dim), got {tuple(qkv.shape)}")
    B, S, W = qkv.shape
    n = heads + 2 * kv_heads
    if heads <= 0 or kv_heads <= 0 or W % n or (W // n) % 2:
        raise ValueError(f"rope_qkv: width {W} is not (heads={heads} + 2*kv_heads={kv_heads}) x an even head_dim")
    D = W // n
    if tuple(cos.shape) != (S, D) or tuple(sin.shape) != (S, D):
        raise ValueError(f"rope_qkv: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (S, head_dim) = {(S, D)}")
    return B, S, D


def _forward(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return (rope_qkv_triton if launches_triton(qkv) else rope_qkv_reference)(qkv, cos, sin, heads, kv_heads)


def _backward_impl(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return (rope_qkv_backward_triton if launches_triton(dq) else rope_qkv_backward_reference)(dq, dk, dv, cos, sin)


@torch.library.custom_op("anatomy::rope_qkv", mutates_args=())
def _rope_qkv_op(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(qkv, cos, sin, heads, kv_heads)


_rope_qkv_op.register_kernel("cuda")(_forward)


@_rope_qkv_op.register_fake
def _(qkv, cos, sin, heads, kv_heads):
    B, S, D = _check(qkv, cos, sin, heads, kv_heads)
    return _outputs(qkv, B, S, heads, kv_heads, D)


@torch.library.custom_op("anatomy::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward_op(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _backward_impl(dq, dk, dv, cos, sin)


_rope_qkv_backward_op.register_kernel("cuda")(_backward_impl)


@_rope_qkv_backward_op.register_fake
def _(dq, dk, dv, cos, sin):
    B, H, S, D = dq.shape
    return dq.new_empty(B, S, (H + 2 * dk.shape[1]) * D)


def _setup_context(ctx, inputs, output):
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)  # the map is linear in qkv: no activation is needed


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    # cos/sin are constant tables: no gradient flows to them
    return _rope_qkv_backward_op(dq, dk, dv, cos, sin), None, None, None, None


_rope_qkv_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_rule(dtype, device_type, qkv, cos, sin, heads, kv_heads):
    return autocast_floating(qkv, device_type, dtype), cos, sin, heads, kv_heads


register_autocast_rule(_rope_qkv_op, _autocast_rule)
register_autocast_rule(_rope_qkv_backward_op)


class _RopeQKVFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementations, saves and backward,
    without the dispatcher."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads):
        with no_autocast(qkv):
            out = _forward(qkv, cos, sin, heads, kv_heads)
        _setup_context(ctx, (qkv, cos, sin, heads, kv_heads), out)
        return out

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        with no_autocast(dq):
            return _backward_impl(dq, dk, dv, cos, sin), None, None, None, None


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, S, (heads + 2*kv_heads)*D), cos/sin (S, D) -> q (B, heads, S, D) laid out (B, S, heads, D),
    contiguous k (B, kv_heads, S, D), v (B, kv_heads, S, D); RoPE on q and k. Saves cos and sin only."""
    if fast_path(qkv, cos, sin):
        dt = autocast_dtype(qkv)
        return _RopeQKVFn.apply(*(_autocast_rule(dt, qkv.device.type, qkv, cos, sin, heads, kv_heads) if dt
                                  else (qkv, cos, sin, heads, kv_heads)))
    return _rope_qkv_op(qkv, cos, sin, heads, kv_heads)
