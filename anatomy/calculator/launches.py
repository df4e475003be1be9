"""The kernels each variant's training step launches, with their FLOPs and minimal HBM bytes.

Pure Python over the config (no torch, no model), read off anatomy/baseline, anatomy/efficient and
Liger's fused linear CE. anatomy.calculator.timing times each one on a roofline.
"""
from __future__ import annotations

from dataclasses import dataclass

from anatomy.calculator import gpus
from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.fused import EAGER_CHAINS, dw_sum_bytes, fused_bytes, fused_launches
from anatomy.calculator.loss import chunk_rows as liger_chunk_rows
from anatomy.calculator.optimizer import step_bytes_moved
from anatomy.calculator.types import BYTES
from anatomy.config import ConfigError, ModelConfig, Run

VARIANTS = ("baseline", "efficient")
SDPA_BACKENDS = ("cudnn", "flash", "memory-efficient")


@dataclass(frozen=True)
class Kernel:
    name: str
    component: str
    phase: str
    kind: str  # matmul | sdpa | memory
    count: int = 1  # launches per step
    flops: int = 0  # per launch
    bytes: int = 0  # per launch: minimal HBM bytes read + written
    shape: tuple = ()  # matmul (batch, m, n, k); sdpa (B, heads, S, head_dim)
    dtype: str = "bfloat16"
    backend: str = ""
    host: str | None = "op"  # "op": one eager op; "rms_norm.forward": a custom-op call; None: inside another's
    calls: int | None = None  # host calls of `host` per step, where not one per launch (`count`)
    host_ops: int = 0  # eager ops this host call stands for in a profile that did not measure it (0: the default)
    loop: bool = False  # a per-chunk entry of Liger's loop: consecutive loop entries run chunk by chunk (pipeline.py)
    sync: bool = False  # the host waits for the GPU before this kernel (a new segment starts)
    order: int = 1  # execution order within the phase: 0 before the layers, 1 the layers, 2 after
    fused: tuple = ()  # (op, width, rows): an op `anatomy calibrate` timed at several widths (profile "fused_rows")
    accumulate: bool = False  # matmul: addmm into an fp32 accumulator (Liger's grad_weight under amp)


class _Ops:
    """Collects kernels; sizes in elements are turned into bytes with the policy's dtypes."""

    def __init__(self, cfg: ModelConfig, run: Run):
        self.cfg, self.run, self.k = cfg, run, []
        self.dt = dtypes(run)
        self.c, self.r, self.p = BYTES[self.dt.compute], BYTES[self.dt.residual], BYTES[self.dt.param]
        self.amp = self.dt.autocast

    def mem(self, name, comp, phase, read, write, count=1, host="op", sync=False, order=1, fused=(), **kw):
        """A memory-bound kernel launched `count` times, each reading and writing these bytes."""
        self.k.append(Kernel(name, comp, phase, "memory", count, 0, int(read + write), host=host, sync=sync,
                             order=order, fused=fused, **kw))

    def mm(self, name, comp, phase, m, n, k, count=1, batch=1, out=None, extra=0, host="op", order=1,
           accumulate=False, **kw):
        c = self.c
        nbytes = batch * ((m * k + k * n) * c + m * n * (out or c)) + extra
        self.k.append(Kernel(name, comp, phase, "matmul", count, 2 * batch * m * n * k, nbytes,
                             (batch, m, n, k), self.dt.compute, host=host, order=order, accumulate=accumulate, **kw))

    def linear(self, name, comp, d_in, d_out, count, in_bytes=None, order=(1, 1)):
        """An nn.Linear on T tokens. Under autocast an fp32 input is cast per call (in_bytes=4) and
        the fp32 weight is cast once per step; backward casts dW (bf16) back to fp32 and, for a cast
        input, dX back to the input's dtype."""
        T, c, p = self.run.tokens, self.c, self.p
        cast_in = self.amp and in_bytes is not None and in_bytes != c
        of, ob = order
        if cast_in:
            self.mem(f"{name}.input_cast", comp, "forward", T * d_in * in_bytes, T * d_in * c, count, order=of)
        if self.amp:
            self.mem(f"{name}.weight_cast", comp, "forward", d_out * d_in * p, d_out * d_in * c, count, order=of)
        self.mm(name, comp, "forward", T, d_out, d_in, count, order=of)
        self.mm(f"{name}.grad_input", comp, "backward", T, d_in, d_out, count, order=ob)
        self.mm(f"{name}.grad_weight", comp, "backward", d_out, d_in, T, count, order=ob)
        if self.amp:
            self.mem(f"{name}.grad_weight_cast", comp, "backward", d_out * d_in * c, d_out * d_in * p, count, order=ob)
        if cast_in:
            self.mem(f"{name}.grad_input_cast", comp, "backward", T * d_in * c, T * d_in * in_bytes, count, order=ob)


