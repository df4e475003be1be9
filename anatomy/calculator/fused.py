"""Minimal HBM bytes of the kernels `anatomy calibrate` times per width (our fused ops, the residual add,
Liger's CE kernel), and the shapes they depend on. Pure Python: calibrate's timings become bandwidth
efficiencies through the same formulas (timing.fused_efficiency), and launches.py lists the kernels.
"""
from __future__ import annotations


def fused_bytes(op: str, width: int, tokens: int, c: int = 2, r: int = 4) -> tuple[int, int]:
    """(read, write) minimal HBM bytes of one call of an op calibrate times per width (our fused ops,
    the residual add, Liger's CE kernel) over `tokens` rows of `width`: hidden for rms_norm and the
    residual add, intermediate for swiglu, (heads + 2 kv_heads) x head_dim for rope_qkv, vocab for
    Liger's CE. c is the compute dtype's size, r the residual stream's. The same formulas turn
    calibrate's timings of these ops into bandwidth efficiencies (timing.fused_efficiency)."""
    T, W = tokens, width
    return {"rms_norm.forward": (T * W * r, T * W * c),  # x in, y out (compute dtype)
            "rms_norm.backward": (T * W * (c + r), T * W * r),  # dy, x in; dx out (dw partials: dw_sum_bytes)
            "swiglu.forward": (T * 2 * W * c, T * W * c),  # gate_up in, h out
            "swiglu.backward": (T * W * c + T * 2 * W * c, T * 2 * W * c),  # dh, gate_up in; d(gate_up) in place
            "rope_qkv.forward": (T * W * c, T * W * c),  # qkv in; q, k, v out
            "rope_qkv.backward": (T * W * c, T * W * c),
            "residual_add": (T * W * (r + c), T * W * r),  # stream + branch in, stream out
            # Liger's CE over (T, V = W) logits: each row read twice (max/sum, then the gradient), the
            # gradient written in place; targets in (int64), losses out (fp32)
            "liger_ce": (2 * T * W * c + T * 8, T * W * c + T * 4),
            # the baseline's S x S chain over T rows of W = S (calibrate_kernels.sxs_case): scale and the
            # (broadcast) mask add in the compute dtype, the casts, the fp32 softmax and its backward
            "sxs.scale": (T * W * c, T * W * c), "sxs.mask_add": (T * W * c, T * W * c),
            "sxs.float": (T * W * c, T * W * 4), "sxs.to_compute": (T * W * 4, T * W * c),
            "sxs.softmax": (T * W * 4, T * W * 4), "sxs.softmax.backward": (2 * T * W * 4, T * W * 4)}[op]


def liger_ce_width(V: int, max_block: int = 32768) -> int:
    """The row width Liger's CE kernel works through: its BLOCK_SIZE = min(32768, next_pow2(V)) lanes
    per pass, masked past V (liger_kernel ops/cross_entropy.py). Its time follows this, not V: on the
    H200, V 18042 (one 32768-lane pass) ran 2.5x V 16000 (one 16384-lane pass) per row (session8d)."""
    block = min(max_block, 1 << max(0, V - 1).bit_length())
    return -(-V // block) * block


def dw_sum_bytes(H: int) -> tuple[int, int]:
    """(read, write) of rms_norm backward's second kernel: the (programs, H) fp32 dw partials -> dw."""
    return 4 * rms_norm_programs(H) * H, 4 * H


def rms_norm_programs(H: int, sms: int = 132) -> int:
    """Programs of the fused rms_norm backward, each writing an fp32 row of dw partials: max(1, 8192 // H)
    per SM (anatomy/kernels/rmsnorm.py; the H200's 132 SMs: the partials are tiny whatever the GPU)."""
    return sms * max(1, 8192 // H)
