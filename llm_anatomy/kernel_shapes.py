"""How the fused kernels cut their work: the rules the models, the calculator and `anatomy calibrate` share.

Pure Python, no torch: llm_anatomy/efficient/loss.py, llm_anatomy/kernels/linear_ce.py, the memory and timing models
and llm_anatomy/measure/calibrate.py all import these, so the chunk a model runs and the chunk the calculator prices
are the same number. They are facts about the kernels' code (Liger's chunking, our fused linear cross-entropy's
chunk and bytes, our rms_norm launch), so they live beside the calculator and the models rather than in either:
no model reads the calculator, and the calculator reads no model.
"""
from __future__ import annotations


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's fused linear CE chunk (chunk_mem_const=1): next_pow2(ceil(T / ceil(V / H))) rows, at most T,
    so a (chunk, V) logits block is about the size of the (T, H) input."""
    inc = -(-vocab // hidden)
    return min(1 << max(0, -(-tokens // inc) - 1).bit_length(), tokens)



# Our fused linear cross-entropy, anatomy::linear_cross_entropy (llm_anatomy/kernels/linear_ce.py): its chunk and memory.
#
# The chunk rule. One chunk of C rows costs (H200: F = 780e12 FLOP/s bf16 matmul, BW = 4.2e12 B/s,
# F / BW = 186 FLOP per byte):
#   * GEMMs: logits = x_c Wᵀ, grad_x_c = g W, grad_w += gᵀ x_c: 6·C·H·V FLOPs, time 6·C·H·V / F;
#   * the grad_w accumulation: the (V, H) fp32 accumulator is read and written once per chunk by the
#     accumulating GEMM's epilogue, 8·V·H bytes, time 8·V·H / BW, whatever C is (the bf16 weight's two
#     reads per chunk, 4·V·H bytes, stream under the GEMMs' math);
#   * the row kernel: each (C, V) bf16 logit is read twice and written once, about 6·C·V bytes, time
#     6·C·V / BW. Per GEMM FLOP that is F / (BW·H), 9% at H = 2048 and 36% at H = 512, and no chunk size
#     changes it: it bounds the op's fraction of the matmul ceiling from above.
# So the per-chunk fixed cost over the chunk's GEMM time is (8·V·H / BW) / (6·C·H·V / F) = 4·F / (3·BW·C)
# = 248 / C: 48% at Liger's 512 rows (T = 16k, H = 2048, V = 128k), 24% at 1,024, 6% at 4,096. Holding it
# to 1/16 of the GEMM time needs C >= 16 · 248 = 3,968 rows: C_MIN = 4,096, a property of the machine's
# F / BW, not of the model's shape. A chunk of that size also fills the GEMMs' tile grid many times over
# (4,096 / 128 x 32,000 / 256 = 4,000 tiles on 132 SMs).
#
# The budget. The logits chunk is alive at the end of the forward, where the step's activations are all
# held: every byte of it adds to the step's peak. It may take LOGITS_BUDGET = 1 GiB or the size of the
# (T, H) input it replaces in Liger's rule, whichever is larger; 1 GiB is under 1% of an H200's memory
# and about 3% of a 1B model's step peak, and at H = 2048 it still admits C_MIN rows for vocabularies up
# to 131,072 (2^30 / (2 · 4,096)). Past that the chunk shrinks to the largest power of two that fits,
# never below Liger's rows.
#
#     chunk = min(T, max(chunk_rows, min(C_MIN, pow2_floor(max(LOGITS_BUDGET, T·H·2) / (V · logit_bytes)))))
#     (chunk_rows: Liger's rows, below)
#
# Memory of one training call, on CUDA (T tokens, H hidden, V vocab; c = bytes of x's dtype, the
# compute dtype; p = bytes of the weight's dtype), in allocation order:
#   valid          (T,)   bool     T                 targets != ignore_index; freed once counted, before
#                                                    anything below is allocated (so never in the peak)
#   n              ()     float32  4                 max(count of non-ignored targets, 1), on the device (mean;
#                                                    1 for the sum); its int64 intermediates come and go
#   scale          ()     float32  4                 1 / n, read by the row kernel through a pointer
#   weight_cast    (V, H) c        V·H·c if p != c   the weight in the compute dtype, cast once per call
#   losses         (T,)   float32  T·4               per-row losses
#   grad_x         (T, H) c        T·H·c             output, saved for backward
#   grad_w         (V, H) p        V·H·p             output, saved for backward (accumulated in place)
#   logits         (C, V) c        min(C, T)·V·c     one buffer, reused by every chunk; the row kernel
#                                                    overwrites the logits with their gradient in place
#   loss_sum       ()     float64  8 + 8             the row losses' fp64 sum and its quotient by n
#   loss           ()     float32  4                 output
# No GEMM allocates (all write through out=), and the row kernel allocates nothing. The peak is at the
# loss's final cast, where everything but valid is alive: lce_peak_bytes() = sum(lce_forward_bytes()) - T. On
# the GPU each tensor is rounded up to the caching allocator's 512-byte blocks (the 0-d ones to 512).
# The transients (everything but grad_x, grad_w, loss) are freed when the forward returns. Backward
# scales grad_x and grad_w by the incoming gradient in place in eager mode and returns those buffers
# (0 new bytes; AccumulateGrad takes grad_w as the weight's .grad without a copy when .grad is None);
# under torch.compile, or with inplace_backward=False, it allocates their scaled copies, T·H·c + V·H·p.
# The CPU reference keeps the same saved tensors but upcasts inside each chunk (fp32 copies), so its
# transients are larger; the memory claims are CUDA's (validations/test_linear_ce.py checks this table
# against the CUDA path's allocations on meta tensors).
#
# Evaluation (no gradient, or reduction "none"): weight_cast, losses (the output) and a logits chunk;
# no grad_x, no grad_w.
#
# The row kernel's block. Each program works through one row of V logits in blocks of LCE_ROW_BLOCK lanes
# (16 warps): two passes over the row (max and sum of exp, then the gradient written in place), so it reads
# the row twice and writes it once; a row of at most one block stays in registers and is read once. A whole
# row of 16k-32k lanes in one program (16-32 warps) leaves one or two programs per SM, too few loads in
# flight: on two H200s it ran at 60-67% of the copy rate for its two passes, where blocks of 8,192 ran at
# 96-102% for their three (bench/linear_ce.py --row-blocks, docs/peers.md); three passes at the copy rate
# are the faster of the two from V = 16k up, and the calculator prices the row kernel at that rate.
LCE_ROW_BLOCK = 8192  # lanes per pass step of our CE row kernel
# the efficient model's CE runs its GEMMs over the vocabulary padded to a multiple of this (lce_vocab); 1 pads
# nothing. The model and the calculator both read it (docs/peers.md: what 8 does to a vocabulary off 8)
LCE_ALIGN = 1
C_MIN = 4096  # rows: keeps the per-chunk grad_w accumulation under 1/16 of the chunk's GEMM time (above)
LOGITS_BUDGET = 1 << 30  # bytes of one logits chunk, unless the (T, H) input is larger (above)


def lce_chunk_rows(tokens: int, hidden: int, vocab: int, logit_bytes: int = 2) -> int:
    """Rows per chunk of the fused linear cross-entropy (the comment above). logit_bytes: the compute
    dtype's size (2 for bf16/fp16, 4 for fp32 training)."""
    if tokens <= 0:
        return 1
    budget_rows = max(LOGITS_BUDGET, tokens * hidden * 2) // (vocab * logit_bytes)
    fit = 1 << (budget_rows.bit_length() - 1) if budget_rows >= 1 else 1  # largest power of two <= budget_rows
    return min(tokens, max(chunk_rows(tokens, hidden, vocab), min(C_MIN, fit)))


