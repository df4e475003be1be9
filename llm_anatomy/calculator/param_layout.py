"""The parameter tensors of the baseline module tree, as the per-rank predictions read them: the root's (outside
the Blocks) and one Block's, each listed once, since every decoder layer of a config has the same shapes.
Pure Python: no torch.

Registration order (`model.named_parameters()`, a tied head counted once under `embed.weight`):
    embed.weight (V, H)
    layers.i: attn_norm.weight (H,), attn.q (q, H), attn.k (kv, H), attn.v (kv, H), attn.o (H, q)
              (q = heads x head_dim, H unless the config states head_dim; with qkv_bias, attn.q.bias (q,)
              after attn.q.weight, and so on for k and v; with qk_norm, attn.q_norm and attn.k_norm (hd,)),
              mlp_norm.weight (H,), mlp.gate (I, H), mlp.up (I, H), mlp.down (H, I)
    norm.weight (H,), head.lm_head.weight (V, H) unless tied
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

from llm_anatomy.config import ModelConfig

Shape = tuple[int, ...]


def units(cfg: ModelConfig) -> tuple[list, list, list]:
    """(the root's tensors before the Blocks, one Block's tensors named within the Block, the root's after)."""
    H, I, V, kv, q = cfg.hidden, cfg.intermediate, cfg.vocab, cfg.kv_dim, cfg.q_dim
    block: list[tuple[str, Shape]] = [("attn_norm.weight", (H,))]
    for n, d in (("q", q), ("k", kv), ("v", kv)):  # each projection's bias follows its weight
        block += [(f"attn.{n}.weight", (d, H))] + ([(f"attn.{n}.bias", (d,))] if cfg.qkv_bias else [])
    block += [("attn.o.weight", (H, q))]
    block += [("attn.q_norm.weight", (cfg.head_dim,)), ("attn.k_norm.weight", (cfg.head_dim,))] if cfg.qk_norm else []
    block += [("mlp_norm.weight", (H,)),
              ("mlp.gate.weight", (I, H)), ("mlp.up.weight", (I, H)), ("mlp.down.weight", (H, I))]
    after = [("norm.weight", (H,))] + ([] if cfg.tie_embeddings else [("head.lm_head.weight", (V, H))])
    return [("embed.weight", (V, H))], block, after


def param_shapes(cfg: ModelConfig) -> list[tuple[str, Shape]]:
    """(name, shape) of every parameter tensor, in `named_parameters()` order: one entry per tensor of every
    layer, for listings and tests; the predictions read shape_counts and fsdp_unit_shapes, which do not grow
    with the depth."""
    before, block, after = units(cfg)
    return before + [(f"layers.{i}.{n}", s) for i in range(cfg.layers) for n, s in block] + after


@lru_cache(maxsize=64)
def shape_counts(cfg: ModelConfig) -> tuple[tuple[Shape, int], ...]:
    """(shape, how many parameter tensors have it): the L identical Blocks counted, not listed."""
    before, block, after = units(cfg)
    c: Counter = Counter()
    for part, k in ((before, 1), (block, cfg.layers), (after, 1)):
        for _, s in part:
            c[s] += k
    return tuple((s, k) for s, k in c.items() if k)


def n_tensors(cfg: ModelConfig) -> int:
    return sum(k for _, k in shape_counts(cfg))


@lru_cache(maxsize=64)
def fsdp_unit_shapes(cfg: ModelConfig) -> tuple:
    """The two kinds of FSDP unit `wrap` builds: the root (everything outside a Block) and one Block (every
    Block has the same shapes); each ("root" | "block", [(name, shape)])."""
    before, block, after = units(cfg)
    return ("root", before + after), ("block", [(f"layers.0.{n}", s) for n, s in block] if cfg.layers else [])
