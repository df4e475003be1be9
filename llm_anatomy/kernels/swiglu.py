"""Fused SwiGLU activation: h = act(gate) * up, one read of gate and up and one write of h.

variant "swiglu":  h = silu(gate) * up
variant "gpt-oss": h = (clamp(up, -7, 7) + 1) * silu(clamp(gate, max=7))
(gpt-oss's released code scales the sigmoid's argument by alpha=1.702; this project's "gpt-oss"
MLP, as ModelConfig documents it, is the clamped, shifted form above with a plain silu.)

Why fused. Unfused, silu(gate) * up saves gate (for silu), silu(gate) and up (for the mul):
three (M, I) tensors. The gpt-oss form adds a saved input for each clamp and an output for the
+1: up to five. The kernel computes everything in fp32 registers and rounds h once.

What is saved. Only gate and up, in their own dtypes: backward recomputes sigmoid, silu and the
clamp masks from them (a few FLOPs per element against reading two extra tensors).
Saved bytes = M*I*(gate.element_size() + up.element_size()).

In-place backward. dgate and dup have exactly gate's and up's shapes and dtypes, and each element
of them depends only on the same element of (dh, gate, up). So backward may overwrite the saved
gate and up with dgate and dup and return those buffers: no new (M, I) allocations at the peak of
backward. It does so only when it is safe:
  * gate and up are non-leaf tensors (activations autograd produced, not a user's data), do not
    share any memory location (the two column halves of one fused gate_up projection are fine),
    and the caller did not pass inplace_backward=False;
  * grad mode is off (no create_graph) and we are not being traced by torch.compile (there
    AOTAutograd functionalizes the mutation into a copy and Inductor reuses buffers itself).
The mutation bumps the tensors' version counters, so any other autograd node that saved gate or
up (or a second backward under retain_graph=True) fails loudly with autograd's "modified by an
inplace operation" error instead of reading gradients as activations. Pass inplace_backward=False
when you need retain_graph. After backward, the caller's references to gate/up hold gradients.

Dtype rule. Math is fp32. h has promote(gate, up)'s dtype; under autocast, gate and up are first
cast to the autocast dtype (they come from autocast matmuls, so this is normally a no-op, and
casting keeps the saved tensors in bf16). dgate/dup have gate's/up's dtypes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from llm_anatomy.kernels._dispatch import (autocast_dtype, autocast_floating, check_launchable, cpu_uses_triton,
                                       fast_path, jit, launches_triton, no_autocast, register_autocast_rule, rows, tl,
                                       triton)

VARIANTS = ("swiglu", "gpt-oss")
LIMIT = 7.0  # gpt-oss clamp
BLOCK = 1024  # columns per program: elementwise, so any power of two that fills a warp works


# ---- Triton kernels (grid: rows x column blocks) ---------------------------------------------
@jit
def _gpt_oss_clamps(g, u):
    # (clamp(gate, max=7), clamp(up, -7, 7) + 1). NaN in, NaN out, as torch.clamp: the hardware
    # min/max would return the bound instead.
    u = tl.minimum(tl.maximum(u, -7.0, propagate_nan=tl.PropagateNan.ALL), 7.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(g, 7.0, propagate_nan=tl.PropagateNan.ALL), u + 1.0


@jit
def _swiglu_fwd_kernel(G, U, H, stride_g, stride_u, stride_h, I, GPT_OSS: tl.constexpr, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if GPT_OSS:
        g, u = _gpt_oss_clamps(g, u)
    h = g * tl.sigmoid(g) * u
    tl.store(H + row * stride_h + cols, h.to(H.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(DH, G, U, DG, DU, H, stride_dh, stride_g, stride_u, stride_dg, stride_du, stride_h, I,
                       GPT_OSS: tl.constexpr, REMAKE: tl.constexpr, BLOCK_I: tl.constexpr):
    # DG/DU may be G/U themselves (in-place backward), H may be DH (REMAKE: h written over d(h)): every
    # element is loaded before it is stored.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if GPT_OSS:
        # torch's clamp_backward: the gradient passes where min <= x <= max (inclusive)
        g_pass = g <= 7.0
        u_pass = (u >= -7.0) & (u <= 7.0)
        g, u = _gpt_oss_clamps(g, u)
    s = tl.sigmoid(g)
    silu = g * s
    dg = dh * u * s * (1.0 + g * (1.0 - s))  # d silu/dg = s * (1 + g * (1 - s))
    du = dh * silu
    if GPT_OSS:
        dg = tl.where(g_pass, dg, 0.0)
        du = tl.where(u_pass, du, 0.0)
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)
    if REMAKE:  # the forward's h, bitwise: (g * sigmoid(g)) * u on the same fp32 values
        tl.store(H + row * stride_h + cols, (silu * u).to(H.dtype.element_ty), mask=mask)


# ---- launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) ------------------------
def _grid(M: int, I: int) -> tuple[tuple[int, int], int]:
    block = min(BLOCK, triton.next_power_of_2(I))
    return (M, triton.cdiv(I, block)), block


def swiglu_triton(gate: Tensor, up: Tensor, variant: str = "swiglu") -> Tensor:
    check_launchable(gate)
    g2, u2 = rows(gate), rows(up)  # (M, I) views for contiguous tensors and column slices
    h = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if h.numel():
        grid, block = _grid(*g2.shape)
        _swiglu_fwd_kernel[grid](g2, u2, h, g2.stride(0), u2.stride(0), h.stride(0), g2.shape[1],
                                 GPT_OSS=variant == "gpt-oss", BLOCK_I=block)
    return h.view(gate.shape)


def swiglu_backward_triton(dh: Tensor, gate: Tensor, up: Tensor, variant: str = "swiglu",
                           inplace: bool = False, h_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dgate, dup). inplace=True writes them into gate and up and returns gate and up. h_out (gate's
    shape, e.g. dh itself): the same pass also writes the forward's h there (llm_anatomy.kernels.lean)."""
    check_launchable(gate)
    d2, g2, u2 = rows(dh), rows(gate), rows(up)
    h2 = d2 if h_out is None else rows(h_out)
    if h_out is not None and h2.data_ptr() != h_out.data_ptr():
        raise ValueError("swiglu_backward_triton: h_out must merge to (M, I) rows without a copy")
    if inplace:
        dg, du = g2, u2
    else:
        dg, du = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device), torch.empty_like(u2)
    if dg.numel():
        grid, block = _grid(*g2.shape)
        _swiglu_bwd_kernel[grid](d2, g2, u2, dg, du, h2, d2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0),
                                 du.stride(0), h2.stride(0), g2.shape[1], GPT_OSS=variant == "gpt-oss",
                                 REMAKE=h_out is not None, BLOCK_I=block)
    if not inplace:
        return dg.view(gate.shape), du.view(up.shape)
    for t, t2 in ((gate, g2), (up, u2)):
        if t2.data_ptr() != t.data_ptr():  # rows() had to copy: write the result back
            t.copy_(t2.view(t.shape))
    return gate, up


