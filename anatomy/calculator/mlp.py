"""The gated MLP: SwiGLU, or gpt-oss's (clamp(up) + 1) * silu(clamp(gate))."""
from __future__ import annotations

from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.linear import linears_saved
from anatomy.calculator.types import Component, Saved
from anatomy.config import ModelConfig, Run


def params(cfg: ModelConfig) -> int:
    return cfg.layers * 3 * cfg.hidden * cfg.intermediate


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L, T, H, I = dtypes(run), cfg.layers, run.tokens, cfg.hidden, cfg.intermediate
    B, S, c = run.batch, run.seq, dtypes(run).compute
    saved = linears_saved("mlp", T, H, {"gate": I, "up": I}, dt, L, dt.residual)
    if cfg.mlp == "gpt-oss":
        saved += [
            Saved("mlp.gate_raw", (B, S, I), c, L, "clamp keeps its input for the pass-through mask"),
            Saved("mlp.up_raw", (B, S, I), c, L, "clamp keeps its input for the pass-through mask"),
            Saved("mlp.gate", (B, S, I), c, L, "silu keeps the clamped gate"),
            Saved("mlp.up_plus_1", (B, S, I), c, L, "the product keeps the +1 output"),
        ]
    else:
        saved += [Saved("mlp.gate", (B, S, I), c, L, "silu keeps its input"),
                  Saved("mlp.up", (B, S, I), c, L, "the product keeps up")]
    saved.append(Saved("mlp.silu_gate", (B, S, I), c, L, "the product keeps silu(gate)"))
    saved += linears_saved("mlp", T, I, {"down": H}, dt, L, c)  # the product, in the compute dtype
    f = L * 2 * T * H * I * 3
    ew = L * T * I * (5 + (3 if cfg.mlp == "gpt-oss" else 0))  # silu 4 + mul 1 (+ 2 clamps, +1)
    return Component("mlp", L, params(cfg), f, 2 * f, f, 2 * f, ew, saved)


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L, T, H, I = dtypes(run), cfg.layers, run.tokens, cfg.hidden, cfg.intermediate
    c = dt.compute
    saved = linears_saved("mlp", T, H, {"gate_up": 2 * I}, dt, L, c)
    saved.append(Saved("mlp.gate_up", (run.batch, run.seq, 2 * I), c, L,
                       "the fused activation keeps gate and up (two views of one tensor); silu is recomputed"))
    saved += linears_saved("mlp", T, I, {"down": H}, dt, L, c)
    f = L * 2 * T * H * I * 3
    ew = L * T * I * (5 + (3 if cfg.mlp == "gpt-oss" else 0))
    return Component("mlp", L, params(cfg), f, 2 * f, f, 2 * f, ew, saved)