# ---- the kernels each variant launches ---------------------------------------------------------
def _embedding(o: _Ops) -> None:
    T, H, V, p = o.run.tokens, o.cfg.hidden, o.cfg.vocab, o.p
    o.mem("embedding.gather", "embedding", "forward", T * 8 + T * H * p, T * H * p, order=0)
    # embedding_dense_backward on CUDA: zero the (V, H) grad, then up to 3072 ids one feature kernel, else a
    # radix sort of the ids and a segmented row sum (~30 launches), at the rate calibrate measured for it as
    # a whole (amp: an fp32 gradient into fp32 weights). Host: one ATen call, 8 eager ops as before, at its start
    op = ("embedding.backward", H)
    n, (rd, wr) = fused_launches(*op, T), fused_bytes(*op, T, o.c, o.r)
    o.mem("embedding.backward.zero", "embedding", "backward", 0, V * H * p, order=2, calls=8)
    o.mem("embedding.backward", "embedding", "backward", rd / n, wr / n, n, order=2, host=None,
          fused=(*op, T) if (p, o.r) == (4, 4) else ())
    if o.cfg.tie_embeddings:
        o.mem("embedding.tied_grad_accumulate", "embedding", "backward", 2 * V * H * p, V * H * p, order=2)


def _rope_tables(o: _Ops, cast: bool) -> None:
    S, hd = o.run.seq, o.cfg.head_dim
    n = 9 + (2 if cast else 0)  # arange, div, pow, reciprocal, arange, outer, cat, cos, sin (+ casts)
    # built before the first layer: the probes book them to "other", with the residual adds
    o.mem("attention.rope_tables", "other", "forward", 4 * S * hd, 4 * S * hd, n, order=0)


def _residual(o: _Ops, comp: str, L: int, where: str = "other") -> None:
    """x + branch(x): the branch output is in the compute dtype, the stream in the residual dtype.
    Backward: the stream's gradient is cast to the branch's dtype (when they differ), and the
    gradients of the block input from its two readers (the add and the norm) are summed."""
    T, H, c, r = o.run.tokens, o.cfg.hidden, o.c, o.r
    # the add runs in the block, between the components' modules: "other", as the probes measure it
    # (under recompute both adds run inside the MLP's checkpoint: where="mlp")
    mixed = ("residual_add", H, T) if c != r else ()  # fp32 + bf16: calibrate times this add (ATen, unvectorized)
    o.mem(f"{comp}.residual_add", where, "forward", *fused_bytes("residual_add", H, T, c, r), L, fused=mixed)
    if c != r:
        # The add's backward node belongs to no component, so the probes' tracker leaves the label of
        # the node that ran before it: a norm's backward (the next block's, or the final norm's), or
        # the MLP's inside its checkpoint. Booked there, as measured (session5c: the norm's backward
        # held exactly these casts' time beyond its own kernels).
        o.mem(f"{comp}.residual_grad_cast", "mlp" if where == "mlp" else "norm", "backward", T * H * r, T * H * c, L)
    o.mem(f"norm.{comp}_input_grad_sum", "norm", "backward", 2 * T * H * r, T * H * r, L)


