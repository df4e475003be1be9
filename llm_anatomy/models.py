"""build_model(cfg, variant): the one place that maps a variant name to its module tree."""
from __future__ import annotations

import torch

from llm_anatomy.config import RECOMPUTE, ConfigError, ModelConfig, Run

VARIANTS = ("baseline", "efficient")


def build_model(cfg: ModelConfig, variant: str = "baseline", device="cpu", dtype=None, seed: int | None = 0,
                recompute: str = "none", lean: bool = False):
    """Build a model on `device`; dtype defaults to fp32 (master weights). Meta builds allocate nothing.
    recompute, lean: Run.recompute and Run.lean, options of the efficient variant."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute != "none" and variant != "efficient":
        raise ConfigError(f"recompute={recompute!r} is an option of the efficient variant, not {variant!r}")
    kw = {} if recompute == "none" else dict(recompute=recompute)
    if lean and variant == "efficient":  # the baseline ignores it, as it ignores Run.loss_impl
        kw["lean"] = True
    if variant == "baseline":
        from llm_anatomy.baseline.transformer import Transformer
    elif variant == "efficient":
        try:
            from llm_anatomy.efficient.transformer import Transformer
        except ImportError as e:
            raise ConfigError(f"the efficient variant is not available: {e}") from None
    else:
        raise ConfigError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg, **kw)
    init_weights(model, seed)
    return model.to(dtype) if dtype is not None else model


def init_weights(model: torch.nn.Module, seed: int | None = 0) -> None:
    """Normal(0, 0.02) for matrices (the stacked expert tensors too) and biases (an expert's gate_up_bias and
    down_bias, attention sinks), ones for norm weights: identical across variants for the same
    seed. Biases are drawn after every weight, as one vector split in module order (the same values whether
    q, k, v are separate or fused), so a bias-free model draws what it always drew. They are drawn, not zeroed
    as Hugging Face inits them, so that a test sees where they are added."""
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]  # a tied weight once
    if not named:
        return
    gen = torch.Generator(device=named[0][1].device)
    gen.manual_seed(seed or 0)
    drawn = lambda n: n.endswith((".bias", "_bias", ".sinks"))  # noqa: E731
    biases = [p for n, p in named if drawn(n)]
    with torch.no_grad():
        for name, p in named:
            if drawn(name):
                continue
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        if biases:
            flat = torch.empty(sum(b.numel() for b in biases), device=biases[0].device).normal_(0.0, 0.02,
                                                                                                 generator=gen)
            for b, part in zip(biases, flat.split([b.numel() for b in biases])):
                b.copy_(part.view_as(b))


def param_dtype(run: Run) -> torch.dtype:
    return torch.bfloat16 if run.dtype == "bf16" else torch.float32


def autocast_ctx(run: Run, device_type: str):
    """The forward context for a dtype policy: bf16 autocast for 'amp', nothing otherwise."""
    import contextlib

    if run.dtype == "amp":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_batch(cfg: ModelConfig, run: Run, device="cpu", seed: int = 0):
    """Random token ids and targets, (B, S) int64 each (separate storages, as a loader's x and y would be)."""
    if str(device) == "meta":
        return (torch.empty(run.batch, run.seq, dtype=torch.long, device="meta"),
                torch.empty(run.batch, run.seq, dtype=torch.long, device="meta"))
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (run.batch, run.seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (run.batch, run.seq), generator=g)
    return ids.to(device), targets.to(device)
