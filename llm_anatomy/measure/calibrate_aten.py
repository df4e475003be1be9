"""Calibrate's ATen cases: ops the models run as ATen calls or eager chains, timed as the models run them
(calibrate_kernels.measure_fused times each; calculator/timing/op_bytes.py lists their bytes and kernels).

  sxs.*        the eager baseline's S x S attention chain, op by op, over SXS_ROWS rows of S
  eager_*      the eager baseline's RMSNorm, loss tail, SwiGLU and gpt-oss clamps, each chain as a whole
  embedding    ATen's embedding_dense_backward, both models' embedding backward
  eager_rope   the eager baseline's RoPE on q or k
"""
from __future__ import annotations

import itertools


ROTATE_BYTES = 256 * 2**20  # rotate enough input sets to exceed the L2 (50-60 MB) several times


def _sets(nbytes: int) -> int:
    """How many input sets to rotate through so no timed call reads an L2-resident input (2 to 8)."""
    return max(2, min(8, ROTATE_BYTES // max(1, nbytes)))


# the eager baseline's S x S chain (llm_anatomy/baseline/attention.py): each op over SXS_ROWS rows of S, at the
# sequence lengths the probes run. ATen runs several of them well under the copy roofline (on the H200 the
# fp32 softmax at ~52%, the bf16 -> fp32 cast at ~50%, the broadcast mask add at ~34% of it), and the softmax
# backward is two kernels (a multiply, then the row reduction)
SXS_SEQS = (1024, 2048, 4096)
SXS_ROWS = 32768  # (B x heads x S) rows: 4 x 8 x 1024 ... 1 x 8 x 4096


def sxs_case(op: str, S: int, rows: int = SXS_ROWS):
    """One op of the baseline's S x S chain over (rows, S), as the model calls it under bf16 autocast."""
    def build():
        import torch
        import torch.nn.functional as F

        bf, f32 = dict(device="cuda", dtype=torch.bfloat16), dict(device="cuda", dtype=torch.float32)
        n = _sets(rows * S * 8)
        if op == "sxs.mask_add":  # (B', S, S) scores + the (S, S) causal bias, broadcast
            xs = [torch.randn(rows // S, S, S, **bf) for _ in range(n)]
            bias = torch.triu(torch.full((S, S), float("-inf"), **bf), 1)
            call = lambda x: x + bias  # noqa: E731
        elif op in ("sxs.scale", "sxs.float"):
            xs = [torch.randn(rows, S, **bf) for _ in range(n)]
            call = (lambda x: x * 0.125) if op == "sxs.scale" else (lambda x: x.float())  # noqa: E731
        elif op in ("sxs.softmax", "sxs.to_compute"):
            xs = [torch.randn(rows, S, **f32) for _ in range(n)]
            call = (lambda x: F.softmax(x, dim=-1)) if op == "sxs.softmax" else (lambda x: x.to(torch.bfloat16))  # noqa: E731
        elif op == "sxs.sink_cat":  # gpt-oss's sinks: cat(scores.float(), sink) into rows of S + 1, fp32
            xs = [torch.randn(rows, S, **f32) for _ in range(n)]
            sink = torch.zeros(1, 1, **f32)
            call = lambda x: torch.cat((x, sink.expand(rows, 1)), dim=-1)  # noqa: E731
        elif op == "sxs.sink_slice_cast":  # probs[..., :-1].to(bf16): a strided slice of rows of S + 1 (and the
            xs = [torch.randn(rows, S + 1, **f32) for _ in range(n)]  # cat's backward into scores.float()'s)
            call = lambda x: x[:, :S].to(torch.bfloat16)  # noqa: E731
        elif op == "sxs.sink_slice_backward":  # the slice's backward: its gradient copied into rows of S + 1
            xs = [torch.randn(rows, S, **f32) for _ in range(n)]
            out = torch.zeros(rows, S + 1, **f32)
            call = lambda x: out[:, :S].copy_(x)  # noqa: E731
        else:  # sxs.softmax.backward: (grad, softmax output) fp32 -> grad of the input
            xs = [(torch.randn(rows, S, **f32), torch.rand(rows, S, **f32)) for _ in range(n)]
            call = lambda x: torch.ops.aten._softmax_backward_data(x[0], x[1], -1, torch.float32)  # noqa: E731
        it, cur = itertools.cycle(xs), [xs[0]]
        return (lambda: cur.__setitem__(0, next(it))), (lambda: call(cur[0]))
    return build


SXS_OPS = ("sxs.scale", "sxs.mask_add", "sxs.float", "sxs.softmax", "sxs.to_compute", "sxs.softmax.backward",
           "sxs.sink_cat", "sxs.sink_slice_cast", "sxs.sink_slice_backward")

# the eager baseline's RMSNorm, its loss after the lm_head (log_softmax over fp32 logits) and SwiGLU's silu and
# product, each timed as a whole, forward and backward, as the model runs them under amp: on the H200 they run
# 1.16-1.31x the copy-roofline model (gpt-oss's clamp backward: bool masks, then a where, unvectorized).
# calculator/timing/op_bytes.py lists their kernels (EAGER_CHAINS); timing reads a rate per width.
EAGER_CE_VOCABS = (16000, 32000, 64000, 128256)
EAGER_CE_ROWS = 8192


# the embedding's backward, ATen's embedding_dense_backward over an fp32 (T, H) gradient as the models run it
# under amp: at most 3072 ids one feature kernel (a block per 32 columns, ids in sequence), past that a radix
# sort of the ids and a segmented sum, ~30 launches, 3-5x the copy roofline. op_bytes.fused_bytes lists its
# bytes; the (V, H) zero fill it starts with is moved at the copy rate and taken out (registry.efficiency).
EMBEDDING_WIDTHS, EMBEDDING_ROWS, EMBEDDING_VOCAB = (512, 1024, 2048, 4096), (2048, 4096, 16384, 65536), 32000


def embedding_case(width: int, rows: int, vocab: int = EMBEDDING_VOCAB):
    def build():
        import torch

        sets = [(torch.randn(rows, width, device="cuda"), torch.randint(0, vocab, (rows,), device="cuda"))
                for _ in range(_sets(rows * width * 8))]
        it, cur = itertools.cycle(sets), [sets[0]]
        return ((lambda: cur.__setitem__(0, next(it))),
                lambda: torch.ops.aten.embedding_dense_backward(cur[0][0], cur[0][1], vocab, -1, False))
    return build


def eager_case(op: str, width: int, rows: int):
    """The baseline's norm (width = hidden; an fp32 (rows, H) stream), loss tail (width = vocab; bf16
    logits), SwiGLU's silu and product or gpt-oss's clamps before them (width = intermediate; bf16 gate and
    up) over `rows`, under bf16 autocast: "eager_*.forward" times the forward, "eager_*.backward" the
    backward of a forward run just before it (untimed), from a random upstream gradient or the loss."""
    def build():
        import torch
        import torch.nn.functional as F

        from llm_anatomy.baseline.norm import RMSNorm
        from llm_anatomy.baseline.mlp import GPT_OSS_LIMIT

        kind = op.split(".")[0]  # eager_norm, eager_ce, eager_mlp or eager_clamp
        norm, mlp = kind == "eager_norm", kind in ("eager_mlp", "eager_clamp")
        dt = torch.float32 if norm else torch.bfloat16

        def leaf():
            return torch.randn(rows, width, device="cuda", dtype=dt, requires_grad=True)
        # the MLP's gate and up are two leaves (as two matmul outputs: no split's backward to concatenate)
        xs = [(leaf(), leaf()) if mlp else leaf() for _ in range(_sets(rows * width * (24 if norm else 14)))]
        ts = torch.randint(0, width, (rows,), device="cuda")
        mod = RMSNorm(width, 1e-5).to("cuda") if norm else None
        g = None if kind == "eager_ce" else torch.randn(rows, width, device="cuda", dtype=torch.float32 if norm else dt)
        it, cur, out = itertools.cycle(xs), [xs[0]], [None]

        def fwd():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if kind == "eager_clamp":  # gpt-oss's clamps (llm_anatomy/baseline/mlp.py): both outputs
                    return (cur[0][0].clamp(max=GPT_OSS_LIMIT), cur[0][1].clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT) + 1)
                if mlp:
                    return F.silu(cur[0][0]) * cur[0][1]
                return mod(cur[0]) if norm else F.cross_entropy(cur[0].float(), ts)

        if op.endswith(".forward"):
            return (lambda: cur.__setitem__(0, next(it))), fwd

        def pre():
            cur[0] = next(it)
            for x in (cur[0] if mlp else (cur[0],)):
                x.grad = None
            if norm:
                mod.weight.grad = None  # as after zero_grad(set_to_none=True): no accumulation kernel
            out[0] = fwd()
        if kind == "eager_clamp":
            return pre, (lambda: torch.autograd.backward(out[0], (g, g)))
        return pre, (lambda: out[0].backward(g))
    return build


# the eager baseline's RoPE on q or k: broadcast, strided ATen ops that run 2.3-4.3x the copy roofline on the
# H200. Timed as a whole per head dim, over ROPE_ROWS (token, head) rows:
# x a (B, heads, S, hd) view of a (B, S, heads, hd) projection output, bf16 tables of (S, hd), as under amp
ROPE_HEAD_DIMS, ROPE_ROWS, ROPE_SEQ = (64, 128), 262144, 1024


def eager_rope_case(op: str, hd: int, rows: int = ROPE_ROWS, S: int = ROPE_SEQ):
    def build():
        import torch

        from llm_anatomy.baseline.attention import apply_rope

        heads = max(1, 1024 // hd)
        B = max(1, rows // (S * heads))
        bf = dict(device="cuda", dtype=torch.bfloat16)
        xs = [torch.randn(B, S, heads, hd, **bf).transpose(1, 2).requires_grad_() for _ in range(_sets(rows * hd * 12))]
        cos, sin = torch.randn(S, hd, **bf), torch.randn(S, hd, **bf)
        g = torch.randn(B, heads, S, hd, **bf)
        it, cur, out = itertools.cycle(xs), [xs[0]], [None]

        def fwd():
            return apply_rope(cur[0], cos, sin)
        if op.endswith(".forward"):
            return (lambda: cur.__setitem__(0, next(it))), fwd

        def pre():
            cur[0] = next(it)
            out[0] = fwd()
        # autograd.grad: the gradient as the chain leaves it, with no AccumulateGrad copy into a strided leaf
        return pre, (lambda: torch.autograd.grad(out[0], cur[0], g))
    return build
