"""Causal self-attention with GQA and RoPE, and optionally a bias on q, k and v (Qwen2).

A bias changes the parameters and the elementwise work only. nn.Linear with a bias runs one addmm
(a 3-D input is flattened to 2-D first), and that node saves the same two operands as the mm of a
bias-free linear: the bias's gradient is a sum of the output's gradient, which needs nothing kept.
FlopCounterMode counts addmm as the mm alone, so the counter FLOPs are unchanged too, and the model
convention counts matmuls only.

qk-norm (Qwen3) is an RMSNorm over each q and k head (weights of head_dim): 2·hd parameters a layer, no
matmul (no counter or model FLOP), and 4·hd + 2 elementwise FLOPs a head-row, as the block norms count
theirs. The modules are attention's, so what they keep is attention's. The baseline's RMSNorm keeps, per
norm, the fp32 input, rstd and x_hat, like a block norm over rows of hd. The efficient model runs both norms
inside its RoPE kernel (anatomy::rope_qkv_norm), which keeps only its input, the qkv output (v's columns
ride along in that one storage): rstd is recomputed in backward and the normed q and k never exist.
"""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import ConfigError, ModelConfig, Run


def params(cfg: ModelConfig) -> int:
    H, q, kv = cfg.hidden, cfg.q_dim, cfg.kv_dim
    # q, k, v, o, q, k and v's biases, o's bias, q_norm and k_norm, the sinks
    extra = (H if cfg.o_bias else 0) + (cfg.heads if cfg.attn_sinks else 0)
    return cfg.layers * (H * q + 2 * H * kv + q * H + qkv_bias(cfg) + qk_norm(cfg) + extra)


def qkv_bias(cfg: ModelConfig) -> int:
    """Elements of one layer's q, k and v biases (0 without them)."""
    return cfg.q_dim + 2 * cfg.kv_dim if cfg.qkv_bias else 0


def qk_norm(cfg: ModelConfig) -> int:
    """Elements of one layer's q_norm and k_norm weights (0 without them): head_dim each, or the whole q and k
    widths under qk_norm_whole (OLMoE)."""
    if not cfg.qk_norm:
        return 0
    return cfg.q_dim + cfg.kv_dim if cfg.qk_norm_whole else 2 * cfg.head_dim


def qk_norm_elementwise(cfg: ModelConfig, run: Run) -> int:
    """Forward elementwise FLOPs of every layer's q_norm and k_norm: 4 an element + 2 a normalised row (norm.py's
    rule), over head-rows, or over token rows of the whole q and k under qk_norm_whole."""
    if not cfg.qk_norm:
        return 0
    rows = 2 if cfg.qk_norm_whole else cfg.heads + cfg.kv_heads
    return cfg.layers * run.tokens * (4 * (cfg.q_dim + cfg.kv_dim) + 2 * rows)