def efficient_kernels(cfg: ModelConfig, run: Run, sdpa_backend: str = "cudnn") -> list[Kernel]:
    """anatomy/efficient under the run's policy, on CUDA (cuDNN SDPA unless told otherwise)."""
    o = _Ops(cfg, run)
    if o.dt.compute != "bfloat16":
        raise ConfigError("the efficient variant's timing is modelled for bf16 compute (amp or bf16), where "
                          "its SDPA backends run")
    B, S, T, H, L = run.batch, run.seq, run.tokens, cfg.hidden, cfg.layers
    nh, hd, Hkv, I = cfg.heads, cfg.head_dim, cfg.kv_dim, cfg.intermediate
    D, c, r = H + 2 * Hkv, o.c, o.r
    _embedding(o)
    _rope_tables(o, cast=False)  # fp32 tables, built once per step
    # norms: read x (residual dtype), write y (compute dtype); backward reads dy, x, writes dx, and a
    # second launch sums the (programs, H) fp32 partials of dw
    n_norms = 2 * L + 1
    fw, bw = ("rms_norm.forward", H), ("rms_norm.backward", H)
    o.mem("norm.rms_norm", "norm", "forward", *fused_bytes(*fw, T, c, r), n_norms, host=fw[0], fused=(*fw, T))
    o.mem("norm.rms_norm.backward", "norm", "backward", *fused_bytes(*bw, T, c, r), n_norms, host=bw[0],
          fused=(*bw, T))
    o.mem("norm.rms_norm.dw_sum", "norm", "backward", *dw_sum_bytes(H, T), n_norms, host=None, fused=(*bw, T))
    # attention: one qkv matmul, fused split + RoPE, SDPA, o
    o.linear("attention.qkv", "attention", H, D, L)
    for ph, name in (("forward", "attention.rope_qkv"), ("backward", "attention.rope_qkv.backward")):
        op = (f"rope_qkv.{ph}", D)
        o.mem(name, "attention", ph, *fused_bytes(*op, T, c, r), L, host=op[0], fused=(*op, T))
    F = gpus.causal_attention_flops(B, nh, S, hd)
    io = T * (H + 2 * Hkv) * c  # q, k, v
    o.k.append(Kernel("attention.sdpa", "attention", "forward", "sdpa", L, F, io + T * H * c + B * nh * S * 4,
                      (B, nh, S, hd), "bfloat16", sdpa_backend))
    o.k.append(Kernel("attention.sdpa.backward", "attention", "backward", "sdpa", L, 5 * F // 2,
                      2 * io + 2 * T * H * c + B * nh * S * 4, (B, nh, S, hd), "bfloat16", sdpa_backend))
    if sdpa_backend == "cudnn":
        # cuDNN's call launches small kernels around its main one (every H200 trace): a memset of its
        # (B, heads, S) fp32 row statistics in each phase; in backward, dot(dO, O) per row, which also
        # zeroes the fp32 dQ accumulator, then dQ converted to the compute dtype
        o.mem("attention.sdpa.memset", "attention", "forward", 0, B * nh * S * 4, L, host=None)
        o.mem("attention.sdpa.backward.memset", "attention", "backward", 0, B * nh * S * 4, L, host=None)
        o.mem("attention.sdpa.dot_do_o", "attention", "backward", 2 * T * H * c, B * nh * S * 4 + T * H * 4, L,
              host=None)
        o.mem("attention.sdpa.convert_dq", "attention", "backward", T * H * 4, T * H * c, L, host=None)
    if cfg.kv_heads < nh and sdpa_backend == "cudnn":
        # under GQA cuDNN's backward writes dK, dV per query head in fp32 and sums each group after
        # (fmha_reduce_head in the H200 traces): read 2 (T, H) fp32, write 2 (T, Hkv) in the compute dtype
        o.mem("attention.sdpa.gqa_reduce", "attention", "backward", 2 * T * H * 4, 2 * T * Hkv * c, L, host=None)
    o.linear("attention.o", "attention", H, H, L)  # its input is a view of SDPA's output: no copy
    recompute = run.recompute == "mlp"
    _residual(o, "attention", L, "mlp" if recompute else "other")
    # MLP: one gate_up matmul, the fused activation (saves gate_up; backward writes dgate/dup in place)
    o.linear("mlp.gate_up", "mlp", H, 2 * I, L)
    for ph, name in (("forward", "mlp.swiglu"), ("backward", "mlp.swiglu.backward")):
        op = (f"swiglu.{ph}", I)
        o.mem(name, "mlp", ph, *fused_bytes(*op, T, c, r), L, host=op[0], fused=(*op, T))
    # (swiglu_packed owns the split, so no SplitBackward cats dgate and dup: d(gate_up) is gate_up's storage)
    o.linear("mlp.down", "mlp", I, H, L)
    _residual(o, "mlp", L, "mlp" if recompute else "other")
    if recompute:  # what the checkpoints run again in backward (early stop: no qkv, no down matmul)
        o.mem("norm.rms_norm.recompute", "norm", "backward", *fused_bytes(*fw, T, c, r), 2 * L, host=fw[0],
              fused=(*fw, T))
        o.mem("mlp.residual_add.recompute", "mlp", "backward", T * H * (r + c), T * H * r, L)
        o.mm("mlp.gate_up.recompute", "mlp", "backward", T, 2 * I, H, L)
        sw = ("swiglu.forward", I)
        o.mem("mlp.swiglu.recompute", "mlp", "backward", *fused_bytes(*sw, T, c, r), L, host=sw[0], fused=(*sw, T))
        if o.amp:  # autocast's weight casts are made again too (its cache ends with each forward)
            p = o.p
            for name, comp, n in (("attention.qkv", "attention", D * H), ("mlp.gate_up", "mlp", 2 * I * H),
                                  ("mlp.down", "mlp", I * H)):
                o.mem(f"{name}.weight_cast.recompute", comp, "backward", n * p, n * c, L)
    _liger_loss(o)
    return o.k


