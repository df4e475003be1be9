"""The kernels llm_anatomy/baseline launches in a training step on CUDA: every elementwise op its own kernel,
attention through explicit QKᵀ, softmax and PV over (B, heads, S, S) scores, the loss over full fp32 logits.
Mirrors kernels_efficient.py, component by component.
"""
from __future__ import annotations

from llm_anatomy.calculator.timing.kernels_fields import baseline_sink_softmax, baseline_window_mask
from llm_anatomy.calculator.timing.ops import Kernel, Ops, embedding, residual, rope_tables
from llm_anatomy.config import ModelConfig, Run


def baseline_kernels(cfg: ModelConfig, run: Run, hist=None) -> list[Kernel]:
    """llm_anatomy/baseline: every elementwise op is its own kernel, attention materialises S x S; hist: a mixture
    of experts' rows per expert (calculator/moe.py; default balanced)."""
    o = Ops(cfg, run)
    B, S, T, H, L = run.batch, run.seq, run.tokens, cfg.hidden, cfg.layers
    nh, nkv, Hkv, I, V, hd = cfg.heads, cfg.kv_heads, cfg.kv_dim, cfg.intermediate, cfg.vocab, cfg.head_dim
    c, r = o.c, o.r
    embedding(o)
    rope_tables(o, cast=c != 4)  # the tables are cast to the compute dtype
    # norm in fp32 ops on a (T, H) stream of dtype r (fused.eager_norm_*), at the rate calibrate measured for
    # the chain as a whole where it did (amp: an fp32 stream and bf16 compute)
    n = 2 * L + 1
    for ph in ("forward", "backward"):
        op = f"eager_norm.{ph}"
        o.chain(op, "norm.", "norm", ph, H, T, n, fused=(op, H, T) if (c, r) == (2, 4) else ())
    # attention: q, k, v each cast the stream's normed x under amp; RoPE as 5 ops per tensor
    q = cfg.q_dim
    for name, width in (("q", q), ("k", Hkv), ("v", Hkv)):
        o.linear(f"attention.{name}", "attention", H, width, L, in_bytes=r, bias=cfg.qkv_bias)
    if cfg.qk_norm:  # q_norm, k_norm: the eager norm chain over head-rows of hd (OLMoE: rows of the whole
        # q_dim and kv_dim), from the compute dtype (uncalibrated)
        whole = cfg.qk_norm_whole
        for name, heads in (("q_norm", nh), ("k_norm", nkv)):
            width, rows = (heads * hd, T) if whole else (hd, T * heads)
            for ph in ("forward", "backward"):
                o.chain(f"eager_norm.{ph}", f"attention.{name}.", "attention", ph, width, rows, L, stream=c)
    o.mem("attention.qkv_input_grad_sum", "attention", "backward", 2 * T * H * r, T * H * r, 2 * L)  # 3 grads: 2 adds
    for name, heads in (("q", nh), ("k", nkv)):  # x*cos + cat(-x2, x1)*sin (fused.eager_rope_*), calibrated per hd
        for ph, suffix in (("forward", ""), ("backward", ".backward")):
            op = f"eager_rope.{ph}"
            o.chain(op, f"attention.rope_{name}.", "attention", ph, hd, T * heads, L,
                    fused=(op, hd, T * heads) if c == 2 else (), suffix=suffix)
    # torch.matmul reshapes (B, nh, S, hd) operands laid out (B, S, nh, hd) to (B*nh, S, hd): a copy
    # each (repeat_kv's copy replaces it for k, v under GQA); their gradients' views copy back
    for name, width in (("q", q), ("k", Hkv), ("v", Hkv)):
        full = T * q * c
        if name != "q" and nkv != nh:
            o.mem(f"attention.repeat_kv_{name}", "attention", "forward", T * width * c, full, L)
            o.mem(f"attention.repeat_kv_{name}.backward", "attention", "backward", full, T * width * c, L)
        else:
            o.mem(f"attention.{name}_layout_copy", "attention", "forward", T * width * c, T * width * c, L)
        o.mem(f"attention.{name}_grad_layout_copy", "attention", "backward", T * width * c, T * width * c, L)
    U = B * nh * S * S  # one S x S score tensor, in elements
    o.mem("attention.causal_mask_full", "attention", "forward", 0, S * S * c, order=0)  # once per step
    o.mem("attention.causal_mask_triu", "attention", "forward", S * S * c, S * S * c, order=0)
    if cfg.window is not None:
        baseline_window_mask(o)
    o.mm("attention.scores", "attention", "forward", S, S, hd, L, batch=B * nh)
    casts = c != 4  # scores.float() and probs.to(q.dtype) copy unless the compute dtype is fp32
    R = B * nh * S  # rows of S scores
    # calibrate times each of these eager ops over S-wide rows (fused.fused_bytes "sxs.*"): ATen runs the
    # fp32 softmax, the bf16 -> fp32 cast and the broadcast mask add well under the copy roofline
    sxs = lambda op: (op, S, R) if c == 2 or op.startswith("sxs.softmax") else ()  # noqa: E731 (calibrated in bf16)
    # with sinks both casts to the compute dtype read a strided slice of rows of S + 1 (kernels_fields.py)
    slice_cast = "sxs.sink_slice_cast" if cfg.attn_sinks else "sxs.to_compute"
    for op, rd, wr, cal in (("scale", U * c, U * c, "sxs.scale"), ("mask_add", U * c, U * c, "sxs.mask_add"),
                            ("float", U * c, U * 4, "sxs.float"), ("softmax", U * 4, U * 4, "sxs.softmax"),
                            ("to_compute", U * 4, U * c, slice_cast)):
        if cfg.attn_sinks and op == "softmax":  # the sink joins each row by a cat: rows of S + 1
            baseline_sink_softmax(o, "forward", cal=lambda op, w: (op, w, R))
        elif casts or op not in ("float", "to_compute"):
            o.mem(f"attention.{op}", "attention", "forward", rd, wr, L, fused=sxs(cal))
    o.mm("attention.probs_v", "attention", "forward", S, hd, S, L, batch=B * nh)
    o.mem("attention.merge_heads_copy", "attention", "forward", T * H * c, T * H * c, L)
    o.mem("attention.grad_out_layout_copy", "attention", "backward", T * H * c, T * H * c, L)
    o.mm("attention.probs_v.grad_probs", "attention", "backward", S, S, hd, L, batch=B * nh)
    o.mm("attention.probs_v.grad_v", "attention", "backward", S, hd, S, L, batch=B * nh)
    for op, rd, wr, cal in (("to_compute.backward", U * c, U * 4, "sxs.float"),
                            ("softmax.backward", 2 * U * 4, U * 4, "sxs.softmax.backward"),
                            ("float.backward", U * 4, U * c, slice_cast), ("scale.backward", U * c, U * c, "sxs.scale")):
        if cfg.attn_sinks and op == "softmax.backward":
            baseline_sink_softmax(o, "backward", cal=lambda op, w: (op, w, R))
        elif casts or op not in ("float.backward", "to_compute.backward"):
            o.mem(f"attention.{op}", "attention", "backward", rd, wr, L, fused=sxs(cal))
    o.mm("attention.scores.grad_q", "attention", "backward", S, hd, S, L, batch=B * nh)
    o.mm("attention.scores.grad_k", "attention", "backward", S, hd, S, L, batch=B * nh)
    o.linear("attention.o", "attention", cfg.q_dim, H, L, bias=cfg.o_bias)  # its input (merged heads): compute dtype
    residual(o, "attention", L)
    if cfg.moe:  # the per-expert loop in the MLP's place (kernels_moe.py), its residual add credited to it
        from llm_anatomy.calculator.timing.kernels_moe import baseline_moe

        baseline_moe(o, mlp, hist)  # the shared experts price as the dense MLP
        residual(o, "moe", L)
    else:
        mlp(o, "mlp", "mlp", I)
        residual(o, "mlp", L)
    # loss: lm_head on the normed stream (cast under amp), logits upcast to fp32, log_softmax + nll
    # (fused.eager_ce_*), at the rate calibrate measured for that tail as a whole where it did (bf16 logits)
    o.linear("loss.lm_head", "loss", H, V, 1, in_bytes=r, order=(2, 0))
    for ph in ("forward", "backward"):
        op = f"eager_ce.{ph}"
        o.chain(op, "loss.", "loss", ph, V, T, order=2 if ph == "forward" else 0, fused=(op, V, T) if c == 2 else ())
    return o.k


def mlp(o: Ops, name: str, comp: str, I: int) -> None:
    """The gated MLP of width I on every token: gate and up each cast x under amp; silu and mul are separate
    kernels (fused.eager_mlp_*), and gpt-oss's clamps and +1 before them (eager_clamp_*), each chain at the rate
    calibrate measured for it as a whole where it did (bf16 compute)."""
    cfg, T, H, L, c, r = o.cfg, o.run.tokens, o.cfg.hidden, o.cfg.layers, o.c, o.r
    o.linear(f"{name}.gate", comp, H, I, L, in_bytes=r)
    o.linear(f"{name}.up", comp, H, I, L, in_bytes=r)
    o.mem(f"{name}.gate_up_input_grad_sum", comp, "backward", 2 * T * H * r, T * H * r, L)
    chains = ("eager_mlp",) + (("eager_clamp",) if cfg.mlp == "gpt-oss" else ())
    for ph in ("forward", "backward"):
        for op in (f"{ch}.{ph}" for ch in chains):
            o.chain(op, f"{name}.", comp, ph, I, T, L, fused=(op, I, T) if c == 2 else ())
    o.linear(f"{name}.down", comp, I, H, L)
