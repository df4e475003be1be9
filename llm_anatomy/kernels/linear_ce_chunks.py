"""Chunk size and memory of anatomy::linear_cross_entropy (linear_ce.py), under the names the kernel, its
tests and bench/linear_ce.py use. The rule, its derivation and the byte table live in llm_anatomy/kernel_shapes.py
(pure Python, no torch), so the calculator counts the same bytes the op allocates."""
from llm_anatomy.kernel_shapes import (C_MIN, LOGITS_BUDGET, chunk_rows as liger_rows, lce_chunk_rows as chunk_rows,
                                   lce_forward_bytes as forward_bytes, lce_peak_bytes as peak_bytes,
                                   lce_saved_bytes as saved_bytes, lce_transient_bytes as transient_bytes)

__all__ = ["C_MIN", "LOGITS_BUDGET", "liger_rows", "chunk_rows", "forward_bytes", "peak_bytes", "saved_bytes",
           "transient_bytes"]
