"""The parameter tensors of the baseline module tree, as the per-rank predictions read them: the root's (outside
the Blocks) and one Block's, each listed once, since every decoder layer of a config has the same shapes.
Pure Python: no torch.

Registration order (`model.named_parameters()`, a tied head counted once under `embed.weight`):
    embed.weight (V, H)
    layers.i: attn_norm.weight (H,), attn.q (q, H), attn.k (kv, H), attn.v (kv, H), attn.o (H, q)
              (q = heads x head_dim, H unless the config states head_dim; with qkv_bias, attn.q.bias (q,)
              after attn.q.weight, and so on for k and v; with qk_norm, attn.q_norm and attn.k_norm (hd,)),
              (with o_bias, attn.o.bias (H,) after attn.o.weight; under qk_norm_whole the norms are (q,) and (kv,);
              with attn_sinks, attn.sinks (heads,) first, Attention's own tensor before its children's),
              mlp_norm.weight (H,), mlp.gate (I, H), mlp.up (I, H), mlp.down (H, I)
              (a mixture of experts instead: mlp.router.weight (E, H) [+ .bias (E,)], mlp.experts.gate_up (E, 2I, H),
              mlp.experts.down (E, H, I) [+ gate_up_bias (E, 2I), down_bias (E, H)], mlp.shared.gate/up/down of
              width shared_experts x shared_intermediate, if any)
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
    block += [("attn.sinks", (cfg.heads,))] if cfg.attn_sinks else []  # the module's own tensor: before its children
    for n, d in (("q", q), ("k", kv), ("v", kv)):  # each projection's bias follows its weight
        block += [(f"attn.{n}.weight", (d, H))] + ([(f"attn.{n}.bias", (d,))] if cfg.qkv_bias else [])
    block += [("attn.o.weight", (H, q))] + ([("attn.o.bias", (H,))] if cfg.o_bias else [])
    qn, kn = (q, kv) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
    block += [("attn.q_norm.weight", (qn,)), ("attn.k_norm.weight", (kn,))] if cfg.qk_norm else []
    block += [("mlp_norm.weight", (H,))] + (_moe(cfg) if cfg.moe else
                                            [("mlp.gate.weight", (I, H)), ("mlp.up.weight", (I, H)),
                                             ("mlp.down.weight", (H, I))])
    after = [("norm.weight", (H,))] + ([] if cfg.tie_embeddings else [("head.lm_head.weight", (V, H))])
    return [("embed.weight", (V, H))], block, after


def _moe(cfg: ModelConfig) -> list[tuple[str, Shape]]:
    """The MoE block's tensors, in registration order (the module contract in docs/moe.md)."""
    E, H, I, Is = cfg.experts, cfg.hidden, cfg.expert_intermediate, cfg.shared_experts * (cfg.shared_intermediate or 0)
    out = [("mlp.router.weight", (E, H))] + ([("mlp.router.bias", (E,))] if cfg.router_bias else [])
    out += [("mlp.experts.gate_up", (E, 2 * I, H)), ("mlp.experts.down", (E, H, I))]
    out += [("mlp.experts.gate_up_bias", (E, 2 * I)), ("mlp.experts.down_bias", (E, H))] if cfg.expert_bias else []
    if Is:
        out += [("mlp.shared.gate.weight", (Is, H)), ("mlp.shared.up.weight", (Is, H)),
                ("mlp.shared.down.weight", (H, Is))]
    return out


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
