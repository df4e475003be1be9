"""The efficient model's tensor-parallel layout: the fused projections' rows in rank order, and the way back.

The efficient attention has one qkv weight whose rows are q (heads x hd), k and v (kv_heads x hd each), and the MLP
one gate_up weight whose rows are gate then up (intermediate each). ColwiseParallel gives rank r the r-th of tp
equal row blocks of a weight, so on the one-process order rank 0 would get all of q and none of v. Before the plan
runs, each fused weight (and qkv's bias) is permuted so that row block r is rank r's own heads' q, k and v rows
(its own gate and up rows), exactly the rows ColwiseParallel gives it of the baseline's q, k, v (gate, up):

    one process   [q_0 q_1 .. q_tp-1 | k_0 .. k_tp-1 | v_0 .. v_tp-1]      (x_r: rank r's share of x)
    under TP      [q_0 k_0 v_0 | q_1 k_1 v_1 | .. ]

so rope_qkv and swiglu_packed run unchanged on each rank's local (B, S, width / tp) output. The permutation is a
layout, not another parameter: one_process_state_dict() gathers every tensor and undoes it, and the result loads
into a one-process model of either variant's keys.
"""
from __future__ import annotations

import torch
from torch import nn

from llm_anatomy.config import ModelConfig

def fused_parts(cfg: ModelConfig) -> dict[str, list[int]]:
    """Each fused parameter (its name inside a Block) -> its parts' row counts, in the one-process order."""
    qkv = [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    return {"attn.qkv.weight": qkv, "attn.qkv.bias": qkv, "mlp.gate_up.weight": [cfg.intermediate] * 2}


def rank_order(parts: list[int], tp: int) -> torch.Tensor:
    """Row indices (into the one-process order) of the TP order: rank by rank, each part's share of the rank."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return torch.cat([torch.arange(s + r * (n // tp), s + (r + 1) * (n // tp))
                      for r in range(tp) for s, n in zip(starts, parts)])


def _fused(cfg: ModelConfig, name: str) -> list[int] | None:
    return next((parts for key, parts in fused_parts(cfg).items() if name.endswith(key)), None)


@torch.no_grad()
def to_rank_order(model: nn.Module, tp: int) -> None:
    """Permute every Block's fused rows into the TP order (in place, before parallelize_module shards them)."""
    for name, p in model.named_parameters():
        parts = _fused(model.cfg, name)
        if parts is not None:
            p.data = p.data[rank_order(parts, tp).to(p.device)]


@torch.no_grad()
def one_process_state_dict(model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """The model's state dict as one process holds it: every DTensor gathered whole, the fused rows back in the
    one-process order. Collective: every rank of the mesh calls it."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        parts = _fused(model.cfg, name) if getattr(model, "variant", "baseline") == "efficient" else None
        if parts is not None:
            order = rank_order(parts, tp).to(full.device)
            back = torch.empty_like(full)
            back[order] = full
            full = back
        out[name] = full.detach().clone()
    return out
