"""The kernels of gpt-oss's and OLMoE's attention fields (config.ATTENTION_FIELDS) in both variants, and the
efficient model's SDPA calls, causal or masked; kernels_efficient.py and kernels_baseline.py call them.

- SDPA under an additive mask (a windowed layer, or any layer with sinks: efficient/attention_sinks.py) is cuDNN's
  masked kernel, not the causal one: it visits every (query, key) block, so its FLOPs are the call's whole
  S x keys at the head dim it is called with (ops.masked_attention_flops, what FlopCounterMode counts), priced at
  the profile's masked rate (roofline.masked_rate). Its bytes: q', k', v', the output and the row statistics once
  each, and the (S, keys) mask once per launch: every (batch, head) CTA row reads the same mask, which stays in
  L2 (8 MiB at S 2048), so HBM sees it once; the L2 traffic is inside the calibrated rate. So are the small
  kernels cuDNN launches around its main one (memsets, dot(dO, O), dQ's conversion, the GQA reduce): calibrate
  times the whole call with CUDA events at gpt-oss's GQA (calibrate_sdpa.MASKED_SHAPES), so they are not listed
  apart (a call without GQA is priced with its reduce inside: an over-estimate of that small kernel).
- Sinks (attention_sinks.sink_sdpa): q is widened by a cat with the sink column and zeros, k and v padded
  (F.pad: a fill of the output, then a copy of the input into it), the sink key's 1 set in place; SDPA's output
  is sliced to hd and merged over heads by a copy o keeps. Backward: the slice's zeros and copy, F.pad's
  backward (a clone of the narrowed gradient), the in-place set's clone of d(k'), the sink column's cast to
  fp32 and its sum over batch and positions.
- Masks: each kind built once per forward (shared_masks: a window's, the sinks' causal one); under full
  recompute every re-run layer builds its own again (the cache lives only inside the model's forward).
- OLMoE's whole q/k norms: the fused rms_norm on qkv's q and k columns (strided rows, no copy), a cat of
  (qn, kn, v), the plain rope_qkv; backward as calculator/attention_fields.py walks it.
- The baseline: sinks join the fp32 softmax by a cat (B, nh, S, S + 1), its [..., :-1] slice cast (strided),
  each at its own calibration (op_bytes "sxs.sink_*"); a window's mask is built once per step
  from the causal one; the whole q/k norms are the eager norm chain over (T, q_dim) and (T, kv_dim).
"""
from __future__ import annotations

from llm_anatomy.calculator.attention import sink_pad
from llm_anatomy.calculator.timing.op_bytes import dw_sum_bytes, fused_bytes
from llm_anatomy.calculator.timing.ops import MASKED, Kernel, Ops, causal_attention_flops, masked_attention_flops
from llm_anatomy.config import ConfigError, ModelConfig


def masked_layers(cfg: ModelConfig) -> int:
    """Layers whose SDPA takes an additive mask: every layer with sinks, else the windowed ones."""
    return cfg.layers if cfg.attn_sinks else cfg.windowed_layers


def sdpa_kernels(o: Ops, backend: str, recompute: bool = False) -> None:
    """Every layer's SDPA call (forward and backward; recompute: the forward again in backward, as full
    recompute runs it), causal layers on `backend`, masked ones on cuDNN's masked kernel."""
    cfg, L = o.cfg, o.cfg.layers
    Lm = masked_layers(cfg)
    if Lm and backend != "cudnn":
        raise ConfigError(f"the timing model prices SDPA under an additive mask (attention sinks, sliding windows) "
                          f"on cuDNN only, not {backend!r} (config {cfg.name})")
    if L - Lm:
        _sdpa(o, L - Lm, backend, cfg.head_dim, o.run.seq, False, recompute)
    if Lm:
        sinks = cfg.attn_sinks
        _sdpa(o, Lm, backend, cfg.head_dim + (sink_pad("cuda") if sinks else 0), o.run.seq + sinks, True, recompute)