def window_pairs_left_out(cfg: ModelConfig, run: Run) -> int:
    """Causal (query, key) pairs every windowed layer leaves out, summed over those layers: the keys more than
    window - 1 tokens back, (S - W)(S - W + 1) / 2 per head and sequence."""
    S, W = run.seq, cfg.window or run.seq
    return cfg.windowed_layers * run.batch * cfg.heads * ((S - W) * (S - W + 1) // 2 if S > W else 0)


def _qk_norm_saved_baseline(cfg: ModelConfig, run: Run) -> list[Saved]:
    """The baseline RMSNorm over (B, S, heads, hd), for q and for k: its fp32 input (a copy of the bf16
    projection output, or that fp32 output itself), rstd per head-row, and x_hat."""
    if not cfg.qk_norm:
        return []
    T, hd, L = run.tokens, cfg.head_dim, cfg.layers
    out = []
    for n, heads in (("q", cfg.heads), ("k", cfg.kv_heads)):
        rows, width = ((T,), heads * hd) if cfg.qk_norm_whole else ((T, heads), hd)  # whole: one row per token
        out += [Saved(f"attention.{n}_norm.x_fp32", (*rows, width), "float32", L,
                      "pow(2) and x*rstd keep the fp32 input"),
                Saved(f"attention.{n}_norm.rstd", (*rows, 1), "float32", L, "rsqrt keeps its output, x*rstd too"),
                Saved(f"attention.{n}_norm.x_hat", (*rows, width), "float32", L, "x_hat*weight keeps x_hat")]
    return out


def qk_norm_saved_efficient(cfg: ModelConfig, run: Run, count: int) -> list[Saved]:
    """rope_qkv_norm (the q/k norms fused into the RoPE kernel) keeps the qkv output, its input: `count` instances.
    Without qk_norm rope_qkv keeps no activation."""
    if not cfg.qk_norm:
        return []
    return [Saved("attention.rope_qkv_norm.qkv", (run.tokens, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim),
                  dtypes(run).compute, count, "the fused norm + RoPE keeps its input; rstd is recomputed")]


def _flops(cfg: ModelConfig, run: Run) -> tuple[int, int]:
    """(projection FLOPs, score + AV FLOPs) of one forward over all layers, no causal discount."""
    T, H, q, kv, L = run.tokens, cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.layers
    proj = 2 * T * H * (q + 2 * kv + q)
    sdpa = 2 * (2 * run.batch * cfg.heads * run.seq * run.seq * cfg.head_dim)  # QKᵀ and PV
    return L * proj, L * sdpa


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L = dtypes(run), cfg.layers
    B, S, T, H, nh, hd = run.batch, run.seq, run.tokens, cfg.hidden, cfg.heads, cfg.head_dim
    c = dt.compute
    # repeat_kv is expand + reshape. With one kv head and batch 1 every reshape down to the bmm stays a
    # stride-0 view, so k and v are kept at kv-head size; otherwise a reshape must copy to all nh heads.
    kv_saved = (B * cfg.kv_heads if B == 1 and cfg.kv_heads == 1 else B * nh)
    # the baseline norm returns the residual's dtype: fp32 under amp, so each projection casts it
    saved = linears_saved("attention", T, H, {"q": cfg.q_dim, "k": cfg.kv_dim, "v": cfg.kv_dim}, dt, L, dt.residual)
    saved += _qk_norm_saved_baseline(cfg, run)
    saved += [
        # built once per step by the model and shared by every layer, so saved once
        Saved("attention.rope_cos", (S, hd), c, 1, "q*cos and k*cos keep the table (q, k need no saving)"),
        Saved("attention.rope_sin", (S, hd), c, 1, "rotate_half(q)*sin keeps the table"),
        Saved("attention.q", (B * nh, S, hd), c, L, "QKᵀ keeps q"),
        Saved("attention.k", (kv_saved, hd, S), c, L, "QKᵀ keeps k, expanded to all query heads under GQA"),
        # with sinks each softmax row has one more logit, the head's sink, dropped after it
        Saved("attention.probs_fp32", (B, nh, S, S + cfg.attn_sinks), "float32", L, "softmax keeps its output"),
    ]
    if c != "float32":  # the cast for P@V is a second S×S copy; under fp32 it is the same tensor
        saved.append(Saved("attention.probs_cast", (B * nh, S, S), c, L, "P@V keeps the cast probabilities"))
    saved.append(Saved("attention.v", (kv_saved, S, hd), c, L, "P@V keeps v"))
    saved += linears_saved("attention", T, cfg.q_dim, {"o": H}, dt, L, c)  # o keeps the merged heads (a copy)
    proj, sdpa = _flops(cfg, run)
    # RoPE: 3/element; scale, mask, softmax: 7/score; a bias: 1/element of q, k, v (and o); qk-norm: norm.py's rule
    ew = L * (3 * T * (cfg.q_dim + cfg.kv_dim) + 7 * B * nh * S * (S + cfg.attn_sinks) + T * qkv_bias(cfg)
              + (T * H if cfg.o_bias else 0)) + qk_norm_elementwise(cfg, run)
    # the model convention counts the (query, key) pairs attended: half of S x S, less what a window leaves out
    model = proj + sdpa // 2 - 4 * hd * window_pairs_left_out(cfg, run)
    return Component("attention", L, params(cfg), proj + sdpa, 2 * (proj + sdpa), model, 2 * model, ew, saved)


def sink_pad(device: str) -> int:
    """Columns each head gains for the sinks' key (efficient/attention_sinks.py): 1 on CPU, 8 on CUDA."""
    return 1 if device == "cpu" else 8


def mask_kinds(cfg: ModelConfig, layers=None) -> int:
    """Additive masks the efficient model builds once per forward and SDPA keeps: one for the windowed layers, one
    for the full layers when they have sinks (without sinks they run is_causal, no mask). layers: the indices of
    the layers a forward runs (a pipeline stage's), else all of them."""
    ids = range(cfg.layers) if layers is None else layers
    if cfg.window is None:
        windowed = 0
    elif cfg.window_pattern == "all":
        windowed = len(ids)
    elif isinstance(ids, range) and ids.step == 1:  # the even layers of [a, b), in closed form (a stage of any depth)
        windowed = (ids.stop + 1) // 2 - (ids.start + 1) // 2 if ids.stop > ids.start else 0
    else:
        windowed = sum(cfg.windowed(i) for i in ids)
    return (windowed > 0) + (cfg.attn_sinks and windowed < len(ids))


def frees_mask(cfg: ModelConfig, layer: int) -> bool:
    """Does `layer`'s backward free one of mask_kinds' masks: is it the first layer (in forward order) of its kind,
    the last whose SDPA node keeps the shared mask? The window patterns repeat every two layers, so the layers
    before it that can share its kind are at most two."""
    kind = lambda i: "window" if cfg.windowed(i) else "full" if cfg.attn_sinks else None  # noqa: E731
    return kind(layer) is not None and all(kind(j) != kind(layer) for j in range(min(layer, 2)))


def _sdpa_saved(cfg: ModelConfig, run: Run, device: str, c: str) -> list[Saved]:
    """What the SDPA kernel keeps, per device (read off each backend; see reports/h200/probe_sdpa_h200.json).
    With sinks its q, k, v and output are pad columns wider and k, v one key longer (the sinks' key)."""
    B, S, nh, nkv, hd, L = run.batch, run.seq, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.layers
    wd, sk = (hd + sink_pad(device), S + 1) if cfg.attn_sinks else (hd, S)
    saved = [Saved("attention.sdpa.q", (B, nh, S, wd), c, L, "SDPA backward recomputes P from q, k"),
             Saved("attention.sdpa.k", (B, nkv, sk, wd), c, L, "kept at kv-head size: GQA goes to the kernel"),
             Saved("attention.sdpa.v", (B, nkv, sk, wd), c, L, "P@V's backward needs v"),
             Saved("attention.sdpa.out", (B, nh, S, wd), c, L, "dP needs out (rowsum(dO·O)); o reads a view of it")]
    if kinds := mask_kinds(cfg):
        saved.append(Saved("attention.sdpa.mask", (S, S + cfg.attn_sinks), c, kinds,
                           "each kind of additive mask, built once per forward, kept by every layer's SDPA"))
    if cfg.attn_sinks and nh > 1:  # one head: the merge is a view of SDPA's output, which is kept already
        saved.append(Saved("attention.o.input", (B * S, nh * hd), c, L,
                           "o keeps its input: the output's first hd columns merged over heads, a copy"))
    if device == "cpu":  # the CPU flash-style kernel
        return saved + [Saved("attention.sdpa.logsumexp", (B, nh, S), "float32", L, "softmax statistics per row")]
    if device == "cuda":  # cuDNN, the first choice on Hopper
        if c != "bfloat16":
            raise ConfigError("efficient attention on CUDA is modelled for bf16 (amp or bf16), where cuDNN runs")
        return saved + [Saved("attention.sdpa.stats", (B, nh, S, 1), "float32", L, "softmax statistics per row"),
                        Saved("attention.sdpa.philox_seed", (), "int64", L, "cuDNN keeps its RNG state"),
                        Saved("attention.sdpa.philox_offset", (), "int64", L, "even without dropout")]
    raise ConfigError(f"no SDPA model for device {device!r} (cpu or cuda)")


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L, T, H, S, hd = dtypes(run), cfg.layers, run.tokens, cfg.hidden, run.seq, cfg.head_dim
    c = dt.compute
    qkv = (cfg.heads + 2 * cfg.kv_heads) * hd
    if run.recompute == "full":  # the block's checkpoint keeps its input and the tables, nothing else
        saved = [Saved("attention.x", (run.batch, S, H), dt.residual, L,
                       "the block's checkpoint keeps its input; backward runs the block's forward again")]
    elif run.recompute == "mlp":  # the norm -> qkv checkpoint keeps x; backward re-runs the norm alone
        saved = [Saved("attention.x", (run.batch, S, H), dt.residual, L,
                       "the checkpoint keeps the block input; the norm runs again in backward, qkv does not")]
    else:  # the fused norm already returns the compute dtype: one saved input for the single qkv matmul (in
        # the lean block its node keeps the fp32 weight, not its cast: llm_anatomy/kernels/lean.py)
        saved = linears_saved("attention", T, H, {"qkv": qkv}, dt, L, c, weight_cast=not run.lean_block)
    if run.recompute != "full":
        saved += qk_norm_saved_efficient(cfg, run, L)
    saved += [Saved("attention.rope_cos", (S, hd), "float32", 1, "rope_qkv (or the checkpoint) keeps the fp32 tables"),
              Saved("attention.rope_sin", (S, hd), "float32", 1, "built once per step, shared by all layers")]
    if run.recompute != "full":
        saved += sdpa_o_saved(cfg, run, device, L, o_cast=not run.lean_block)
    proj, sdpa = _flops(cfg, run)
    counted = sdpa if device == "cuda" else 0  # FlopCounterMode has no formula for the CPU SDPA kernel
    # under full recompute backward runs qkv, SDPA's forward and o again (the early stop spares only down)
    again = proj + counted if run.recompute == "full" else 0
    model = proj + sdpa // 2 - 4 * hd * window_pairs_left_out(cfg, run)  # the baseline's convention: pairs attended
    return Component("attention", L, params(cfg), proj + counted, 2 * proj + counted * 5 // 2 + again,
                     model, 2 * model,
                     L * T * (3 * (cfg.q_dim + cfg.kv_dim) + qkv_bias(cfg)) + qk_norm_elementwise(cfg, run), saved)


def sdpa_o_saved(cfg: ModelConfig, run: Run, device: str, count: int, o_cast: bool = True) -> list[Saved]:
    """SDPA's tensors and, under autocast, o's weight cast: `count` instances (L; or 1, what one block's
    re-run makes again in backward under recompute="full"). o_cast=False: o is a lean matmul (the lean
    block), which keeps the fp32 weight instead."""
    dt = dtypes(run)
    saved = [s if s.name == "attention.sdpa.mask" else Saved(s.name, s.shape, s.dtype, count, s.why)
             for s in _sdpa_saved(cfg, run, device, dt.compute)]  # the masks: one per kind, however many layers
    if dt.autocast and o_cast:  # o's input is a view of SDPA's out (laid out (B, S, nh, hd)): only its weight cast is new
        saved.append(Saved("attention.o.weight_cast", (cfg.hidden, cfg.q_dim), dt.compute, count,
                           "autocast's cached cast of the fp32 weight"))
    return saved
