"""Minimal HBM bytes of the kernels `anatomy calibrate` times per width (our fused ops, the residual add,
Liger's CE kernel and ours, torch's fused AdamW, the baseline's eager norm, loss, SwiGLU and clamp chains), and the
shapes they depend on. Pure Python: the kernel lists price these ops with them, and calibrate's timings
become bandwidth efficiencies through the same formulas (registry.efficiency).
"""
from __future__ import annotations

from llm_anatomy.kernel_shapes import LCE_ROW_BLOCK, rms_norm_programs

CE_BLOCK = 32768  # lanes per pass of Liger's CE kernel (its MAX_FUSED_SIZE); ours: kernel_shapes.LCE_ROW_BLOCK


def fused_bytes(op: str, width: int, tokens: int, c: int = 2, r: int = 4) -> tuple[int, int]:
    """(read, write) minimal HBM bytes of one call of an op calibrate times per width (our fused ops,
    the residual add, Liger's CE kernel) over `tokens` rows of `width`: hidden for rms_norm and the
    residual add, intermediate for swiglu, (heads + 2 kv_heads) x head_dim for rope_qkv, vocab for
    Liger's CE, the elements of one tensor for an optimizer (T tensors), hidden, vocab or intermediate for
    the baseline's eager chains (EAGER_CHAINS). c is the compute dtype's size, r the residual stream's. The
    same formulas turn calibrate's timings of these ops into bandwidth efficiencies (registry.efficiency)."""
    T, W = tokens, width
    if op in EAGER_CHAINS:  # a chain of eager kernels: their bytes summed
        ops = EAGER_CHAINS[op](T, W, c, r)
        return sum(rd for _, rd, _ in ops), sum(wr for _, _, wr in ops)
    return _FUSED[op](T, W, c, r)


# {op: (T, W, c, r) -> (read, write)}: T rows of W, compute dtype c bytes, residual stream r bytes
_FUSED = {
    "rms_norm.forward": lambda T, W, c, r: (T * W * r, T * W * c),  # x in, y out (compute dtype)
    # dy, x in; dx out (the dw partials: dw_sum_bytes)
    "rms_norm.backward": lambda T, W, c, r: (T * W * (c + r), T * W * r),
    # add_rms_norm (kernels/add_rms_norm.py): x (r) and the branch (c) in; x_new (r) and y (c) out
    "add_rms_norm.forward": lambda T, W, c, r: (T * W * (r + c), T * W * (r + c)),
    # d_x_new (r), dy (c), x_new (r) in; d_x (r) and d_branch (c) out (the dw partials: dw_sum_bytes)
    "add_rms_norm.backward": lambda T, W, c, r: (T * W * (2 * r + c), T * W * (r + c)),
    "swiglu.forward": lambda T, W, c, r: (T * 2 * W * c, T * W * c),  # gate_up in, h out
    # dh, gate_up in; d(gate_up) written in place
    "swiglu.backward": lambda T, W, c, r: (T * W * c + T * 2 * W * c, T * 2 * W * c),
    # the lean block's (kernels/lean.py remake_grad): the same pass also writes h over dh
    "swiglu.backward_remake": lambda T, W, c, r: (T * W * c + T * 2 * W * c, T * 3 * W * c),
    "rope_qkv.forward": lambda T, W, c, r: (T * W * c, T * W * c),  # qkv in; q, k, v out
    "rope_qkv.backward": lambda T, W, c, r: (T * W * c, T * W * c),
    "residual_add": lambda T, W, c, r: (T * W * (r + c), T * W * r),  # stream + branch in, stream out
    # Liger's CE over (T, V = W) logits: each row read twice (max/sum, then the gradient), the gradient
    # written in place; targets in (int64), losses out (fp32)
    "liger_ce": lambda T, W, c, r: (2 * T * W * c + T * 8, T * W * c + T * 4),
    # our CE row kernel (llm_anatomy/kernels/linear_ce.py) over (T, V = W) logits: a row that fits one block of
    # LCE_ROW_BLOCK lanes stays in registers (read once), a wider one is read twice; the gradient written in
    # place; targets (int64) and the 0-d scale in, losses out (fp32)
    "anatomy_ce": lambda T, W, c, r: ((1 if W <= LCE_ROW_BLOCK else 2) * T * W * c + T * 8 + 4, T * W * c + T * 4),
    # the baseline's S x S chain over T rows of W = S (calibrate_kernels.sxs_case): scale and the (broadcast)
    # mask add in the compute dtype, the casts, the fp32 softmax and its backward
    "sxs.scale": lambda T, W, c, r: (T * W * c, T * W * c),
    "sxs.mask_add": lambda T, W, c, r: (T * W * c, T * W * c),
    "sxs.float": lambda T, W, c, r: (T * W * c, T * W * 4),
    "sxs.to_compute": lambda T, W, c, r: (T * W * 4, T * W * c),
    "sxs.softmax": lambda T, W, c, r: (T * W * 4, T * W * 4),
    "sxs.softmax.backward": lambda T, W, c, r: (2 * T * W * 4, T * W * 4),
    # with gpt-oss's sinks (W = S; rows of S + 1 are not 16-byte aligned): the fp32 cat with the sink column, the
    # cast of a strided (T, W) slice of them to the compute dtype, the slice's backward copy into them
    "sxs.sink_cat": lambda T, W, c, r: (T * W * 4, T * (W + 1) * 4),
    "sxs.sink_slice_cast": lambda T, W, c, r: (T * W * 4, T * W * c),
    "sxs.sink_slice_backward": lambda T, W, c, r: (T * W * 4, T * W * 4),
    # a fused optimizer step over T fp32 tensors of W elements: param, grad and state in; param and state out
    # (calculator/optimizer.step_bytes_moved's minimum)
    "optimizer.adamw": lambda T, W, c, r: (T * W * (4 + 4 + 8), T * W * (4 + 8)),
    "optimizer.ademamix": lambda T, W, c, r: (T * W * (4 + 4 + 12), T * W * (4 + 12)),
    # ATen's embedding_dense_backward less its (V, W) zero fill: the (T, W) gradient (dtype r) and the ids in,
    # a row of W fp32 sums per id out (calibrate_kernels.embedding_case)
    "embedding.backward": lambda T, W, c, r: (T * W * r + T * 8, T * W * 4),
}