def _sdpa(o: Ops, L: int, backend: str, wd: int, keys: int, masked: bool, recompute: bool) -> None:
    """L layers' SDPA at head width wd over `keys` keys. q' (B, nh, S, wd), k', v' (B, nkv, keys, wd), out like q',
    stats (B, nh, S) fp32, the mask (S, keys) once (module docstring)."""
    cfg, run, c = o.cfg, o.run, o.c
    B, S, nh, nkv = run.batch, run.seq, cfg.heads, cfg.kv_heads
    F = masked_attention_flops(B, nh, S, keys, wd) if masked else causal_attention_flops(B, nh, S, cfg.head_dim)
    qb, kvb, stats = B * S * nh * wd * c, 2 * B * keys * nkv * wd * c, B * nh * S * 4  # q' (= out), k' + v', stats
    mask = S * keys * c if masked else 0
    name, be = ("attention.sdpa_masked", MASKED) if masked else ("attention.sdpa", backend)
    shape = (B, nh, S, wd)
    if recompute:  # the forward kernel, priced as one (op_phase) though it runs in the backward phase
        o.k.append(Kernel(f"{name}.recompute", "attention", "backward", "sdpa", L, F, qb + kvb + qb + stats + mask,
                          shape, "bfloat16", be, op_phase="forward"))
        if backend == "cudnn" and not masked:
            o.mem(f"{name}.memset.recompute", "attention", "backward", 0, stats, L, host=None)
        return
    o.k.append(Kernel(name, "attention", "forward", "sdpa", L, F, qb + kvb + qb + stats + mask, shape, "bfloat16", be))
    o.k.append(Kernel(f"{name}.backward", "attention", "backward", "sdpa", L, 5 * F // 2,
                      2 * (qb + kvb) + 2 * qb + stats + mask, shape, "bfloat16", be))
    if backend != "cudnn" or masked:  # the masked rate is the whole call's (its small kernels are inside it)
        return
    # cuDNN's call launches small kernels around its main one (every H200 trace): a memset of its (B, heads, S)
    # fp32 row statistics in each phase; in backward, dot(dO, O) per row, which also zeroes the fp32 dQ
    # accumulator, then dQ converted to the compute dtype
    q32 = B * S * nh * wd * 4
    o.mem(f"{name}.memset", "attention", "forward", 0, stats, L, host=None)
    o.mem(f"{name}.backward.memset", "attention", "backward", 0, stats, L, host=None)
    o.mem(f"{name}.dot_do_o", "attention", "backward", 2 * qb, stats + q32, L, host=None)
    o.mem(f"{name}.convert_dq", "attention", "backward", q32, qb, L, host=None)
    if nkv < nh:  # under GQA: dK, dV per query head in fp32, each group summed after (fmha_reduce_head)
        o.mem(f"{name}.gqa_reduce", "attention", "backward", 2 * B * keys * nh * wd * 4, kvb, L, host=None)


