"""First-principles cost model: from a ModelConfig and a Run alone. Never imports torch or a model.

estimate(cfg, run, variant) -> Estimate: per component, parameters, FLOPs (counter and model
conventions), elementwise FLOPs, and every saved-for-backward tensor. A variant is a function of
that name in each component module (baseline(), and efficient() once it exists).
"""
from __future__ import annotations

from llm_anatomy.calculator import attention, embedding, loss, mlp, norm
from llm_anatomy.calculator.types import Component, Estimate, Saved
from llm_anatomy.config import ConfigError, ModelConfig, Run

COMPONENT_MODULES = {"embedding": embedding, "attention": attention, "norm": norm, "mlp": mlp, "loss": loss}

__all__ = ["estimate", "param_count", "Component", "Estimate", "Saved"]


def param_count(cfg: ModelConfig) -> int:
    return sum(m.params(cfg) for m in COMPONENT_MODULES.values())


def estimate(cfg: ModelConfig, run: Run, variant: str = "baseline", device: str = "cuda") -> Estimate:
    if run.recompute != "none" and variant != "efficient":
        raise ConfigError(f"recompute={run.recompute!r} is an option of the efficient variant, not {variant!r}")
    comps = {}
    for name, mod in COMPONENT_MODULES.items():
        fn = getattr(mod, variant, None)
        if fn is None:
            raise ConfigError(f"the calculator has no {variant!r} variant for {name}")
        comps[name] = fn(cfg, run, device)
    return Estimate(cfg.to_dict(), run.to_dict(), variant, device, comps)
