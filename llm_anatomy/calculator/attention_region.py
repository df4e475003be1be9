"""The efficient attention's forward inside the block's checkpoint (Run.recompute "full": efficient/transformer.py's
BlockCheckpoint), allocation by allocation, as moe_region.py replays the MoE block's.

Inside a checkpoint in forward nothing is saved: what lives is what Attention.forward still holds. Its locals live
until it returns: the normed input (an argument), qkv's output, OLMoE's normed q and k (qk_norm_whole), rope's q, k
and v, SDPA's output, the sinks' merged copy (efficient/attention_sinks.py) and o's output. What a call makes and
drops goes when the call returns: the concatenation rope_qkv reads, sink_sdpa's sink column and padded q', k', v',
SDPA's row statistics. Autocast caches each weight's and bias's cast (qkv's, o's) to the end of the forward, and the
first layer of each kind builds its additive mask (attention_sinks.attention_mask: two bool (S, S + sinks) tensors
beside the mask, three under a window), which the forward's shared masks keep.

In a layer's re-run in backward (rerun=True) the tensors the ops save stay (KEPT), the bias casts stay in the
re-run's autocast cache until it ends, and every layer with a mask builds its own (no shared masks in backward).

Each segment's largest moment is returned (qkv, rope, mask, sdpa, o): the largest of them is the region's peak,
since a segment's frees come only at its end. Pure Python (no torch).
"""
from __future__ import annotations

from llm_anatomy.calculator.attention import sink_pad
from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.moe_region import Live
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import ModelConfig, Run

F32, I64 = 4, 8
# what the region's ops save: kept by a re-run in backward, dropped in forward (q, k, v are SDPA's own without
# sinks; with sinks SDPA keeps the padded copies and o the merged copy)
KEPT = ("normed", "qkv cast", "o cast", "q'", "k'", "v'", "out", "stats", "philox", "mask", "merged")


def has_mask(cfg: ModelConfig, layer: int) -> bool:
    """Does the layer pass SDPA an additive mask (a window, or sinks), rather than is_causal?"""
    return cfg.windowed(layer) or cfg.attn_sinks


def bias_casts(cfg: ModelConfig, run: Run, rnd) -> int:
    """Under autocast, one layer's qkv and o bias casts (autocast's cache; addmm saves neither); 0 otherwise."""
    dt = dtypes(run)
    if not dt.autocast:
        return 0
    c, D = BYTES[dt.compute], cfg.q_dim + 2 * cfg.kv_dim
    return (rnd(D * c) if cfg.qkv_bias else 0) + (rnd(cfg.hidden * c) if cfg.o_bias else 0)


def segments(cfg: ModelConfig, run: Run, device: str, rnd, layer: int, rerun: bool = False,
             builds_mask: bool = False) -> dict[str, int]:
    """{segment: its largest live bytes} inside layer `layer`'s attention, beyond what lived before its norm's output
    (module docstring). builds_mask: in forward, the layer is the first of its kind and builds its mask."""
    dt = dtypes(run)
    c, cast = BYTES[dt.compute], dt.autocast
    B, S, T, H, nh, nkv, hd = run.batch, run.seq, run.tokens, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    q, kv, sinks = cfg.q_dim, cfg.kv_dim, cfg.attn_sinks
    D = q + 2 * kv
    kept = KEPT + (("qkv",) if cfg.qk_norm else ()) + (() if sinks else ("q", "k", "v"))
    v, out = Live(rnd, kept if rerun else ()), {}

    def mark(name: str) -> None:
        out[name], v.top = v.top, v.now

    v.alloc("normed", T * H * c)
    if cast:  # the weight's (saved) and the bias's (cached) casts
        v.alloc("qkv cast", D * H * c)
        v.alloc("bias casts", D * c if cfg.qkv_bias else 0)
    v.alloc("qkv", T * D * c)
    mark("qkv")
    if cfg.qk_norm_whole:  # the fused norm over q's and k's columns (views of qkv), then the plain RoPE on a cat
        v.alloc("qn", T * q * c)
        v.alloc("kn", T * kv * c)
        v.alloc("cat", T * D * c)
    for name, heads in (("q", nh), ("k", nkv), ("v", nkv)):  # rope_qkv's (or rope_qkv_norm's) three outputs
        v.alloc(name, B * heads * S * hd * c)
    mark("rope")
    v.free(*(("cat",) if cfg.qk_norm_whole else ()))
    if has_mask(cfg, layer) and (rerun or builds_mask):  # attention_mask: the future (and the window's past)
        Sk = S + sinks
        v.alloc("ones", S * Sk)
        v.alloc("far", S * Sk)
        v.free("ones")
        if cfg.windowed(layer):
            v.alloc("ones", S * Sk)
            v.alloc("tril", S * Sk)
            v.free("ones", "tril")
        v.alloc("mask", S * Sk * c)
        v.free("far")
        mark("mask")
    wd, sk = (hd + sink_pad(device), S + 1) if sinks else (hd, S)
    if sinks:  # sink_sdpa: the sink column (s / scale cast to c), then the padded q', k', v'
        pad = sink_pad(device)
        if dt.param != "float32":  # sinks.float(): a copy, gone after the division
            v.alloc("sinks fp32", nh * F32)
        v.alloc("col fp32", nh * F32)
        v.free(*(("sinks fp32",) if dt.param != "float32" else ()))
        if c != F32:  # the expanded column's cast to q's dtype; in fp32 it is a view
            v.alloc("col", B * nh * S * c)
            v.free("col fp32")
        v.alloc("zeros", B * nh * S * (pad - 1) * c)
        v.alloc("q'", B * nh * S * wd * c)
        v.free("zeros")
        v.alloc("k'", B * nkv * sk * wd * c)
        v.alloc("v'", B * nkv * sk * wd * c)
    v.alloc("out", B * nh * S * wd * c)
    for n, size in _stats(cfg, run, device):
        v.alloc(n, size)
    mark("sdpa")
    v.free("stats", "philox", *(("q'", "k'", "v'", "col", "col fp32") if sinks else ()))
    if sinks and nh > 1:  # o's input: the output's first hd columns merged over heads, a copy
        v.alloc("merged", T * q * c)
    if cast:
        v.alloc("o cast", H * q * c)
        v.alloc("bias casts", H * c if cfg.o_bias else 0)
    v.alloc("o out", T * H * c)
    mark("o")
    return out


def _stats(cfg: ModelConfig, run: Run, device: str) -> list[tuple[str, int]]:
    """SDPA's outputs beside its output, per device (calculator/attention.py's _sdpa_saved): the CPU kernel's
    logsumexp; cuDNN's statistics and RNG state."""
    B, S, nh = run.batch, run.seq, cfg.heads
    if device == "cpu":
        return [("stats", B * nh * S * F32)]
    return [("stats", B * nh * S * F32), ("philox", I64), ("philox", I64)]