def sink_kernels(o: Ops, recompute: bool = False) -> None:
    """The sinks' copies around SDPA in every layer (attention_sinks.sink_sdpa, attention.Attention.forward);
    recompute: the forward's again in backward."""
    cfg, run, c, p = o.cfg, o.run, o.c, o.p
    B, S, T, L, nh, nkv, hd = run.batch, run.seq, run.tokens, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim
    pad = sink_pad("cuda")
    wd, rows_q, rows_kv = hd + pad, B * nh * S, B * nkv * (S + 1)
    ph, tag = ("backward", ".recompute") if recompute else ("forward", "")
    # col = (sinks.float() / scale).expand(B, nh, S, 1).to(q.dtype): the division (and sinks.float(), a copy
    # unless the parameters are fp32), then the cast of the expanded view into a (B, nh, S, 1) tensor
    o.mem(f"attention.sinks.logit{tag}", "attention", ph, nh * p, nh * 4, L * (1 + (p != 4)))
    o.mem(f"attention.sinks.column{tag}", "attention", ph, nh * 4, rows_q * c, L)
    o.mem(f"attention.sinks.q_zeros{tag}", "attention", ph, 0, rows_q * (pad - 1) * c, L)  # q.new_zeros
    o.mem(f"attention.sinks.q_cat{tag}", "attention", ph, rows_q * wd * c, rows_q * wd * c, L)  # (B, nh, S, wd)
    # F.pad(k), F.pad(v): constant_pad_nd fills (B, nkv, S + 1, wd), then copies k (B, nkv, S, hd) into it
    o.mem(f"attention.sinks.kv_pad_fill{tag}", "attention", ph, 0, rows_kv * wd * c, 2 * L)
    o.mem(f"attention.sinks.kv_pad_copy{tag}", "attention", ph, B * nkv * S * hd * c, B * nkv * S * hd * c, 2 * L)
    o.mem(f"attention.sinks.key_one{tag}", "attention", ph, 0, B * nkv * c, L)  # k[:, :, S, hd] = 1
    if nh > 1:  # out[..., :hd] merged over heads: a copy (B, S, nh * hd) o keeps (one head: a view)
        o.mem(f"attention.sinks.merge_heads{tag}", "attention", ph, T * nh * hd * c, T * nh * hd * c, L)
    if recompute:
        return
    # backward: the slice out[..., :hd]'s zeros (B, nh, S, wd) and o's input gradient copied in
    o.mem("attention.sinks.slice.backward_zeros", "attention", "backward", 0, rows_q * wd * c, L)
    o.mem("attention.sinks.slice.backward_copy", "attention", "backward", T * nh * hd * c, T * nh * hd * c, L)
    # the in-place k[:, :, S, hd] = 1 (CopySlices): d(k') cloned, the set element's gradient zeroed
    o.mem("attention.sinks.key_one.backward_clone", "attention", "backward", rows_kv * wd * c, rows_kv * wd * c, L)
    o.mem("attention.sinks.key_one.backward_zero", "attention", "backward", 0, B * nkv * c, L)
    # F.pad's backward: the narrowed (B, nkv, S, hd) gradient cloned, for k and for v
    o.mem("attention.sinks.kv_pad.backward", "attention", "backward", B * nkv * S * hd * c, B * nkv * S * hd * c,
          2 * L)
    # cat's backward hands views on; the sink column of d(q') cast to fp32, summed over batch and positions
    o.mem("attention.sinks.column.backward", "attention", "backward", rows_q * c, rows_q * 4, L)
    o.mem("attention.sinks.grad_sum", "attention", "backward", rows_q * 4, nh * 4, L)
    o.mem("attention.sinks.logit.backward", "attention", "backward", nh * 4, nh * 4, L)


def mask_kernels(o: Ops, recompute: bool = False) -> None:
    """The efficient model's additive masks (attention_sinks.attention_mask): far = ones(S, keys).triu(1) (bool);
    under a window | ones(S, keys).tril(-window); with sinks far[:, S] = False; then zeros(S, keys) in q's dtype
    masked_fill_'ed. Once per forward per kind (calculator/attention.mask_kinds); under full recompute once per
    re-run masked layer, in backward."""
    cfg, S, c = o.cfg, o.run.seq, o.c
    sk = S + cfg.attn_sinks
    n = S * sk  # elements of one mask
    windowed = cfg.windowed_layers
    kinds = (("window", True, windowed), ("full", False, cfg.layers - windowed if cfg.attn_sinks else 0))
    for kind, window, layers in kinds:
        count = layers if recompute else int(layers > 0)
        if not count:
            continue
        ph, tag = ("backward", ".recompute") if recompute else ("forward", "")
        pre = f"attention.mask_{kind}"
        kw = dict(order=1 if recompute else 0)
        o.mem(f"{pre}.ones{tag}", "attention", ph, 0, n, count * (1 + window), **kw)
        o.mem(f"{pre}.triu{tag}", "attention", ph, n, n, count * (1 + window), **kw)  # and tril under a window
        if window:
            o.mem(f"{pre}.or{tag}", "attention", ph, 2 * n, n, count, **kw)
        if cfg.attn_sinks:
            o.mem(f"{pre}.sink_column{tag}", "attention", ph, 0, S, count, **kw)
        o.mem(f"{pre}.zeros{tag}", "attention", ph, 0, n * c, count, **kw)
        o.mem(f"{pre}.masked_fill{tag}", "attention", ph, n * (1 + c), n * c, count, **kw)