def _liger_loss(o: _Ops) -> None:
    """Liger's fused linear CE (liger_kernel 0.8.x, ops/fused_linear_cross_entropy.py): per chunk of C
    rows, logits = x_c Wᵀ (C, V); one Triton kernel reads each row twice (max/sum, then the gradient)
    and writes d(logits) in place; grad_input rows = d(logits) W; grad_weight += d(logits)ᵀ x_c. All
    three matmuls run in forward; backward only checks that the incoming gradient is 1.

    Host: calibrate times the call as the model makes it (calibrate_host.measure_liger_host), so one
    entry carries each measured part: the call's fixed forward (liger_ce.forward), each chunk's Python
    (liger_ce.chunk: slices, the autocast matmuls, a Triton launch of 25 keyword arguments, the
    copies) and the backward (liger_ce.backward); the other entries are issued inside those. host_ops
    is what each part counts as in eager ops where a profile did not measure it."""
    T, H, V, c, p = o.run.tokens, o.cfg.hidden, o.cfg.vocab, o.c, o.p
    C = liger_chunk_rows(T, H, V)
    full, rest = divmod(T, C)
    o.mem("loss.count_targets", "loss", "forward", T * 8, 8, 2, sync=True, order=2, host=None)  # target != -100, sum, .item()
    o.mem("loss.zero_grad_input", "loss", "forward", 0, T * H * c, order=2, host="liger_ce.forward",
          host_ops=6 + o.amp)  # 3 zeros, the count (2), the loss sum; under amp the weight's cast
    o.mem("loss.zero_grad_weight", "loss", "forward", 0, V * H * p, order=2, host=None)
    o.mem("loss.zero_losses", "loss", "forward", 0, T * 4, order=2, host=None)
    if o.amp:
        # the fp32 weight reaches autocast mms inside the Function. `grad_logits @ weight` casts the
        # leaf once and autocast caches it; `x @ weight.t()` casts the transposed view, not a leaf,
        # anew in every chunk (both casts show in the H200 memory probe: calculator/memory.py)
        o.mem("loss.lm_head.weight_cast", "loss", "forward", V * H * p, V * H * c, order=2, host=None)
    for rows, n in ((C, full), (rest, 1 if rest else 0)):
        if not n:
            continue
        chunk = dict(order=2, loop=True, host=None)
        if o.amp:
            o.mem("loss.lm_head.weight_t_cast", "loss", "forward", V * H * p, V * H * c, n, **chunk)
        o.mm("loss.logits", "loss", "forward", rows, V, H, n, **dict(chunk, host="liger_ce.chunk"),
             host_ops=4 + 2 * o.amp)
        o.mem("loss.cross_entropy", "loss", "forward", *fused_bytes("liger_ce", V, rows, c), n,
              fused=("liger_ce", V, rows) if c == 2 else (), **chunk)
        o.mm("loss.grad_input", "loss", "forward", rows, H, V, n, **chunk)
        if o.amp:  # fp32 weight: no mm(out=), so the product is copied into grad_input's rows
            o.mem("loss.grad_input_copy", "loss", "forward", rows * H * c, rows * H * c, n, **chunk)
        # addmm into grad_weight (the weight's dtype): reads and writes the (V, H) accumulator every chunk
        # (under amp the accumulator is fp32: Liger's addmm(out_dtype=fp32), a slower kernel family)
        o.mm("loss.grad_weight", "loss", "forward", V, H, rows, n, extra=2 * V * H * p - V * H * c,
             accumulate=p == 4 and c == 2, **chunk)
    o.mem("loss.sum", "loss", "forward", T * 4, 4, order=2, host=None)
    o.mem("loss.backward_check", "loss", "backward", 8, 8, 2, sync=True, order=0, host="liger_ce.backward", calls=1,
          host_ops=2)  # ones_like seed; torch.equal(g, 1)


