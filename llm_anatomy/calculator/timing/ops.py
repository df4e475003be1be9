"""One kernel entry of a training step (Kernel), and the builder the kernel lists use (Ops): it prices a
memory-bound kernel by its minimal HBM bytes and a matmul by its FLOPs and operand bytes, in the run's
dtypes, and holds the pieces both variants share (the embedding, RoPE's tables, the residual adds).

Counts are per step: an entry of the layers (order 1) carries `count = layers x per-layer launches`, so a
list's length does not grow with the layer count (pipeline.py spreads the launches over the layers).
"""
from __future__ import annotations

from typing import NamedTuple

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.timing.op_bytes import EAGER_CHAINS, fused_bytes
from llm_anatomy.calculator.timing.registry import launches
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import ModelConfig, Run


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Forward FLOPs of causal SDPA, causal convention (ANCHORS.md): QKᵀ and PV, half the square."""
    return 2 * batch * heads * seq * seq * head_dim


MASKED = "cudnn-masked"  # the backend of cuDNN's SDPA under an additive mask: its own rate (roofline.masked_rate)


def masked_attention_flops(batch: int, heads: int, seq: int, keys: int, head_dim: int) -> int:
    """Forward FLOPs of SDPA under an additive mask, as FlopCounterMode counts the call: QKᵀ and PV over every
    (query, key) pair (the kernel skips no block: the mask is data), at the head dim it is called with."""
    return 4 * batch * heads * seq * keys * head_dim


class Kernel(NamedTuple):
    """One kernel entry: immutable, and a tuple underneath (a step builds a hundred of these per estimate;
    a tuple is made several times faster than a frozen dataclass)."""
    name: str
    component: str
    phase: str
    kind: str  # matmul | sdpa | memory | host (host work alone: no GPU time, no launch)
    count: int = 1  # launches per step
    flops: int = 0  # per launch
    bytes: int = 0  # per launch: minimal HBM bytes read + written
    shape: tuple = ()  # matmul (batch, m, n, k); sdpa (B, heads, S, head_dim); an optimizer call (tensors,)
    dtype: str = "bfloat16"
    backend: str = ""
    host: str | None = "op"  # "op": one eager op; "rms_norm.forward": a custom-op call; None: inside another's
    calls: int | None = None  # host calls of `host` per step, where not one per launch (`count`)
    host_ops: int = 0  # eager ops this host call stands for in a profile that did not measure it (0: the default)
    loop: bool = False  # a per-chunk entry of Liger's loop: consecutive loop entries run chunk by chunk (pipeline.py)
    sync: bool = False  # the host waits for the GPU before this kernel (a new segment starts)
    order: int = 1  # execution order within the phase: 0 before the layers, 1 the layers, 2 after
    fused: tuple = ()  # (op, width, rows): a registry op (registry.OPS) timed at its calibrated efficiency
    accumulate: bool = False  # matmul: addmm into an fp32 accumulator (Liger's grad_weight under amp)
    op_phase: str = ""  # sdpa: the kernel's own pass where it is not `phase` (a recompute's forward in backward)


_tuple_new = tuple.__new__
assert Kernel._fields == ("name", "component", "phase", "kind", "count", "flops", "bytes", "shape", "dtype", "backend",
                          "host", "calls", "host_ops", "loop", "sync", "order", "fused", "accumulate", "op_phase")


class Ops:
    """Collects kernels; sizes in elements are turned into bytes with the policy's dtypes."""

    def __init__(self, cfg: ModelConfig, run: Run):
        self.cfg, self.run, self.k = cfg, run, []
        self.dt = dtypes(run)
        self.c, self.r, self.p = BYTES[self.dt.compute], BYTES[self.dt.residual], BYTES[self.dt.param]
        self.amp = self.dt.autocast

    def mem(self, name, comp, phase, read, write, count=1, host="op", sync=False, order=1, fused=(), calls=None,
            host_ops=0, loop=False, upcast=False):
        """A memory-bound kernel launched `count` times, each reading and writing these bytes. upcast: a widening
        cast (bf16 -> fp32), which torch runs in its unrolled cast kernel, not the vectorized copy: its backend is
        "upcast", priced at the profile's upcast_bw (roofline.kernel_terms)."""
        # Kernel(...) with these fields, made as its tuple (a step's lists make a hundred of these per estimate)
        self.k.append(_tuple_new(Kernel, (name, comp, phase, "memory", count, 0, int(read + write), (), "bfloat16",
                                          "upcast" if upcast else "",
                                          host, calls, host_ops, loop, sync, order, fused, False, "")))

    def chain(self, op, prefix, comp, phase, width, rows, count=1, order=1, fused=(), suffix="", stream=None):
        """One memory-bound kernel per op of the eager chain `op` over `rows` rows of `width`
        (op_bytes.EAGER_CHAINS), named prefix + the op's name + suffix, each launched `count` times: mem()'s
        entries, made in one pass. fused: the chain's calibration (registry op, width, rows), where it has one.
        stream: the bytes of the chain's input dtype (default: the residual stream's)."""
        self.k += [_tuple_new(Kernel, (f"{prefix}{name}{suffix}", comp, phase, "memory", count, 0, int(rd + wr), (),
                                       "bfloat16", "", "op", None, 0, False, False, order, fused, False, ""))
                   for name, rd, wr in EAGER_CHAINS[op](rows, width, self.c, stream or self.r)]

    def mm(self, name, comp, phase, m, n, k, count=1, batch=1, out=None, extra=0, host="op", order=1,
           accumulate=False, host_ops=0, loop=False, grouped=""):
        """A GEMM; grouped: "forward" | "backward", a torch._grouped_mm over the experts, priced at the dense
        rate of its (m, n, k) times the profile's grouped fraction for that role (roofline.kernel_terms)."""
        c = self.c
        nbytes = batch * ((m * k + k * n) * c + m * n * (out or c)) + extra
        self.k.append(_tuple_new(Kernel, (name, comp, phase, "matmul", count, 2 * batch * m * n * k, nbytes,
                                          (batch, m, n, k), self.dt.compute, "", host, None, host_ops, loop, False,
                                          order, (("grouped_mm", grouped) if grouped else ()), accumulate, "")))

    def linear(self, name, comp, d_in, d_out, count, in_bytes=None, order=(1, 1), bias=False, fp32_grad=False):
        """An nn.Linear on T tokens. Under autocast an fp32 input is cast per call (in_bytes=4) and
        the fp32 weight is cast once per step; backward casts dW (bf16) back to fp32 (unless fp32_grad:
        the GEMM writes it in fp32, llm_anatomy/kernels/lean.py) and, for a cast input, dX back to the input's
        dtype. A bias is read by the matmul (addmm: cuBLASLt's bias epilogue); its gradient is a separate
        sum over the T rows of the output's gradient."""
        T, c, p = self.run.tokens, self.c, self.p
        fp32_grad = fp32_grad and self.amp
        cast_in = self.amp and in_bytes is not None and in_bytes != c
        of, ob = order
        if cast_in:
            self.mem(f"{name}.input_cast", comp, "forward", T * d_in * in_bytes, T * d_in * c, count, order=of)
        if self.amp:
            self.mem(f"{name}.weight_cast", comp, "forward", d_out * d_in * p, d_out * d_in * c, count, order=of)
            if bias:
                self.mem(f"{name}.bias_cast", comp, "forward", d_out * p, d_out * c, count, order=of)
        self.mm(name, comp, "forward", T, d_out, d_in, count, order=of, extra=d_out * c if bias else 0)
        self.mm(f"{name}.grad_input", comp, "backward", T, d_in, d_out, count, order=ob)
        self.mm(f"{name}.grad_weight", comp, "backward", d_out, d_in, T, count, order=ob, out=p if fp32_grad else None)
        if bias:
            self.mem(f"{name}.grad_bias", comp, "backward", T * d_out * c, d_out * c, count, order=ob)
        if self.amp and not fp32_grad:
            self.mem(f"{name}.grad_weight_cast", comp, "backward", d_out * d_in * c, d_out * d_in * p, count, order=ob,
                     upcast=True)
            if bias:
                self.mem(f"{name}.grad_bias_cast", comp, "backward", d_out * c, d_out * p, count, order=ob, upcast=True)
        if cast_in:
            self.mem(f"{name}.grad_input_cast", comp, "backward", T * d_in * c, T * d_in * in_bytes, count, order=ob,
                     upcast=in_bytes > c)


