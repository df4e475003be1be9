"""First-principles cost model: from a ModelConfig and a Run alone. Never imports torch or a model.

estimate(cfg, run, variant) -> Estimate: per component, parameters, FLOPs (counter and model
conventions), elementwise FLOPs, and every saved-for-backward tensor. A variant is a function of
that name in each component module (baseline(), and efficient() once it exists).
"""
from __future__ import annotations

from llm_anatomy.calculator import attention, embedding, loss, mlp, moe, norm
from llm_anatomy.calculator.types import Component, Estimate, Saved
from llm_anatomy.config import ConfigError, ModelConfig, Run

COMPONENT_MODULES = {"embedding": embedding, "attention": attention, "norm": norm, "mlp": mlp, "loss": loss}
# a mixture-of-experts config: the "moe" block (calculator/moe.py) in the MLP's place
MOE_COMPONENT_MODULES = {"embedding": embedding, "attention": attention, "norm": norm, "moe": moe, "loss": loss}

__all__ = ["estimate", "param_count", "active_param_count", "Component", "Estimate", "Saved"]


def component_modules(cfg: ModelConfig) -> dict:
    return MOE_COMPONENT_MODULES if cfg.moe else COMPONENT_MODULES


def param_count(cfg: ModelConfig) -> int:
    return sum(m.params(cfg) for m in component_modules(cfg).values())


def active_param_count(cfg: ModelConfig) -> int:
    """The parameters one token's forward reaches: all of them but the routed experts it is not sent to."""
    return param_count(cfg) - moe.inactive_params(cfg)


def estimate(cfg: ModelConfig, run: Run, variant: str = "baseline", device: str = "cuda") -> Estimate:
    if run.recompute != "none" and variant != "efficient":
        raise ConfigError(f"recompute={run.recompute!r} is an option of the efficient variant, not {variant!r}")
    comps = {}
    for name, mod in component_modules(cfg).items():
        fn = getattr(mod, variant, None)
        if fn is None:
            raise ConfigError(f"the calculator has no {variant!r} variant for {name}")
        comps[name] = fn(cfg, run, device)
    return Estimate(cfg.to_dict(), run.to_dict(), variant, device, comps)
