"""How the fused kernels cut their work: the rules the models, the calculator and `anatomy calibrate` share.

Pure Python, no torch: anatomy/efficient/loss.py, the memory and timing models and anatomy/measure/calibrate.py
all import these, so the chunk a model runs and the chunk the calculator prices are the same number. They are
facts about the kernels' code (Liger's chunking, our rms_norm launch), so they live beside the calculator and
the models rather than in either: no model reads the calculator, and the calculator reads no model.
"""
from __future__ import annotations


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's fused linear CE chunk (chunk_mem_const=1): next_pow2(ceil(T / ceil(V / H))) rows, at most T,
    so a (chunk, V) logits block is about the size of the (T, H) input."""
    inc = -(-vocab // hidden)
    return min(1 << max(0, -(-tokens // inc) - 1).bit_length(), tokens)


RMS_MIN_ROWS = 4  # rows per program at least (the kernels' _dispatch.MIN_ROWS_PER_PROGRAM)


def rms_norm_programs(H: int, M: int, sms: int = 132) -> int:
    """Programs of the fused rms_norm backward over M rows, each writing an fp32 row of dw partials (and
    so the size of its transient): max(1, 8192 // H) per SM, at least RMS_MIN_ROWS rows each, and a whole
    number of rows each (anatomy/kernels/rms_norm.py, _dispatch.reduction_programs; the H200's 132 SMs:
    other GPUs' partials differ by at most ~4 MB)."""
    programs = max(1, min(-(-M // RMS_MIN_ROWS), sms * max(1, 8192 // H)))
    per = -(-M // programs)
    return -(-M // per)