def embedding(o: Ops) -> None:
    T, H, V, p = o.run.tokens, o.cfg.hidden, o.cfg.vocab, o.p
    o.mem("embedding.gather", "embedding", "forward", T * 8 + T * H * p, T * H * p, order=0)
    # embedding_dense_backward on CUDA: zero the (V, H) grad, then up to 3072 ids one feature kernel, else a
    # radix sort of the ids and a segmented row sum (~30 launches), at the rate calibrate measured for it as
    # a whole (amp: an fp32 gradient into fp32 weights). Host: one ATen call, as 8 eager ops, at its start
    op = ("embedding.backward", H)
    n, (rd, wr) = launches(*op, T), fused_bytes(*op, T, o.c, o.r)
    o.mem("embedding.backward.zero", "embedding", "backward", 0, V * H * p, order=2, calls=8)
    o.mem("embedding.backward", "embedding", "backward", rd / n, wr / n, n, order=2, host=None,
          fused=(*op, T) if (p, o.r) == (4, 4) else ())
    if o.cfg.tie_embeddings:
        o.mem("embedding.tied_grad_accumulate", "embedding", "backward", 2 * V * H * p, V * H * p, order=2)


def rope_tables(o: Ops, cast: bool) -> None:
    S, hd = o.run.seq, o.cfg.head_dim
    n = 9 + (2 if cast else 0)  # arange, div, pow, reciprocal, arange, outer, cat, cos, sin (+ casts)
    # built before the first layer: the probes book them to "other", with the residual adds
    o.mem("attention.rope_tables", "other", "forward", 4 * S * hd, 4 * S * hd, n, order=0)


