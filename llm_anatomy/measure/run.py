"""measure(): build the real model and measure what this device can measure. Never reads the calculator."""
from __future__ import annotations

import torch

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.flops import count_flops
from llm_anatomy.measure.saved import SavedTensorTracer
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype


def measure_params(cfg: ModelConfig, variant: str = "baseline") -> int:
    model = build_model(cfg, variant, device="meta")  # no memory: parameter counts are shapes
    return sum(p.numel() for p in model.parameters())  # a tied weight is listed once


def measure_flops(cfg: ModelConfig, run: Run, variant: str = "baseline", device="meta") -> dict:
    model = build_model(cfg, variant, device=device, dtype=param_dtype(run), recompute=run.recompute, lean=run.lean)
    ids, targets = make_batch(cfg, run, device)
    dev = torch.device(device).type

    def fwd():
        with autocast_ctx(run, dev) if dev != "meta" else torch.enable_grad():  # no autocast on meta
            return model(ids, targets)

    return count_flops(model, fwd)


def measure_saved(cfg: ModelConfig, run: Run, variant: str = "baseline", device="cpu") -> SavedTensorTracer:
    model = build_model(cfg, variant, device=device, dtype=param_dtype(run), recompute=run.recompute, lean=run.lean)
    ids, targets = make_batch(cfg, run, device)
    with SavedTensorTracer(model) as tracer, autocast_ctx(run, torch.device(device).type):
        loss = model(ids, targets)
    del loss  # frees the graph and the saved tensors
    return tracer


def measure(cfg: ModelConfig, run: Run, variant: str = "baseline", device="cpu", saved_run: Run | None = None) -> dict:
    """The same keys as Estimate.to_dict(). saved_run: a smaller run for the passes that need real tensors
    when the requested one does not fit this device. The baseline's FLOPs are counted at full size on
    meta tensors (its matmuls count the same on every device); the efficient variant's SDPA is a
    different kernel on every device (meta falls back to the math path), so its FLOPs are counted on
    the device itself, at saved_run."""
    sr = saved_run or run
    flops_run, flops_dev = (run, "meta") if variant == "baseline" else (sr, device)
    flops = measure_flops(cfg, flops_run, variant, device=flops_dev)
    saved = measure_saved(cfg, sr, variant, device).report
    return {
        "device": str(device), "variant": variant, "params": measure_params(cfg, variant),
        "flops": {"counter": {"forward": flops["forward"]["total"], "backward": flops["backward"]["total"]},
                  "by_component": flops, "device": str(flops_dev),
                  "run": flops_run.to_dict()},
        "memory": {"saved": {"total": saved.storage_bytes(), "by_component": saved.by_component(),
                             "tensor_bytes": saved.tensor_bytes(),
                             "run": sr.to_dict()}},
    }