# ---- plain-torch references (the CPU implementation) -----------------------------------------
def _acts(gate: Tensor, up: Tensor, variant: str):
    acc = torch.promote_types(torch.promote_types(gate.dtype, up.dtype), torch.float32)
    g, u = gate.to(acc), up.to(acc)
    if variant == "gpt-oss":
        return g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT) + 1
    return g, u


def swiglu_reference(gate: Tensor, up: Tensor, variant: str = "swiglu") -> Tensor:
    g, u = _acts(gate, up, variant)
    return (torch.nn.functional.silu(g) * u).to(torch.promote_types(gate.dtype, up.dtype)).contiguous()


def swiglu_backward_reference(dh: Tensor, gate: Tensor, up: Tensor, variant: str = "swiglu") -> tuple[Tensor, Tensor]:
    g, u = _acts(gate, up, variant)
    d = dh.to(g.dtype)
    s = torch.sigmoid(g)
    dg, du = d * u * s * (1 + g * (1 - s)), d * g * s
    if variant == "gpt-oss":
        dg = dg * (gate <= LIMIT)
        du = du * ((up >= -LIMIT) & (up <= LIMIT))
    return dg.to(gate.dtype).contiguous(), du.to(up.dtype).contiguous()


# ---- custom ops --------------------------------------------------------------------------------
def _check(gate: Tensor, up: Tensor, variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"swiglu: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")