def whole_qk_norm_kernels(o: Ops, recompute: bool = False) -> None:
    """OLMoE's q/k norms over the whole projection (efficient/attention.py): the fused rms_norm over qkv's q and k
    columns (rows of q_dim and kv_dim, in and out in the compute dtype), a cat (T, D) for rope_qkv; backward as
    calculator/attention_fields.whole_qk_norm walks it: three column slices' zeros (T, D) with each gradient
    copied in, two sums (T, D), each norm's backward and its dw sum. recompute: the forward's again."""
    cfg, T, L, c = o.cfg, o.run.tokens, o.cfg.layers, o.c
    q, kv = cfg.q_dim, cfg.kv_dim
    D = q + 2 * kv
    ph, tag = ("backward", ".recompute") if recompute else ("forward", "")
    for name, w in (("q_norm", q), ("k_norm", kv)):
        op = ("rms_norm.forward", w)
        o.mem(f"attention.{name}{tag}", "attention", ph, *fused_bytes(*op, T, c, c), L, host=op[0], fused=(*op, T))
    o.mem(f"attention.qk_norm_cat{tag}", "attention", ph, T * D * c, T * D * c, L)
    if recompute:
        return
    o.mem("attention.qkv_slices.backward_zeros", "attention", "backward", 0, T * D * c, 3 * L)
    o.mem("attention.v_slice.backward_copy", "attention", "backward", T * kv * c, T * kv * c, L)
    for name, w in (("k_norm", kv), ("q_norm", q)):
        op = ("rms_norm.backward", w)
        o.mem(f"attention.{name}.backward", "attention", "backward", *fused_bytes(*op, T, c, c), L, host=op[0],
              fused=(*op, T))
        o.mem(f"attention.{name}.dw_sum", "attention", "backward", *dw_sum_bytes(w, T), L, host=None, fused=(*op, T))
        o.mem(f"attention.{name}_slice.backward_copy", "attention", "backward", T * w * c, T * w * c, L)
    o.mem("attention.qkv_slices.backward_sum", "attention", "backward", 2 * T * D * c, T * D * c, 2 * L)


def baseline_window_mask(o: Ops) -> None:
    """The baseline's window mask, once per step (baseline/transformer.py): far = ones(S, S).tril(-window) (bool),
    then causal_bias.masked_fill(far, -inf), a new (S, S) tensor in the compute dtype."""
    S, c = o.run.seq, o.c
    o.mem("attention.window_mask_ones", "attention", "forward", 0, S * S, order=0)
    o.mem("attention.window_mask_tril", "attention", "forward", S * S, S * S, order=0)
    o.mem("attention.window_mask_fill", "attention", "forward", S * S * (1 + c), S * S * c, order=0)


def baseline_sink_softmax(o: Ops, phase: str, cal) -> None:
    """The baseline's softmax with sinks (baseline/attention.py): cat(scores.float(), sink) (B, nh, S, S + 1) fp32,
    softmax over it, [..., :-1] a view; backward: the slice's zeros and copy, softmax's backward over S + 1,
    cat's backward views, the sink's gradient summed over batch and positions. cal(op, width): the calibration
    of an S x S op (calibrate_aten.sxs_case): the softmax's at width S + 1, the cat's and the slice's backward copy
    at S (their rows of S + 1 are not 16-byte aligned: ATen's unvectorized kernels); the zeros at the copy rate."""
    B, S, L, nh = o.run.batch, o.run.seq, o.cfg.layers, o.cfg.heads
    R = B * nh * S  # rows
    U, U1 = R * S, R * (S + 1)
    if phase == "forward":
        o.mem("attention.sinks_cat", "attention", "forward", U * 4 + nh * 4, U1 * 4, L, fused=cal("sxs.sink_cat", S))
        o.mem("attention.softmax", "attention", "forward", U1 * 4, U1 * 4, L, fused=cal("sxs.softmax", S + 1))
        return
    o.mem("attention.sinks_slice.backward_zeros", "attention", "backward", 0, U1 * 4, L)
    o.mem("attention.sinks_slice.backward_copy", "attention", "backward", U * 4, U * 4, L,
          fused=cal("sxs.sink_slice_backward", S))
    o.mem("attention.softmax.backward", "attention", "backward", 2 * U1 * 4, U1 * 4, L,
          fused=cal("sxs.softmax.backward", S + 1))
    o.mem("attention.sinks.grad_sum", "attention", "backward", R * 4, nh * 4, L)
