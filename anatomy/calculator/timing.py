"""Step time from first principles: every kernel a training step launches, timed on a roofline.

Pure Python over the config (no torch, no model). estimate_time(cfg, run, variant, gpu) lists, per
component and phase, the kernels the variant's code launches (read off anatomy/baseline and
anatomy/efficient, and Liger's fused linear CE for the efficient loss), each with its FLOPs and its
minimal HBM bytes, and predicts each one as

    t = max(FLOPs / rate, bytes / bandwidth) + launch        bound = whichever term is larger

  matmul   rate = the profile's asymptotic GEMM rate x matmul_efficiency(m, n, k) (gpus.py:
           tile and wave quantization over the SMs, split-K for skinny weight gradients)
  sdpa     rate = the profile's measured rate for that backend and head dim, scaled by the
           wave quantization of (batch x heads x 128-row query blocks) against the measured shape
  memory   elementwise and fused kernels: FLOPs ignored (≤ ~10 per element, far under the ridge)

Assumptions (each is a source of error, listed in docs/timing.md):
  1. Kernels run back to back: the step's GPU time is their sum (no overlap between kernels).
  2. Memory-bound kernels move exactly their minimal bytes at the copy bandwidth: no L2 reuse,
     no re-reads inside a kernel (softmax rows, Liger's CE reading each logit twice is counted).
  3. Compute and memory overlap perfectly inside a kernel (the max, not the sum).
  4. The host issues work asynchronously. Between two host syncs (Liger's .item() before the
     loss, torch.equal in its backward) a segment takes max(GPU time, host issue time): the host
     figure is per eager op, or per custom-op call, from the profile.
  5. The optimizer is its own phase, after backward (bench/step.py times forward + backward only).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from anatomy.calculator import estimate
from anatomy.calculator import gpus
from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.optimizer import step_bytes_moved
from anatomy.calculator.types import BYTES
from anatomy.config import ConfigError, ModelConfig, Run

VARIANTS = ("baseline", "efficient")
SDPA_BACKENDS = ("cudnn", "flash", "memory-efficient")
PHASES = ("forward", "backward", "optimizer")
CUSTOM_FALLBACK_OPS = 3  # a custom-op call with no measured host cost: as 3 eager ops (dispatch + autograd + launch)


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
    sync: bool = False  # the host waits for the GPU before this kernel (a new segment starts)
    order: int = 1  # execution order within the phase: 0 before the layers, 1 the layers, 2 after


class _Ops:
    """Collects kernels; sizes in elements are turned into bytes with the policy's dtypes."""

    def __init__(self, cfg: ModelConfig, run: Run):
        self.cfg, self.run, self.k = cfg, run, []
        self.dt = dtypes(run)
        self.c, self.r, self.p = BYTES[self.dt.compute], BYTES[self.dt.residual], BYTES[self.dt.param]
        self.amp = self.dt.autocast

    def mem(self, name, comp, phase, read, write, count=1, host="op", sync=False, order=1):
        """A memory-bound kernel launched `count` times, each reading and writing these bytes."""
        self.k.append(Kernel(name, comp, phase, "memory", count, 0, int(read + write), host=host, sync=sync,
                             order=order))

    def mm(self, name, comp, phase, m, n, k, count=1, batch=1, out=None, extra=0, host="op", order=1):
        c = self.c
        nbytes = batch * ((m * k + k * n) * c + m * n * (out or c)) + extra
        self.k.append(Kernel(name, comp, phase, "matmul", count, 2 * batch * m * n * k, nbytes,
                             (batch, m, n, k), self.dt.compute, host=host, order=order))

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
    # embedding_dense_backward on CUDA: sort the ids, count, zero the (V, H) grad, then a segmented
    # row sum: ~8 launches (their bytes spread evenly); the sort's passes count as 4 x (ids + positions)
    moved = T * H * o.r + 4 * T * 16 + V * H * p + min(T, V) * H * p
    o.mem("embedding.backward", "embedding", "backward", moved // 8, 0, 8, order=2)
    if o.cfg.tie_embeddings:
        o.mem("embedding.tied_grad_accumulate", "embedding", "backward", 2 * V * H * p, V * H * p, order=2)


def _rope_tables(o: _Ops, cast: bool) -> None:
    S, hd = o.run.seq, o.cfg.head_dim
    n = 9 + (2 if cast else 0)  # arange, div, pow, reciprocal, arange, outer, cat, cos, sin (+ casts)
    o.mem("attention.rope_tables", "attention", "forward", 4 * S * hd, 4 * S * hd, n, order=0)


def _residual(o: _Ops, comp: str, L: int) -> None:
    """x + branch(x): the branch output is in the compute dtype, the stream in the residual dtype.
    Backward: the stream's gradient is cast to the branch's dtype (when they differ), and the
    gradients of the block input from its two readers (the add and the norm) are summed."""
    T, H, c, r = o.run.tokens, o.cfg.hidden, o.c, o.r
    o.mem(f"{comp}.residual_add", comp, "forward", T * H * (r + c), T * H * r, L)
    if c != r:
        o.mem(f"{comp}.residual_grad_cast", comp, "backward", T * H * r, T * H * c, L)
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
    o.mem("norm.rms_norm", "norm", "forward", T * H * r, T * H * c, n_norms, host="rms_norm.forward")
    o.mem("norm.rms_norm.backward", "norm", "backward", T * H * (c + r), T * H * r, n_norms, host="rms_norm.backward")
    o.mem("norm.rms_norm.dw_sum", "norm", "backward", 4 * rms_norm_programs(H) * H, 4 * H, n_norms, host=None)
    # attention: one qkv matmul, fused split + RoPE, SDPA, o
    o.linear("attention.qkv", "attention", H, D, L)
    o.mem("attention.rope_qkv", "attention", "forward", T * D * c, T * D * c, L, host="rope_qkv.forward")
    o.mem("attention.rope_qkv.backward", "attention", "backward", T * D * c, T * D * c, L, host="rope_qkv.backward")
    F = gpus.causal_attention_flops(B, nh, S, hd)
    io = T * (H + 2 * Hkv) * c  # q, k, v
    o.k.append(Kernel("attention.sdpa", "attention", "forward", "sdpa", L, F, io + T * H * c + B * nh * S * 4,
                      (B, nh, S, hd), "bfloat16", sdpa_backend))
    o.k.append(Kernel("attention.sdpa.backward", "attention", "backward", "sdpa", L, 5 * F // 2,
                      2 * io + 2 * T * H * c + B * nh * S * 4, (B, nh, S, hd), "bfloat16", sdpa_backend))
    o.linear("attention.o", "attention", H, H, L)  # its input is a view of SDPA's output: no copy
    _residual(o, "attention", L)
    # MLP: one gate_up matmul, the fused activation (saves gate_up; backward writes dgate/dup in place)
    o.linear("mlp.gate_up", "mlp", H, 2 * I, L)
    o.mem("mlp.swiglu", "mlp", "forward", T * 2 * I * c, T * I * c, L, host="swiglu.forward")
    o.mem("mlp.swiglu.backward", "mlp", "backward", T * I * c + T * 2 * I * c, T * 2 * I * c, L,
          host="swiglu.backward")
    # gate and up are the two halves of one tensor: split's backward cats their gradients (a copy)
    o.mem("mlp.gate_up.split_backward", "mlp", "backward", T * 2 * I * c, T * 2 * I * c, L)
    o.linear("mlp.down", "mlp", I, H, L)
    _residual(o, "mlp", L)
    _liger_loss(o)
    return o.k


def rms_norm_programs(H: int, sms: int = 132) -> int:
    """Programs of the fused rms_norm backward, each writing an fp32 row of dw partials: max(1, 8192 // H)
    per SM (anatomy/kernels/rmsnorm.py; the H200's 132 SMs: the partials are tiny whatever the GPU)."""
    return sms * max(1, 8192 // H)


def liger_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk (chunk_mem_const=1), as anatomy.efficient.loss.chunk_rows: ~tokens x hidden logits."""
    inc = math.ceil(vocab / hidden)
    return min(1 << max(0, math.ceil(tokens / inc) - 1).bit_length(), tokens)


def _liger_loss(o: _Ops) -> None:
    """Liger's fused linear CE (liger_kernel 0.8.x, ops/fused_linear_cross_entropy.py): per chunk of C
    rows, logits = x_c Wᵀ (C, V); one Triton kernel reads each row twice (max/sum, then the gradient)
    and writes d(logits) in place; grad_input rows = d(logits) W; grad_weight += d(logits)ᵀ x_c. All
    three matmuls run in forward; backward only checks that the incoming gradient is 1."""
    T, H, V, c, p = o.run.tokens, o.cfg.hidden, o.cfg.vocab, o.c, o.p
    o.mem("loss.count_targets", "loss", "forward", T * 8, 8, 2, sync=True, order=2)  # target != -100, sum, .item()
    o.mem("loss.zero_grad_input", "loss", "forward", 0, T * H * c, order=2)
    o.mem("loss.zero_grad_weight", "loss", "forward", 0, V * H * p, order=2)
    o.mem("loss.zero_losses", "loss", "forward", 0, T * 4, order=2)
    if o.amp:  # the fp32 weight reaches an autocast mm inside the Function: cast once (cached)
        o.mem("loss.lm_head.weight_cast", "loss", "forward", V * H * p, V * H * c, order=2)
    C = liger_chunk_rows(T, H, V)
    full, rest = divmod(T, C)
    for rows, n in ((C, full), (rest, 1 if rest else 0)):
        if not n:
            continue
        o.mm("loss.logits", "loss", "forward", rows, V, H, n, order=2)
        o.mem("loss.cross_entropy", "loss", "forward", 2 * rows * V * c + rows * 8, rows * V * c + rows * 4, n, order=2)
        o.mm("loss.grad_input", "loss", "forward", rows, H, V, n, order=2)
        if o.amp:  # fp32 weight: no mm(out=), so the product is copied into grad_input's rows
            o.mem("loss.grad_input_copy", "loss", "forward", rows * H * c, rows * H * c, n, order=2)
        # addmm into grad_weight (the weight's dtype): reads and writes the (V, H) accumulator every chunk
        o.mm("loss.grad_weight", "loss", "forward", V, H, rows, n, extra=2 * V * H * p - V * H * c, order=2)
    o.mem("loss.sum", "loss", "forward", T * 4, 4, order=2)
    o.mem("loss.backward_check", "loss", "backward", 8, 8, 2, sync=True, order=0)  # ones_like seed; torch.equal(g, 1)


def baseline_kernels(cfg: ModelConfig, run: Run) -> list[Kernel]:
    """anatomy/baseline: every elementwise op is its own kernel, attention materialises S x S."""
    o = _Ops(cfg, run)
    B, S, T, H, L = run.batch, run.seq, run.tokens, cfg.hidden, cfg.layers
    nh, nkv, Hkv, I, V = cfg.heads, cfg.kv_heads, cfg.kv_dim, cfg.intermediate, cfg.vocab
    c, r = o.c, o.r
    _embedding(o)
    _rope_tables(o, cast=c != 4)  # the tables are cast to the compute dtype
    # norm in fp32 ops on a (T, H) stream of dtype r. f = one fp32 (T, H) pass.
    n, f, tiny = 2 * L + 1, T * H * 4, T * 4
    fwd = [("pow", f, f), ("mean", f, tiny), ("add_eps", tiny, tiny), ("rsqrt", tiny, tiny),
           ("mul_rstd", f + tiny, f), ("mul_weight", f, f)]
    bwd = [("mul_weight.grad_x", f, f), ("mul_weight.grad_w", 2 * f, f), ("mul_weight.grad_w_sum", f, H * 4),
           ("mul_rstd.grad_x", f + tiny, f), ("mul_rstd.grad_rstd", 2 * f, f), ("mul_rstd.grad_rstd_sum", f, tiny),
           ("rsqrt.backward", 3 * tiny, 3 * tiny), ("mean.backward", tiny, f), ("pow.backward_pow1", f, f),
           ("pow.backward_scale", f, f), ("pow.backward_mul", 2 * f, f), ("grad_sum", 2 * f, f)]
    if r != 4:  # x.float() and .to(x.dtype) are casts (no-ops on an fp32 stream)
        fwd += [("float", T * H * r, f), ("to", f, T * H * r)]
        bwd += [("to.backward", T * H * r, f), ("float.backward", f, T * H * r)]
    for name, rd, wr in fwd:
        o.mem(f"norm.{name}", "norm", "forward", rd, wr, n)
    for name, rd, wr in bwd:
        o.mem(f"norm.{name}", "norm", "backward", rd, wr, n)
    # attention: q, k, v each cast the stream's normed x under amp; RoPE as 5 ops per tensor
    for name, width in (("q", H), ("k", Hkv), ("v", Hkv)):
        o.linear(f"attention.{name}", "attention", H, width, L, in_bytes=r)
    o.mem("attention.qkv_input_grad_sum", "attention", "backward", 2 * T * H * r, T * H * r, 2 * L)  # 3 grads: 2 adds
    for name, width in (("q", H), ("k", Hkv)):
        W = T * width * c
        five = [("mul_cos", W, W), ("neg", W / 2, W / 2), ("cat", W, W), ("mul_sin", W, W), ("add", 2 * W, W)]
        for op, rd, wr in five:  # x*cos + cat(-x2, x1)*sin; backward: g*sin, -g, cat, g*cos, the two paths' sum
            o.mem(f"attention.rope_{name}.{op}", "attention", "forward", rd, wr, L)
            o.mem(f"attention.rope_{name}.{op}.backward", "attention", "backward", rd, wr, L)
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
    for op, rd, wr in (("scale", U * c, U * c), ("mask_add", U * c, U * c), ("float", U * c, U * 4),
                       ("softmax", U * 4, U * 4), ("to_compute", U * 4, U * c)):
        if casts or op not in ("float", "to_compute"):
            o.mem(f"attention.{op}", "attention", "forward", rd, wr, L)
    o.mm("attention.probs_v", "attention", "forward", S, cfg.head_dim, S, L, batch=B * nh)
    o.mem("attention.merge_heads_copy", "attention", "forward", T * H * c, T * H * c, L)
    o.mem("attention.grad_out_layout_copy", "attention", "backward", T * H * c, T * H * c, L)
    o.mm("attention.probs_v.grad_probs", "attention", "backward", S, S, cfg.head_dim, L, batch=B * nh)
    o.mm("attention.probs_v.grad_v", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    for op, rd, wr in (("to_compute.backward", U * c, U * 4), ("softmax.backward", 2 * U * 4, U * 4),
                       ("float.backward", U * 4, U * c), ("scale.backward", U * c, U * c)):
        if casts or op not in ("float.backward", "to_compute.backward"):
            o.mem(f"attention.{op}", "attention", "backward", rd, wr, L)
    o.mm("attention.scores.grad_q", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    o.mm("attention.scores.grad_k", "attention", "backward", S, cfg.head_dim, S, L, batch=B * nh)
    o.linear("attention.o", "attention", H, H, L)  # its input (merged heads) is already compute dtype
    _residual(o, "attention", L)
    # MLP: gate and up each cast x under amp; silu and mul are separate kernels
    TI = T * I * c
    o.linear("mlp.gate", "mlp", H, I, L, in_bytes=r)
    o.linear("mlp.up", "mlp", H, I, L, in_bytes=r)
    o.mem("mlp.gate_up_input_grad_sum", "mlp", "backward", 2 * T * H * r, T * H * r, L)
    ops_f = [("silu", TI, TI), ("mul", 2 * TI, TI)]
    ops_b = [("mul.grad_silu", 2 * TI, TI), ("mul.grad_up", 2 * TI, TI), ("silu.backward", 2 * TI, TI)]
    if cfg.mlp == "gpt-oss":
        ops_f += [("clamp_gate", TI, TI), ("clamp_up", TI, TI), ("add_one", TI, TI)]
        ops_b += [("clamp_gate.backward", 2 * TI, TI), ("clamp_up.backward", 2 * TI, TI)]
    for op, rd, wr in ops_f:
        o.mem(f"mlp.{op}", "mlp", "forward", rd, wr, L)
    for op, rd, wr in ops_b:
        o.mem(f"mlp.{op}", "mlp", "backward", rd, wr, L)
    o.linear("mlp.down", "mlp", I, H, L)
    _residual(o, "mlp", L)
    # loss: lm_head on the normed stream (cast under amp), logits upcast to fp32, log_softmax + nll
    TV = T * V
    o.linear("loss.lm_head", "loss", H, V, 1, in_bytes=r, order=(2, 0))
    for op, rd, wr, ph in (("logits_float", TV * c, TV * 4, "forward"), ("log_softmax", TV * 4, TV * 4, "forward"),
                           ("nll_loss", T * 12, 8, "forward"), ("nll_loss.backward_zeros", 0, TV * 4, "backward"),
                           ("nll_loss.backward_scatter", T * 8, T * 4, "backward"),
                           ("log_softmax.backward", 2 * TV * 4, TV * 4, "backward"),
                           ("logits_float.backward", TV * 4, TV * c, "backward")):
        if casts or not op.startswith("logits_float"):
            o.mem(f"loss.{op}", "loss", ph, rd, wr, order=2 if ph == "forward" else 0)
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
    calculator/optimizer.py. baseline: the AdEMAMix loop, 15 kernels per tensor that move 38 fp32
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
                              nbytes))
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


# ---- the roofline ------------------------------------------------------------------------------
def _sdpa_rate(prof: dict, backend: str, head_dim: int, phase: str) -> tuple[float, str]:
    """FLOP/s at a full wave for one SDPA pass, and where it comes from."""
    table = prof["attention"]
    if not table:
        return prof["matmul_flops"]["bfloat16"], "roofline at the bf16 matmul rate (no attention measurement)"
    if backend not in table:
        raise ConfigError(f"gpu profile {prof['name']!r} has no {backend!r} attention measurement "
                          f"({', '.join(table)})")
    hds = table[backend]
    key = str(head_dim) if str(head_dim) in hds else min(hds, key=lambda h: abs(int(h) - head_dim))
    f, fb = hds[key]["fwd"], hds[key]["fwd_bwd"]
    note = f"{backend} hd{key}" + ("" if key == str(head_dim) else f" (nearest measured to hd{head_dim})")
    if phase == "forward":
        return f, note
    return 2.5 / (3.5 / fb - 1 / f), note  # backward = the fwd+bwd time minus the forward time


def time_kernel(kern: Kernel, prof: dict) -> dict:
    """One kernel (per launch and x count): its compute and memory terms, the bound, the time."""
    t_c, rate, note = 0.0, 0.0, ""
    if kern.kind == "matmul":
        b, m, n, k = kern.shape
        rate = prof["matmul_flops"][kern.dtype] * gpus.matmul_efficiency(m, n, k, prof["sms"], prof["matmul_k_half"], b)
    elif kern.kind == "sdpa":
        B, nh, S, hd = kern.shape
        rate, note = _sdpa_rate(prof, kern.backend, hd, kern.phase)
        rate *= gpus.attention_wave_efficiency(B, nh, S, prof["sms"]) if prof["attention"] else 1.0
    if rate:
        t_c = kern.flops / rate
    t_m = kern.bytes / prof["hbm_Bps"]
    launch = prof["launch_s"]
    bound = "compute" if t_c >= t_m else "memory"
    if launch > max(t_c, t_m):
        bound = "launch"
    per = max(t_c, t_m) + launch
    return dict(asdict(kern), shape=list(kern.shape), compute_s=t_c * kern.count, memory_s=t_m * kern.count,
                launch_s=launch * kern.count, time_s=per * kern.count, per_launch_s=per, bound=bound,
                rate_flops=rate, note=note)


def host_seconds(kern: Kernel, prof: dict) -> float:
    if kern.host is None:
        return 0.0
    if kern.host == "op":
        return kern.count * prof["host_op_s"]
    op, phase = kern.host.split(".")
    t = prof["host_custom_s"].get(op, {}).get(phase)
    return kern.count * (t if t is not None else CUSTOM_FALLBACK_OPS * prof["host_op_s"])


def predict(ks: list[Kernel], prof: dict) -> tuple[list[dict], list[dict]]:
    """Rows (one per kernel entry, in execution order) and host-sync segments. A segment runs from
    one host sync to the next (the optimizer is always its own) and takes max(GPU, host) time."""
    order = sorted(range(len(ks)), key=lambda i: (PHASES.index(ks[i].phase), ks[i].order))  # stable
    rows, segs = [], []
    for k in (ks[i] for i in order):
        row = time_kernel(k, prof)
        row["host_s"] = host_seconds(k, prof)
        rows.append(row)
        if not segs or k.sync or (k.phase == "optimizer") != (segs[-1]["phase"] == "optimizer"):
            segs.append(dict(phase=k.phase, starts_at=k.name, gpu_s=0.0, host_s=0.0))
        segs[-1]["gpu_s"] += row["time_s"]
        segs[-1]["host_s"] += row["host_s"]
    for sg in segs:
        sg["time_s"] = max(sg["gpu_s"], sg["host_s"])
        sg["bound"] = "host" if sg["host_s"] > sg["gpu_s"] else "gpu"
    return rows, segs


def estimate_time(cfg: ModelConfig, run: Run, variant: str = "efficient", gpu: str | dict = "h200-measured",
                  sdpa_backend: str | None = None, optimizer: str | None = "ademamix",
                  with_kernels: bool = True) -> dict:
    """Predicted time of one training step, per kernel, component and phase, with MFU.

    gpu: a profile name (gpus.names(), case-insensitive), a profile .json path, or a profile dict.
    forward_backward_s is what bench/step.py measures (max of GPU and host time per host-sync
    segment); step_s adds the optimizer. Per component and phase the figures are GPU time."""
    prof = gpus.get(gpu)
    rows, segs = predict(kernels(cfg, run, variant, sdpa_backend, optimizer), prof)
    comps: dict[str, dict] = {}
    phases = {ph: dict(gpu_s=0.0, host_s=0.0, kernels=0) for ph in PHASES}
    for row in rows:
        c = comps.setdefault(row["component"], dict({f"{ph}_s": 0.0 for ph in PHASES}, kernels=0,
                                                    bound_s=dict(compute=0.0, memory=0.0, launch=0.0)))
        c[f"{row['phase']}_s"] += row["time_s"]
        c["kernels"] += row["count"]
        c["bound_s"][row["bound"]] += row["time_s"]
        ph = phases[row["phase"]]
        ph["gpu_s"] += row["time_s"]
        ph["host_s"] += row["host_s"]
        ph["kernels"] += row["count"]
    for c in comps.values():
        c["total_s"] = sum(c[f"{ph}_s"] for ph in PHASES)
    fb = sum(sg["time_s"] for sg in segs if sg["phase"] != "optimizer")
    opt = sum(sg["time_s"] for sg in segs if sg["phase"] == "optimizer")
    fl = estimate(cfg, run, variant, "cuda").to_dict()["flops"]
    model, counter = (fl[k]["forward"] + fl[k]["backward"] for k in ("model", "counter"))
    peak = prof["mfu_peak_flops"]
    out = dict(
        gpu=prof["name"], profile_kind=prof["kind"], variant=variant, config=cfg.to_dict(),
        run=dict(batch=run.batch, seq=run.seq, dtype=run.dtype), optimizer=optimizer,
        sdpa_backend=(sdpa_backend or "cudnn") if variant == "efficient" else "math (explicit QKᵀ, softmax, PV)",
        forward_backward_s=fb, optimizer_s=opt, step_s=fb + opt, gpu_s=sum(p["gpu_s"] for p in phases.values()),
        tokens_per_s=run.tokens / fb, phases=phases, segments=segs, components=comps,
        mfu=dict(model=model / fb / peak, counter=counter / fb / peak, peak_flops=peak,
                 peak_source=prof["sources"].get("mfu_peak_flops", prof["sources"]["peak_flops"]),
                 flops=dict(model=model, counter=counter), over="forward + backward time (as bench/step.py)"),
        sources=prof["sources"])
    if with_kernels:
        out["kernels"] = rows
    return out


# ---- predictions against the committed H200 step records --------------------------------------
REPORTS = Path(__file__).resolve().parents[2] / "reports" / "h200"
STEP_RECORDS = (  # (file, variant): our own models' forward + backward, median of 10, CUDA events
    ("session1/step-seed-efficient.json", "efficient"),
    ("session3/step-seed-efficient.json", "efficient"),
    ("session1/step-1b-efficient.json", "efficient"),
    ("session1/step-seed-baseline.json", "baseline"),
)


def compare_committed(gpu: str | dict = "h200-measured", reports: Path = REPORTS) -> list[dict]:
    """Predicted vs measured forward + backward for every committed step record of our models."""
    import json

    out = []
    for rel, variant in STEP_RECORDS:
        path = reports / rel
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        cfg, run = ModelConfig.from_name(rec["preset"]), Run(rec["batch"], rec["seq"], "amp")
        pred = estimate_time(cfg, run, variant, gpu, optimizer=None, with_kernels=False)
        ms, meas = pred["forward_backward_s"] * 1e3, rec["median_ms"]
        out.append(dict(record=rel, variant=variant, preset=rec["preset"], batch=rec["batch"], seq=rec["seq"],
                        predicted_ms=ms, measured_ms=meas, min_ms=min(rec["times_ms"]), max_ms=max(rec["times_ms"]),
                        error=(ms - meas) / meas, date=rec["date"], gpu=gpu if isinstance(gpu, str) else gpu["name"],
                        mfu_model_predicted=pred["mfu"]["model"], host_bound=any(
                            s["bound"] == "host" for s in pred["segments"] if s["phase"] != "optimizer")))
    return out


def standalone_kernels(op: str, cfg: ModelConfig, batch: int, seq: int) -> list[Kernel]:
    """One bf16 fused op, forward + backward, as bench/kernels.py times it (leaves, no autocast,
    a random upstream gradient): "rmsnorm", "swiglu", "rope_qkv" (ours) or "linear_ce" (Liger)."""
    o = _Ops(cfg, Run(batch, seq, "bf16"))
    T, H, I, D, c = o.run.tokens, cfg.hidden, cfg.intermediate, cfg.hidden + 2 * cfg.kv_dim, o.c
    if op == "rmsnorm":
        o.mem("rms_norm", "norm", "forward", T * H * c, T * H * c, host="rms_norm.forward")
        o.mem("rms_norm.backward", "norm", "backward", 2 * T * H * c, T * H * c, host="rms_norm.backward")
        o.mem("rms_norm.dw_sum", "norm", "backward", 4 * rms_norm_programs(H) * H, 4 * H, host=None)
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


def compare_kernel_records(gpu: str | dict = "h200-measured", reports: Path = REPORTS) -> list[dict]:
    """Predicted vs measured fused-kernel (fwd + bwd) and optimizer-step times in the committed records."""
    import json

    prof, out = gpus.get(gpu), []
    path = reports / "session1/kernels-seed.json"
    if path.exists():
        rec = json.loads(path.read_text())
        cfg = ModelConfig.from_name(rec["preset"])
        for row in rec["rows"]:
            if (row["kernel"], row["impl"]) in (("rmsnorm", "ours"), ("swiglu", "ours"), ("rope_qkv", "ours"),
                                                ("linear_ce", "liger")):
                rows, segs = predict(standalone_kernels(row["kernel"], cfg, rec["batch"], rec["seq"]), prof)
                t = max(sum(s["gpu_s"] for s in segs), sum(s["host_s"] for s in segs))  # no sync between calls
                out.append(dict(record="session1/kernels-seed.json", what=f"{row['kernel']} ({row['impl']})",
                                predicted_ms=t * 1e3, gpu_ms=sum(s["gpu_s"] for s in segs) * 1e3,
                                host_ms=sum(s["host_s"] for s in segs) * 1e3, measured_ms=row["ms"],
                                error=(t * 1e3 - row["ms"]) / row["ms"]))
    path = reports / "bench-optim.json"
    if path.exists():
        for b in json.loads(path.read_text())["benchmarks"]:
            e = b["extra_info"]
            name = "ademamix" if e["impl"].startswith("ademamix") else "adamw"
            k = Kernel(f"optimizer.{name}", "optimizer", "optimizer", "memory", 6, 0,
                       step_bytes_moved(e["n_params"], name) // 6)  # validations/test_optim.py: 6 x 4096² fp32
            t = time_kernel(k, prof)["time_s"]
            out.append(dict(record="bench-optim.json", what=f"{e['impl']} step, {e['n_params']:,} fp32 params",
                            predicted_ms=t * 1e3, gpu_ms=t * 1e3, host_ms=None, measured_ms=e["median_s"] * 1e3,
                            error=(t - e["median_s"]) / e["median_s"]))
    return out


def _table(rows: list[dict]) -> str:
    lines = ["| record | config | predicted ms | measured ms (min–max) | error |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['record']} | {r['preset']} {r['variant']} B={r['batch']} S={r['seq']} | "
                     f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} ({r['min_ms']:.1f}–{r['max_ms']:.1f}) | "
                     f"{r['error']:+.1%} |")
    return "\n".join(lines)


def breakdown_table(res: dict) -> str:
    """Per component: GPU ms by phase, launches, and the share of its time each bound holds."""
    lines = ["| component | forward ms | backward ms | optimizer ms | kernels | compute / memory / launch |",
             "|---|---:|---:|---:|---:|---|"]
    for name, c in res["components"].items():
        share = " / ".join(f"{c['bound_s'][b] / c['total_s']:.0%}" for b in ("compute", "memory", "launch"))
        lines.append(f"| {name} | {c['forward_s'] * 1e3:.2f} | {c['backward_s'] * 1e3:.2f} | "
                     f"{c['optimizer_s'] * 1e3:.2f} | {c['kernels']} | {share} |")
    segs = ", ".join(f"{s['starts_at']}: GPU {s['gpu_s'] * 1e3:.1f} / host {s['host_s'] * 1e3:.1f} ms"
                     for s in res["segments"])
    return "\n".join(lines) + (f"\n\nHost-sync segments: {segs}. Forward + backward "
                               f"{res['forward_backward_s'] * 1e3:.1f} ms, MFU {res['mfu']['model']:.1%} (model FLOPs) / {res['mfu']['counter']:.1%} (counter), "
                               f"against {res['mfu']['peak_flops'] / 1e12:.0f} TFLOP/s.")


def main(argv: list[str] | None = None) -> int:
    """python3 -m anatomy.calculator.timing [GPU...]: predictions against the committed H200 records."""
    import sys

    for gpu in (sys.argv[1:] if argv is None else argv) or ["h200-measured", "h200-sxm"]:
        print(f"\n### gpu profile: {gpu}\n\nTraining step, forward + backward (bench/step.py):\n")
        print(_table(compare_committed(gpu)))
        print("\nFused kernels (fwd + bwd, bench/kernels.py) and optimizer steps (validations/test_optim.py):\n")
        print("| record | what | predicted ms (GPU / host) | measured ms | error |\n|---|---|---:|---:|---:|")
        for r in compare_kernel_records(gpu):
            host = f"{r['host_ms']:.3f}" if r["host_ms"] is not None else "–"
            print(f"| {r['record']} | {r['what']} | {r['predicted_ms']:.3f} ({r['gpu_ms']:.3f} / {host}) | "
                  f"{r['measured_ms']:.3f} | {r['error']:+.1%} |")
        for preset, batch, variant in (("seed", 16, "efficient"), ("anchor-1b", 4, "efficient"),
                                       ("seed", 16, "baseline")):
            print(f"\n{preset} {variant} B={batch} S=4096 amp, AdEMAMix step included:\n")
            print(breakdown_table(estimate_time(ModelConfig.from_name(preset), Run(batch, 4096), variant, gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