def residual(o: Ops, comp: str, L: int, where: str = "other") -> None:
    """x + branch(x): the branch output is in the compute dtype, the stream in the residual dtype.
    Backward: the stream's gradient is cast to the branch's dtype (when they differ), and the
    gradients of the block input from its two readers (the add and the norm) are summed."""
    T, H, c, r = o.run.tokens, o.cfg.hidden, o.c, o.r
    # the add runs in the block, between the components' modules: "other", as the probes measure it
    # (under recompute="mlp" both adds run inside the MLP's checkpoint: where="mlp"; under "full" inside the
    # block's, a module credited to attention: where="attention")
    mixed = ("residual_add", H, T) if c != r else ()  # fp32 + bf16: calibrate times this add (ATen, unvectorized)
    o.mem(f"{comp}.residual_add", where, "forward", *fused_bytes("residual_add", H, T, c, r), L, fused=mixed)
    if c != r:
        # Attribution rule (measure/components.py's tracker): an autograd node of no component keeps the
        # label of the node that ran before it. The add's backward is such a node, and the node before it
        # is a norm's backward (the next block's, or the final norm's), or the MLP's inside its checkpoint:
        # so its cast is credited there, in the model as in the measurement. Inside a checkpoint module the
        # add's node is that module's, and so is its cast.
        o.mem(f"{comp}.residual_grad_cast", where if where != "other" else "norm", "backward", T * H * r, T * H * c, L)
    o.mem(f"norm.{comp}_input_grad_sum", "norm", "backward", 2 * T * H * r, T * H * r, L)
