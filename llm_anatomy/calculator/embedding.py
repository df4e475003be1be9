"""Token embedding: a lookup, no FLOPs; backward needs only the token ids."""
from __future__ import annotations

from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import ModelConfig, Run


def params(cfg: ModelConfig) -> int:
    return cfg.vocab * cfg.hidden


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    ids = Saved("embedding.ids", (run.batch, run.seq), "int64", 1, "embedding_backward scatters into these rows")
    return Component("embedding", 1, params(cfg), 0, 0, 0, 0, saved=[ids])


efficient = baseline  # the same lookup in both variants