@torch.library.custom_op("anatomy::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    _check(gate, up, variant)
    return swiglu_triton(gate, up, variant) if cpu_uses_triton() else swiglu_reference(gate, up, variant)


@_swiglu_op.register_kernel("cuda")
def _(gate, up, variant="swiglu", inplace_backward=True):
    _check(gate, up, variant)
    return swiglu_triton(gate, up, variant)


@_swiglu_op.register_fake
def _(gate, up, variant="swiglu", inplace_backward=True):
    _check(gate, up, variant)
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("anatomy::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dh: Tensor, gate: Tensor, up: Tensor, variant: str) -> tuple[Tensor, Tensor]:
    if cpu_uses_triton():
        return swiglu_backward_triton(dh, gate, up, variant)
    return swiglu_backward_reference(dh, gate, up, variant)


@_swiglu_backward_op.register_kernel("cuda")
def _(dh, gate, up, variant):
    return swiglu_backward_triton(dh, gate, up, variant)


@_swiglu_backward_op.register_fake
def _(dh, gate, up, variant):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_backward_inplace(dh: Tensor, gate: Tensor, up: Tensor, variant: str) -> None:
    """Overwrites gate with dgate and up with dup."""
    if launches_triton(gate):
        swiglu_backward_triton(dh, gate, up, variant, inplace=True)
        return
    dg, du = swiglu_backward_reference(dh, gate, up, variant)  # the reference allocates; CPU is not the target
    gate.copy_(dg)
    up.copy_(du)


@torch.library.custom_op("anatomy::swiglu_backward_", mutates_args=("gate", "up"))
def _swiglu_backward_inplace_op(dh: Tensor, gate: Tensor, up: Tensor, variant: str) -> None:
    """Overwrites gate with dgate and up with dup."""
    _swiglu_backward_inplace(dh, gate, up, variant)


_swiglu_backward_inplace_op.register_kernel("cuda")(_swiglu_backward_inplace)


@_swiglu_backward_inplace_op.register_fake
def _(dh, gate, up, variant):
    return None


def _disjoint(a: Tensor, b: Tensor) -> bool:
    """True when no memory location belongs to both a and b (a, b of one shape)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    (a0, b0) = a.storage_offset(), b.storage_offset()
    a1 = a0 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))  # last element, in elements
    b1 = b0 + sum((n - 1) * s for n, s in zip(b.shape, b.stride()))
    if a1 < b0 or b1 < a0:
        return True
    if a.stride() != b.stride() or a.stride(-1) != 1:
        return False
    # Interleaved, same layout: element addresses are offset + (multiple of R) + column, R = gcd of
    # the leading strides. Modulo R, a covers I columns from a0 and b I columns from b0: disjoint iff
    # the two arcs do not meet (the halves of gate_up (.., 2I) have b0 - a0 = I, R = 2I).
    I = a.shape[-1]
    R = math.gcd(*(s for s, n in zip(a.stride()[:-1], a.shape[:-1]) if n > 1))
    return R > 0 and I <= (b0 - a0) % R <= R - I


def _eager(t: Tensor) -> bool:
    """A plain tensor with real memory: not a fake/functional tensor of a trace, not meta."""
    return type(t) is torch.Tensor and t.device.type != "meta"


def _setup_context(ctx, inputs, output):
    gate, up, variant, inplace_backward = inputs
    ctx.save_for_backward(gate, up)  # everything else is recomputed from these two
    ctx.variant = variant
    ctx.inplace = (inplace_backward and not torch.compiler.is_compiling() and _eager(gate) and _eager(up)
                   and gate.grad_fn is not None and up.grad_fn is not None and _disjoint(gate, up))


def _backward(ctx, dh):
    gate, up = ctx.saved_tensors
    if ctx.inplace and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        gate, up = gate.detach(), up.detach()  # aliases: the version counter bump stays visible
        _swiglu_backward_inplace_op(dh, gate, up, ctx.variant)
        dgate, dup = gate, up
    else:
        dgate, dup = _swiglu_backward_op(dh, gate, up, ctx.variant)
    return dgate, dup, None, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_rule(dtype, device_type, gate, up, variant="swiglu", inplace_backward=True):
    cast = lambda t: autocast_floating(t, device_type, dtype)  # noqa: E731
    return cast(gate), cast(up), variant, inplace_backward


register_autocast_rule(_swiglu_op, _autocast_rule)
register_autocast_rule(_swiglu_backward_op)
register_autocast_rule(_swiglu_backward_inplace_op)


# ---- the packed form: one (..., 2I) gate_up tensor in, its gradient out as one tensor ---------------
# Why. Called on gate_up.split(I), autograd's SplitBackward joins dgate and dup with a cat: a new
# (M, 2I) buffer and a full read + write of it (on the H200 at the seed step, 0.40 ms per layer, 5% of
# the step). Here the op owns the split, so backward returns the (M, 2I) storage the in-place kernel
# has just filled: no cat and no allocation.
def _packed_forward(gate_up: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # (..., I) views
    _check(gate, up, variant)
    return (swiglu_triton if launches_triton(gate_up) else swiglu_reference)(gate, up, variant)  # (..., I), contiguous


@torch.library.custom_op("anatomy::swiglu_packed", mutates_args=())
def _swiglu_packed_op(gate_up: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    return _packed_forward(gate_up, variant, inplace_backward)


_swiglu_packed_op.register_kernel("cuda")(_packed_forward)


@_swiglu_packed_op.register_fake
def _(gate_up, variant="swiglu", inplace_backward=True):
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim ({gate_up.shape[-1]}) must be 2 x intermediate")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _packed_setup_context(ctx, inputs, output):
    gate_up, variant, inplace_backward = inputs
    ctx.save_for_backward(gate_up)  # one storage: gate and up are its column halves
    ctx.variant = variant
    ctx.inplace = (inplace_backward and not torch.compiler.is_compiling() and _eager(gate_up)
                   and gate_up.grad_fn is not None)


def _packed_backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return packed_grad(dh, gate_up, ctx.variant, ctx.inplace), None, None


def packed_grad(dh: Tensor, gate_up: Tensor, variant: str, inplace: bool) -> Tensor:
    """d(gate_up) from d(h) and the saved gate_up: written into gate_up's storage when inplace (decided in
    forward, as _packed_setup_context does) and no graph is being made or traced, else a new tensor."""
    if inplace and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        gate_up = gate_up.detach()  # an alias: the version counter bump stays visible
        gate, up = gate_up.chunk(2, dim=-1)
        if fast_path(dh, gate_up):  # the in-place op's implementation, without the dispatcher
            with no_autocast(dh):
                _swiglu_backward_inplace(dh, gate, up, variant)
            torch.autograd.graph.increment_version(gate_up)  # as the op's mutates_args would: a Triton write bumps nothing
        else:
            _swiglu_backward_inplace_op(dh, gate, up, variant)
        return gate_up  # now d(gate_up)
    return torch.cat(_swiglu_backward_op(dh, *gate_up.chunk(2, dim=-1), variant), dim=-1)


_swiglu_packed_op.register_autograd(_packed_backward, setup_context=_packed_setup_context)
register_autocast_rule(_swiglu_packed_op, lambda dtype, device_type, gate_up, variant="swiglu", inplace_backward=True:
                       (autocast_floating(gate_up, device_type, dtype), variant, inplace_backward))


class _SwiGLUPackedFn(torch.autograd.Function):
    """The eager fast path (_dispatch.fast_path): the custom op's implementation, saves and (in-place)
    backward, without the dispatcher."""

    @staticmethod
    def forward(ctx, gate_up, variant, inplace_backward):
        with no_autocast(gate_up):
            h = _packed_forward(gate_up, variant, inplace_backward)
        _packed_setup_context(ctx, (gate_up, variant, inplace_backward), h)
        return h

    @staticmethod
    def backward(ctx, dh):
        return _packed_backward(ctx, dh)


def swiglu_packed(gate_up: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    """gate_up (..., 2I) -> h (..., I): swiglu on its two column halves; backward returns d(gate_up)
    written in place into gate_up's storage when that is safe (see swiglu)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim ({gate_up.shape[-1]}) must be 2 x intermediate")
    if fast_path(gate_up):
        dt = autocast_dtype(gate_up)
        return _SwiGLUPackedFn.apply(autocast_floating(gate_up, gate_up.device.type, dt) if dt else gate_up, variant,
                                     inplace_backward)
    return _swiglu_packed_op(gate_up, variant, inplace_backward)


def swiglu(gate: Tensor, up: Tensor, variant: str = "swiglu", inplace_backward: bool = True) -> Tensor:
    """gate, up (..., I) -> h (..., I), contiguous. variant "swiglu" or "gpt-oss".

    Saves gate and up only; backward may overwrite them with their gradients (module docstring)."""
    return _swiglu_op(gate, up, variant, inplace_backward)