def lce_vocab(vocab: int, align: int = 1) -> int:
    """The vocabulary the op's GEMMs run over: vocab rounded up to a multiple of `align`. A GEMM dimension that
    is not a multiple of 8 bf16 elements runs at a third of the rate or less (calibrate's matmul_misaligned);
    with align 8 the op casts the weight into a zero-padded (V', H) buffer, and the pad columns' logits and
    gradients are exact zeros (llm_anatomy/kernels/linear_ce.py)."""
    return -(-vocab // align) * align


def lce_forward_bytes(tokens: int, hidden: int, vocab: int, c: int = 2, p: int = 4, chunk: int = 0,
                      align: int = 1) -> dict[str, int]:
    """Every tensor one training call allocates on CUDA, in bytes (the table above), keyed by
    the names above. c: bytes of the compute dtype; p: bytes of the weight's dtype; align: lce_vocab's."""
    T, H, V = tokens, hidden, lce_vocab(vocab, align)
    C = chunk or lce_chunk_rows(T, H, V, c)  # chunk: the op's override, 0 for the rule
    cast = p != c or V != vocab  # a padded vocabulary needs the padded copy even without a cast
    return {"valid": T, "n": 4, "scale": 4, "weight_cast": V * H * c if cast else 0, "losses": T * 4,
            "grad_x": T * H * c, "grad_w": V * H * p, "logits": min(C, T) * V * c, "loss_sum": 16, "loss": 4}


def lce_peak_bytes(tokens: int, hidden: int, vocab: int, c: int = 2, p: int = 4, chunk: int = 0,
                   align: int = 1) -> int:
    """The most bytes one training call holds at once (the table above), its saved tensors included."""
    return sum(lce_forward_bytes(tokens, hidden, vocab, c, p, chunk, align).values()) - tokens


def lce_saved_bytes(tokens: int, hidden: int, vocab: int, c: int = 2, p: int = 4, align: int = 1) -> int:
    """Bytes autograd keeps for backward: grad_x (T, H) in the compute dtype and grad_w (V, H) in the weight's
    (a view of its (V', H) accumulator where the vocabulary is padded)."""
    return tokens * hidden * c + lce_vocab(vocab, align) * hidden * p


def lce_transient_bytes(tokens: int, hidden: int, vocab: int, c: int = 2, p: int = 4, chunk: int = 0,
                        align: int = 1) -> int:
    """Bytes alive at the forward's peak beyond its saved tensors and the loss."""
    return (lce_peak_bytes(tokens, hidden, vocab, c, p, chunk, align)
            - lce_saved_bytes(tokens, hidden, vocab, c, p, align) - 4)


RMS_MIN_ROWS = 4  # rows per program at least (the kernels' _dispatch.MIN_ROWS_PER_PROGRAM)


def rms_norm_programs(H: int, M: int, sms: int = 132) -> int:
    """Programs of the fused rms_norm backward over M rows, each writing an fp32 row of dw partials (and
    so the size of its transient): max(1, 8192 // H) per SM, at least RMS_MIN_ROWS rows each, and a whole
    number of rows each (llm_anatomy/kernels/rms_norm.py, _dispatch.reduction_programs; the H200's 132 SMs:
    other GPUs' partials differ by at most ~4 MB)."""
    programs = max(1, min(-(-M // RMS_MIN_ROWS), sms * max(1, 8192 // H)))
    per = -(-M // programs)
    return -(-M // per)
