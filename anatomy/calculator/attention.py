"""Causal self-attention with GQA and RoPE."""
from __future__ import annotations

from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.linear import linears_saved
from anatomy.calculator.types import Component, Saved
from anatomy.config import ModelConfig, Run


def params(cfg: ModelConfig) -> int:
    H, kv = cfg.hidden, cfg.kv_dim
    return cfg.layers * (H * H + 2 * H * kv + H * H)  # q, k, v, o


def _flops(cfg: ModelConfig, run: Run) -> tuple[int, int]:
    """(projection FLOPs, score + AV FLOPs) of one forward over all layers, no causal discount."""
    T, H, kv, L = run.tokens, cfg.hidden, cfg.kv_dim, cfg.layers
    proj = 2 * T * H * (H + 2 * kv + H)
    sdpa = 2 * (2 * run.batch * cfg.heads * run.seq * run.seq * cfg.head_dim)  # QKᵀ and PV
    return L * proj, L * sdpa


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L = dtypes(run), cfg.layers
    B, S, T, H, nh, hd = run.batch, run.seq, run.tokens, cfg.hidden, cfg.heads, cfg.head_dim
    c = dt.compute
    # repeat_kv is expand + reshape. With one kv head and batch 1 every reshape down to the bmm stays a
    # stride-0 view, so k and v are kept at kv-head size; otherwise a reshape must copy to all nh heads.
    kv_saved = (B * cfg.kv_heads if B == 1 and cfg.kv_heads == 1 else B * nh)
    # fp32: the norm output is saved as it is; bf16: the norm's bf16 output; amp: one bf16 cast per projection
    saved = linears_saved("attention", T, H, {"q": H, "k": cfg.kv_dim, "v": cfg.kv_dim}, dt, L, c)
    saved += [
        # built once per step by the model and shared by every layer, so saved once
        Saved("attention.rope_cos", (S, hd), c, 1, "q*cos and k*cos keep the table (q, k need no saving)"),
        Saved("attention.rope_sin", (S, hd), c, 1, "rotate_half(q)*sin keeps the table"),
        Saved("attention.q", (B * nh, S, hd), c, L, "QKᵀ keeps q"),
        Saved("attention.k", (kv_saved, hd, S), c, L, "QKᵀ keeps k, expanded to all query heads under GQA"),
        Saved("attention.probs_fp32", (B, nh, S, S), "float32", L, "softmax keeps its output"),
    ]
    if c != "float32":  # the cast for P@V is a second S×S copy; under fp32 it is the same tensor
        saved.append(Saved("attention.probs_cast", (B * nh, S, S), c, L, "P@V keeps the cast probabilities"))
    saved.append(Saved("attention.v", (kv_saved, S, hd), c, L, "P@V keeps v"))
    saved += linears_saved("attention", T, H, {"o": H}, dt, L, c)  # o keeps the merged heads
    proj, sdpa = _flops(cfg, run)
    ew = L * (3 * T * (H + cfg.kv_dim) + 7 * B * nh * S * S)  # RoPE: 3/element; scale, mask, softmax: 7/score
    return Component("attention", L, params(cfg), proj + sdpa, 2 * (proj + sdpa),
                     proj + sdpa // 2, 2 * (proj + sdpa // 2), ew, saved)
