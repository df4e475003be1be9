"""CUDA memory at the phase boundaries of one training step, and forensics of the peak.

Phases: init (model + inputs), forward (saved activations live), backward peak (inside backward),
after backward (gradients live), after the optimizer step (optimizer state live). Figures are
torch.cuda.memory_allocated / max_memory_allocated (what the caching allocator handed out, in
512-byte-rounded blocks) and memory_reserved (what it holds from the driver: looser).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from anatomy.config import ModelConfig, Run
from anatomy.models import autocast_ctx, build_model, make_batch, param_dtype


@dataclass
class Phase:
    name: str
    allocated: int  # bytes at the end of the phase
    peak: int  # max_memory_allocated during the phase
    reserved: int


def _phase(name: str) -> Phase:
    torch.cuda.synchronize()
    p = Phase(name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved())
    torch.cuda.reset_peak_memory_stats()
    return p


def measure_phases(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = "adamw",
                   steps: int = 2) -> list[dict]:
    """Phases of the last of `steps` steps (the first allocates optimizer state and warms up kernels)."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, variant, device="cuda", dtype=param_dtype(run))
    ids, targets = make_batch(cfg, run, "cuda")
    opt = None
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif optimizer == "ademamix":
        from anatomy.optim import FusedAdEMAMix

        opt = FusedAdEMAMix(model.parameters(), lr=1e-4)
    phases = [_phase("init")]
    for _ in range(steps):
        phases = phases[:1]
        with autocast_ctx(run, "cuda"):
            loss = model(ids, targets)
        phases.append(_phase("forward"))
        loss.backward()
        del loss
        phases.append(_phase("backward"))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases.append(_phase("optimizer"))
        else:
            model.zero_grad(set_to_none=True)
    out = [dict(asdict(p), allocated=p.allocated - base, peak=p.peak - base) for p in phases]
    del model, opt, ids, targets
    torch.cuda.empty_cache()
    return out


def peak_forensics(cfg: ModelConfig, run: Run, variant: str = "baseline", top: int = 12) -> dict:
    """Record the allocation history of one fwd+bwd and return the largest allocations live at the peak,
    with the Python frame that made each (for attribution to components)."""
    model = build_model(cfg, variant, device="cuda", dtype=param_dtype(run))
    ids, targets = make_batch(cfg, run, "cuda")
    with autocast_ctx(run, "cuda"):  # warm-up: kernels, cuBLAS workspace, autocast caches
        model(ids, targets).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with autocast_ctx(run, "cuda"):
            loss = model(ids, targets)
        loss.backward()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return dict(snapshot_traces=len(snap.get("device_traces", [[]])[0]), snapshot=snap)