def baseline_kernels(cfg: ModelConfig, run: Run) -> list[Kernel]:
    """anatomy/baseline: every elementwise op is its own kernel, attention materialises S x S."""
    o = _Ops(cfg, run)
    B, S, T, H, L = run.batch, run.seq, run.tokens, cfg.hidden, cfg.layers
    nh, nkv, Hkv, I, V = cfg.heads, cfg.kv_heads, cfg.kv_dim, cfg.intermediate, cfg.vocab
    c, r = o.c, o.r
    _embedding(o)
    _rope_tables(o, cast=c != 4)  # the tables are cast to the compute dtype
    # norm in fp32 ops on a (T, H) stream of dtype r (fused.eager_norm_*), at the rate calibrate measured for
    # the chain as a whole where it did (amp: an fp32 stream and bf16 compute)
    n = 2 * L + 1
    for ph in ("forward", "backward"):
        op = f"eager_norm.{ph}"
        for name, rd, wr in EAGER_CHAINS[op](T, H, c, r):
            o.mem(f"norm.{name}", "norm", ph, rd, wr, n, fused=(op, H, T) if (c, r) == (2, 4) else ())
    # attention: q, k, v each cast the stream's normed x under amp; RoPE as 5 ops per tensor
    for name, width in (("q", H), ("k", Hkv), ("v", Hkv)):
        o.linear(f"attention.{name}", "attention", H, width, L, in_bytes=r)
    o.mem("attention.qkv_input_grad_sum", "attention", "backward", 2 * T * H * r, T * H * r, 2 * L)  # 3 grads: 2 adds
    for name, heads in (("q", nh), ("k", nkv)):  # x*cos + cat(-x2, x1)*sin (fused.eager_rope_*), calibrated per hd
        for ph, suffix in (("forward", ""), ("backward", ".backward")):
            op = f"eager_rope.{ph}"
            for kname, rd, wr in EAGER_CHAINS[op](T * heads, cfg.head_dim, c, r):
                o.mem(f"attention.rope_{name}.{kname}{suffix}", "attention", ph, rd, wr, L,
                      fused=(op, cfg.head_dim, T * heads) if c == 2 else ())
    # torch.matmul reshapes (B, nh, S, hd) operands laid out (B, S, nh, hd) to (B*nh, S, hd): a copy
    # each (repeat_kv's copy replaces it for k, v under GQA); their gradients' views copy back
    for name, width in (("q", H), ("k", Hkv), ("v", Hkv)):
        full = T * H * c
        if name != "q" and nkv != nh:
            o.mem(f"attention.repeat_kv_{name}", "attention", "forward", T * width * c, full, L)
            o.mem(f"attention.repeat_kv_{name}.backward", "attention", "backward", full, T * width * c, L)
        else:
            o.mem(f"attention.{name}_layout_copy", "attention", "forward", T * width * c, T * width * c, L)
        o.mem(f"attention.{name}_grad_layout_copy", "attention", "backward", T * width * c, T * width * c, L)
    U = B * nh * S * S  # one S x S score tensor, in elements
    o.mem("attention.causal_mask_full", "attention", "forward", 0, S * S * c, order=0)  # once per step
    o.mem("attention.causal_mask_triu", "attention", "forward", S * S * c, S * S * c, order=0)
    o.mm("attention.scores", "attention", "forward", S, S, cfg.head_dim, L, batch=B * nh)
    casts = c != 4  # scores.float() and probs.to(q.dtype) copy unless the compute dtype is fp32
    R = B * nh * S  # rows of S scores
    # calibrate times each of these eager ops over S-wide rows (fused.fused_bytes "sxs.*"): ATen runs the
    # fp32 softmax, the bf16 -> fp32 cast and the broadcast mask add well under the copy roofline
    sxs = lambda op: (op, S, R) if c == 2 or op.startswith("sxs.softmax") else ()  # noqa: E731 (calibrated in bf16)
    for op, rd, wr, cal in (("scale", U * c, U * c, "sxs.scale"), ("mask_add", U * c, U * c, "sxs.mask_add"),
                            ("float", U * c, U * 4, "sxs.float"), ("softmax", U * 4, U * 4, "sxs.softmax"),
                            ("to_compute", U * 4, U * c, "sxs.to_compute")):
        if casts or op not in ("float", "to_compute"):
            o.mem(f"attention.{op}", "attention", "forward", rd, wr, L, fused=sxs(cal))
    o.mm("attention.probs_v", "attention", "forward", S, cfg.head_dim, S, L, batch=B * nh)
    o.mem("attention.merge_heads_copy", "attention", "forward", T * H * c, T * H * c, L)
    o.mem("attention.grad_out_layout_copy", "attention", "backward", T * H * c, T * H * c, L)
    o.mm("attention.probs_v.grad_probs", "attention", "backward", S, S, cfg.head_dim, L, batch=B * nh)
    o.mm("attention.probs_v.grad_v", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    for op, rd, wr, cal in (("to_compute.backward", U * c, U * 4, "sxs.float"),
                            ("softmax.backward", 2 * U * 4, U * 4, "sxs.softmax.backward"),
                            ("float.backward", U * 4, U * c, "sxs.to_compute"), ("scale.backward", U * c, U * c, "sxs.scale")):
        if casts or op not in ("float.backward", "to_compute.backward"):
            o.mem(f"attention.{op}", "attention", "backward", rd, wr, L, fused=sxs(cal))
    o.mm("attention.scores.grad_q", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    o.mm("attention.scores.grad_k", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    o.linear("attention.o", "attention", H, H, L)  # its input (merged heads) is already compute dtype
    _residual(o, "attention", L)
    # MLP: gate and up each cast x under amp; silu and mul are separate kernels
    o.linear("mlp.gate", "mlp", H, I, L, in_bytes=r)
    o.linear("mlp.up", "mlp", H, I, L, in_bytes=r)
    o.mem("mlp.gate_up_input_grad_sum", "mlp", "backward", 2 * T * H * r, T * H * r, L)
    # silu and mul (fused.eager_mlp_*), and gpt-oss's clamps and +1 before them (eager_clamp_*), each chain at the
    # rate calibrate measured for it as a whole where it did (bf16 compute)
    chains = ("eager_mlp",) + (("eager_clamp",) if cfg.mlp == "gpt-oss" else ())
    for ph in ("forward", "backward"):
        for op in (f"{ch}.{ph}" for ch in chains):
            for name, rd, wr in EAGER_CHAINS[op](T, I, c, r):
                o.mem(f"mlp.{name}", "mlp", ph, rd, wr, L, fused=(op, I, T) if c == 2 else ())
    o.linear("mlp.down", "mlp", I, H, L)
    _residual(o, "mlp", L)
    # loss: lm_head on the normed stream (cast under amp), logits upcast to fp32, log_softmax + nll
    # (fused.eager_ce_*), at the rate calibrate measured for that tail as a whole where it did (bf16 logits)
    o.linear("loss.lm_head", "loss", H, V, 1, in_bytes=r, order=(2, 0))
    for ph in ("forward", "backward"):
        op = f"eager_ce.{ph}"
        for name, rd, wr in EAGER_CHAINS[op](T, V, c, r):
            o.mem(f"loss.{name}", "loss", ph, rd, wr, order=2 if ph == "forward" else 0,
                  fused=(op, V, T) if c == 2 else ())
    return o.k


def param_sizes(cfg: ModelConfig, variant: str) -> dict[int, int]:
    """{elements: how many parameter tensors of that size} in the variant's module tree (the efficient
    model holds qkv and gate_up as one tensor each; a tied head is the embedding's tensor)."""
    H, I, V, kv, L = cfg.hidden, cfg.intermediate, cfg.vocab, cfg.kv_dim, cfg.layers
    per_layer = ([(H + 2 * kv) * H, H * H, 2 * I * H, I * H] if variant == "efficient"
                 else [H * H, kv * H, kv * H, H * H, I * H, I * H, H * I])
    sizes = [V * H] * (1 if cfg.tie_embeddings else 2) + [H] * (2 * L + 1) + per_layer * L
    out: dict[int, int] = {}
    for n in sizes:
        out[n] = out.get(n, 0) + 1
    return out


def optimizer_kernels(cfg: ModelConfig, run: Run, variant: str, optimizer: str = "ademamix") -> list[Kernel]:
    """One optimizer step, per group of same-size parameter tensors. efficient: AdEMAMix compiled (or
    a fused torch optimizer) makes one read-modify-write pass per tensor, the minimum of
    calculator/optimizer.py, at the rate calibrate measured for it where it did (fused_efficiency:
    torch's fused AdamW). baseline: the AdEMAMix loop, 15 kernels per tensor that move 38 fp32
    passes per element between them (bf16 params: 3 casts and 18 B more)."""
    pb = BYTES[dtypes(run).param]
    out = []
    for numel, n in sorted(param_sizes(cfg, variant).items()):
        if variant == "baseline" and optimizer == "ademamix":
            launches = 15 + (3 if pb != 4 else 0)
            per = numel * (38 * 4 + (18 if pb != 4 else 0)) // launches
            out.append(Kernel(f"optimizer.ademamix_loop[{numel}]", "optimizer", "optimizer", "memory", n * launches, 0,
                              per))
        else:
            nbytes = step_bytes_moved(numel, optimizer, param_bytes=pb, grad_bytes=pb)
            out.append(Kernel(f"optimizer.{optimizer}_fused[{numel}]", "optimizer", "optimizer", "memory", n, 0,
                              nbytes, fused=(f"optimizer.{optimizer}", numel)))
    return out


def kernels(cfg: ModelConfig, run: Run, variant: str, sdpa_backend: str | None = None,
            optimizer: str | None = "ademamix") -> list[Kernel]:
    if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
        raise ConfigError(f"unknown SDPA backend {sdpa_backend!r}; choose from {', '.join(SDPA_BACKENDS)}")
    if variant == "efficient":
        ks = efficient_kernels(cfg, run, sdpa_backend or "cudnn")
    elif variant == "baseline":
        ks = baseline_kernels(cfg, run)
    else:
        raise ConfigError(f"timing has no {variant!r} variant; choose from {', '.join(VARIANTS)}")
    return ks + (optimizer_kernels(cfg, run, variant, optimizer) if optimizer else [])


def standalone_kernels(op: str, cfg: ModelConfig, batch: int, seq: int) -> list[Kernel]:
    """One bf16 fused op, forward + backward, as bench/kernels.py times it (leaves, no autocast,
    a random upstream gradient): "rmsnorm", "swiglu", "rope_qkv" (ours) or "linear_ce" (Liger)."""
    o = _Ops(cfg, Run(batch, seq, "bf16"))
    T, H, I, D, c = o.run.tokens, cfg.hidden, cfg.intermediate, cfg.hidden + 2 * cfg.kv_dim, o.c
    if op == "rmsnorm":
        o.mem("rms_norm", "norm", "forward", T * H * c, T * H * c, host="rms_norm.forward")
        o.mem("rms_norm.backward", "norm", "backward", 2 * T * H * c, T * H * c, host="rms_norm.backward")
        o.mem("rms_norm.dw_sum", "norm", "backward", *dw_sum_bytes(H, T), host=None)
    elif op == "swiglu":  # gate and up are separate leaves here: backward writes new dgate, dup
        o.mem("swiglu", "mlp", "forward", 2 * T * I * c, T * I * c, host="swiglu.forward")
        o.mem("swiglu.backward", "mlp", "backward", 3 * T * I * c, 2 * T * I * c, host="swiglu.backward")
    elif op == "rope_qkv":
        o.mem("rope_qkv", "attention", "forward", T * D * c, T * D * c, host="rope_qkv.forward")
        o.mem("rope_qkv.backward", "attention", "backward", T * D * c, T * D * c, host="rope_qkv.backward")
    elif op == "linear_ce":
        _liger_loss(o)  # a random upstream gradient: backward scales grad_input and grad_weight
        o.mem("loss.grad_input_mul", "loss", "backward", T * H * c, T * H * c)
        o.mem("loss.grad_weight_mul", "loss", "backward", cfg.vocab * H * c, cfg.vocab * H * c)
    else:
        raise ConfigError(f"no standalone model for {op!r}")
    return o.k