def eager_norm_forward(T: int, H: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    """(op, read, write) of the baseline's RMSNorm forward (llm_anatomy/baseline/norm.py), one kernel each, in
    fp32 ops on a (T, H) stream of dtype r (f: one fp32 (T, H) pass; the casts only where r is not fp32)."""
    f, tiny = T * H * 4, T * 4
    ops = [("pow", f, f), ("mean", f, tiny), ("add_eps", tiny, tiny), ("rsqrt", tiny, tiny),
           ("mul_rstd", f + tiny, f), ("mul_weight", f, f)]
    return ops + ([("float", T * H * r, f), ("to", f, T * H * r)] if r != 4 else [])


def eager_norm_backward(T: int, H: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    f, tiny = T * H * 4, T * 4
    ops = [("mul_weight.grad_x", f, f), ("mul_weight.grad_w", 2 * f, f), ("mul_weight.grad_w_sum", f, H * 4),
           ("mul_rstd.grad_x", f + tiny, f), ("mul_rstd.grad_rstd", 2 * f, f), ("mul_rstd.grad_rstd_sum", f, tiny),
           ("rsqrt.backward", 3 * tiny, 3 * tiny), ("mean.backward", tiny, f), ("pow.backward_pow1", f, f),
           ("pow.backward_scale", f, f), ("pow.backward_mul", 2 * f, f), ("grad_sum", 2 * f, f)]
    return ops + ([("to.backward", T * H * r, f), ("float.backward", f, T * H * r)] if r != 4 else [])


def eager_ce_forward(T: int, V: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    """The baseline loss after its lm_head (llm_anatomy/baseline/loss.py): the (T, V) logits upcast to fp32
    (a copy unless the compute dtype is fp32), log_softmax, nll_loss; and their backward."""
    TV = T * V
    return [("logits_float", TV * c, TV * 4)] * (c != 4) + [("log_softmax", TV * 4, TV * 4), ("nll_loss", T * 12, 8)]


def eager_ce_backward(T: int, V: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    TV = T * V
    return ([("nll_loss.backward_zeros", 0, TV * 4), ("nll_loss.backward_scatter", T * 8, T * 4),
             ("log_softmax.backward", 2 * TV * 4, TV * 4)] + [("logits_float.backward", TV * 4, TV * c)] * (c != 4))


def eager_mlp_forward(T: int, I: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    """The baseline's SwiGLU between its matmuls (llm_anatomy/baseline/mlp.py): silu(gate), then the product
    with up, over (T, I) in the compute dtype; backward: the product's two gradients, then silu's."""
    TI = T * I * c
    return [("silu", TI, TI), ("mul", 2 * TI, TI)]


def eager_mlp_backward(T: int, I: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    TI = T * I * c
    return [("mul.grad_silu", 2 * TI, TI), ("mul.grad_up", 2 * TI, TI), ("silu.backward", 2 * TI, TI)]


def eager_clamp_forward(T: int, I: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    """gpt-oss's clamps before the baseline's SwiGLU (llm_anatomy/baseline/mlp.py): gate.clamp(max=L),
    up.clamp(-L, L) + 1, over (T, I) in the compute dtype. Backward, as ATen's clamp_backward runs it:
    where(mask, grad, 0) with the mask from one comparison (gate) or two and their logical_and (up), a
    byte (bool) per element."""
    TI = T * I * c
    return [("clamp_gate", TI, TI), ("clamp_up", TI, TI), ("add_one", TI, TI)]


def eager_clamp_backward(T: int, I: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    TI, m = T * I * c, T * I
    return [("clamp_gate.backward_mask", TI, m), ("clamp_gate.backward_where", m + TI, TI),
            ("clamp_up.backward_mask_lo", TI, m), ("clamp_up.backward_mask_hi", TI, m),
            ("clamp_up.backward_mask_and", 2 * m, m), ("clamp_up.backward_where", m + TI, TI)]


def eager_rope_forward(R: int, hd: int, c: int = 2, r: int = 4) -> list[tuple[str, int, int]]:
    """The baseline's RoPE on q or k (llm_anatomy/baseline/attention.apply_rope): x * cos + cat(-x2, x1) * sin over
    R = tokens x heads rows of hd, x a (B, heads, S, hd) view of the projection's (B, S, heads, hd) output and
    the (S, hd) tables broadcast, in the compute dtype. ATen runs these broadcast, strided ops unvectorized,
    well under the copy roofline (calibrated as a chain: eager_rope). Backward mirrors it (the gradient
    times sin, its half negated, the cat, times cos, the two paths summed)."""
    W = R * hd * c
    return [("mul_cos", W, W), ("neg", W // 2, W // 2), ("cat", W, W), ("mul_sin", W, W), ("add", 2 * W, W)]


eager_rope_backward = eager_rope_forward


# the baseline's eager chains calibrate times as wholes (calibrate_kernels.eager_case): {op: its kernels}
EAGER_CHAINS = {"eager_norm.forward": eager_norm_forward, "eager_norm.backward": eager_norm_backward,
                "eager_ce.forward": eager_ce_forward, "eager_ce.backward": eager_ce_backward,
                "eager_mlp.forward": eager_mlp_forward, "eager_mlp.backward": eager_mlp_backward,
                "eager_clamp.forward": eager_clamp_forward, "eager_clamp.backward": eager_clamp_backward,
                "eager_rope.forward": eager_rope_forward, "eager_rope.backward": eager_rope_backward}


EMBEDDING_FEATURE_IDS = 3072  # ATen's embedding_dense_backward: its feature kernel up to this many ids
EMBEDDING_SORT_LAUNCHES = 30  # past them, a radix sort of the ids and a segmented sum (the H200 traces' count)


def embedding_backward_launches(width: int, tokens: int) -> int:
    """Kernels of ATen's embedding_dense_backward on CUDA, less its zero fill."""
    return 1 if tokens <= EMBEDDING_FEATURE_IDS else EMBEDDING_SORT_LAUNCHES


def liger_ce_width(V: int, max_block: int = CE_BLOCK) -> int:
    """The row width Liger's CE kernel works through: its BLOCK_SIZE = min(32768, next_pow2(V)) lanes
    per pass, masked past V (liger_kernel ops/cross_entropy.py). Its time follows this, not V: a vocab
    just past a power of two runs a pass twice as wide (the profile's liger_ce rows). Our row kernel
    blocks its rows the same way with max_block = LCE_ROW_BLOCK (anatomy_ce_width)."""
    block = min(max_block, 1 << max(0, V - 1).bit_length())
    return -(-V // block) * block


def anatomy_ce_width(V: int) -> int:
    """The row width our CE row kernel works through (linear_ce.ce_rows_triton: blocks of LCE_ROW_BLOCK)."""
    return liger_ce_width(V, LCE_ROW_BLOCK)


def dw_sum_bytes(H: int, M: int) -> tuple[int, int]:
    """(read, write) of rms_norm backward's second kernel over M rows: the (programs, H) fp32 dw
    partials -> dw."""
    return 4 * rms_norm_programs(H, M) * H, 4 * H
