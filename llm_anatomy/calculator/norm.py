"""RMSNorm: 2 per layer plus the final one."""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import ModelConfig, Run


def instances(cfg: ModelConfig) -> int:
    return 2 * cfg.layers + 1


def params(cfg: ModelConfig) -> int:
    return instances(cfg) * cfg.hidden


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    B, S, H, n = run.batch, run.seq, cfg.hidden, instances(cfg)
    saved = [
        # x.float() is the fp32 residual itself under amp/fp32, an fp32 copy under bf16; pow and mul keep it
        Saved("norm.x_fp32", (B, S, H), "float32", n, "pow(2) and x*rstd keep the fp32 input"),
        Saved("norm.rstd", (B, S, 1), "float32", n, "rsqrt keeps its output; x*rstd keeps it too"),
        Saved("norm.x_hat", (B, S, H), "float32", n, "x_hat*weight keeps x_hat for the weight's gradient"),
    ]
    return Component("norm", n, params(cfg), 0, 0, 0, 0,
                     flops_elementwise_fwd=n * B * S * (4 * H + 2), saved=saved)


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    n = instances(cfg)
    # under recompute both norms of a block run inside checkpoints, which keep x themselves
    kept = 1 if run.recompute != "none" else n
    x = Saved("norm.x", (run.batch, run.seq, cfg.hidden), dtypes(run).residual, kept,
              "the fused kernel keeps only its input (and the weight); rstd is recomputed in backward")
    return Component("norm", n, params(cfg), 0, 0, 0, 0, flops_elementwise_fwd=n * run.tokens * (4 * cfg.hidden + 2),
                     saved=[x])
