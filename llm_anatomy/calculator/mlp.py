"""The gated MLP: SwiGLU, or gpt-oss's (clamp(up) + 1) * silu(clamp(gate))."""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import ModelConfig, Run


def params(cfg: ModelConfig) -> int:
    return cfg.layers * 3 * cfg.hidden * cfg.intermediate


def gated_saved(prefix: str, cfg: ModelConfig, run: Run, width: int, count: int) -> list[Saved]:
    """What the unfused gated MLP of `width` keeps after its gate and up matmuls' inputs: gate and up (and
    gpt-oss's raw ones), silu(gate), and down's input and weight cast."""
    dt, B, S, H, L = dtypes(run), run.batch, run.seq, cfg.hidden, count
    c, shape = dt.compute, (run.batch, run.seq, width)
    if cfg.mlp == "gpt-oss":
        saved = [
            Saved(f"{prefix}.gate_raw", shape, c, L, "clamp keeps its input for the pass-through mask"),
            Saved(f"{prefix}.up_raw", shape, c, L, "clamp keeps its input for the pass-through mask"),
            Saved(f"{prefix}.gate", shape, c, L, "silu keeps the clamped gate"),
            Saved(f"{prefix}.up_plus_1", shape, c, L, "the product keeps the +1 output"),
        ]
    else:
        saved = [Saved(f"{prefix}.gate", shape, c, L, "silu keeps its input"),
                 Saved(f"{prefix}.up", shape, c, L, "the product keeps up")]
    saved.append(Saved(f"{prefix}.silu_gate", shape, c, L, "the product keeps silu(gate)"))
    return saved + linears_saved(prefix, B * S, width, {"down": H}, dt, L, c)  # the product, in the compute dtype


def elementwise_per_row(cfg: ModelConfig, width: int) -> int:
    """Elementwise FLOPs of one row of the gated activation: silu 4 + mul 1 (+ gpt-oss's 2 clamps and +1)."""
    return width * (5 + (3 if cfg.mlp == "gpt-oss" else 0))


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, L, T, H, I = dtypes(run), cfg.layers, run.tokens, cfg.hidden, cfg.intermediate
    saved = linears_saved("mlp", T, H, {"gate": I, "up": I}, dt, L, dt.residual) + gated_saved("mlp", cfg, run, I, L)
    f = L * 2 * T * H * I * 3
    return Component("mlp", L, params(cfg), f, 2 * f, f, 2 * f, L * T * elementwise_per_row(cfg, I), saved)


def efficient_saved(cfg: ModelConfig, run: Run, recomputed: bool = False) -> list[Saved]:
    """What the MLP keeps without recompute: gate_up's input and weight cast, gate_up, and down's input (the
    activation h) and weight cast. In the lean block (Run.lean) gate_up's lean matmul and the fused SwiGLU +
    down node keep the fp32 weights, not their casts, and h is made again in backward (llm_anatomy/kernels/lean.py).
    recomputed: what one layer's checkpoint makes again in backward under recompute (nn.Linear there): the
    residual sum that its norm keeps and the same tensors as without the lean block."""
    dt, L, T, H, I = dtypes(run), cfg.layers, run.tokens, cfg.hidden, cfg.intermediate
    c, lean = dt.compute, run.lean_block and not recomputed
    if recomputed:
        L = 1
    saved = [Saved("mlp.x", (run.batch, run.seq, H), dt.residual, 1, "the norm keeps the sum")] if recomputed else []
    saved += linears_saved("mlp", T, H, {"gate_up": 2 * I}, dt, L, c, weight_cast=not lean)
    saved.append(Saved("mlp.gate_up", (run.batch, run.seq, 2 * I), c, L,
                       "the fused activation keeps gate and up (two views of one tensor); silu is recomputed"))
    return saved + ([] if lean else linears_saved("mlp", T, I, {"down": H}, dt, L, c))


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    L, T, H, I = cfg.layers, run.tokens, cfg.hidden, cfg.intermediate
    f = L * 2 * T * H * I * 3
    ew = L * T * I * (5 + (3 if cfg.mlp == "gpt-oss" else 0))
    if run.recompute == "full":  # the block's checkpoint keeps nothing of the MLP; backward runs gate_up again
        return Component("mlp", L, params(cfg), f, 2 * f + L * 2 * T * H * 2 * I, f, 2 * f, ew, [])
    if run.recompute == "mlp":  # backward runs the sum, the norm, gate_up and the activation again
        branch = Saved("mlp.branch", (run.batch, run.seq, H), dtypes(run).compute, L,
                       "the checkpoint keeps its inputs: the attention branch (the block input is attention's)")
        return Component("mlp", L, params(cfg), f, 2 * f + L * 2 * T * H * 2 * I, f, 2 * f, ew, [branch])
    return Component("mlp", L, params(cfg), f, 2 * f, f, 2 * f, ew, efficient_saved(cfg, run))
