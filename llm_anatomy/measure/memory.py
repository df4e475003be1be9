"""CUDA memory at the phase boundaries of one training step, and forensics of the peak.

Phases: init (model + inputs), forward (saved activations live), backward peak (inside backward),
after backward (gradients live), after the optimizer step (optimizer state live). Figures are
torch.cuda.memory_allocated / max_memory_allocated (what the caching allocator handed out, in
512-byte-rounded blocks) and memory_reserved (what it holds from the driver: looser), plus the
allocator's own requested_bytes counters (the sizes asked for, before any block is rounded or
reused whole).

Allocated and requested differ by more than the 512-byte rounding only when the allocator hands a
cached block out whole: by default it splits a large-pool block only when more than 1 MiB would
remain, so a reused block can carry up to 1 MiB of slack per tensor. With
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it splits whenever 512 bytes would remain, and
allocated is exactly the 512-rounded requested bytes (splits_every_block()).

record_step() records the allocator's history over a step, with markers naming the running
component and phase; llm_anatomy.measure.forensics replays it to attribute the peak (pure Python).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.components import ComponentTracker
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype


@dataclass
class Phase:
    name: str
    allocated: int  # bytes at the end of the phase
    peak: int  # max_memory_allocated during the phase
    reserved: int
    requested: int = 0  # the allocator's requested_bytes at the end of the phase (sizes asked for)
    requested_peak: int = 0  # and its peak during the phase


def allocator_conf() -> str:
    """The caching allocator's settings, as this process was started with them."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


def splits_every_block() -> bool:
    """True when the allocator splits every reused block down to its request (expandable segments):
    then max_memory_allocated counts no slack beyond the 512-byte rounding."""
    opts = dict(kv.split(":", 1) for kv in allocator_conf().replace(" ", "").split(",") if ":" in kv)
    return opts.get("expandable_segments", "").lower() == "true"


def _phase(name: str) -> Phase:
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    p = Phase(name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved(),
              st.get("requested_bytes.all.current", 0), st.get("requested_bytes.all.peak", 0))
    torch.cuda.reset_peak_memory_stats()
    return p


def setup_step(cfg: ModelConfig, run: Run, variant: str, optimizer: str | None, device: str = "cuda"):
    """The model, a batch and the optimizer on `device`, as a training step would have them (fused
    optimizers on CUDA, plain ones elsewhere)."""
    model = build_model(cfg, variant, device=device, dtype=param_dtype(run), recompute=run.recompute, lean=run.lean)
    if hasattr(model.head, "impl"):  # the efficient model's loss: Run.loss_impl
        model.head.impl = run.loss_impl
    ids, targets = make_batch(cfg, run, device)
    opt = None
    if optimizer == "adamw":
        kw = dict(fused=True) if device == "cuda" else dict(foreach=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    elif optimizer == "ademamix":
        from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix

        opt = (FusedAdEMAMix if device == "cuda" else AdEMAMix)(model.parameters(), lr=1e-4)
    elif optimizer is not None:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    return model, ids, targets, opt


def phased_steps(model, ids, targets, opt, run: Run, steps: int, phase, device: str = "cuda") -> list:
    """`steps` training steps; phase(name) is called at every phase boundary and its results of the
    last step are returned (the first step warms up kernels and allocates optimizer state)."""
    phases = [phase("init")]
    for _ in range(steps):
        phases = phases[:1]
        with autocast_ctx(run, device):
            loss = model(ids, targets)
        phases.append(phase("forward"))
        loss.backward()
        del loss
        phases.append(phase("backward"))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases.append(phase("optimizer"))
        else:
            model.zero_grad(set_to_none=True)
            # not returned: it only starts the next forward's window after the gradients are dropped,
            # where the trace's phase:forward marker starts it (else the next forward's peak would be
            # this step's gradients, which outlive it until here)
            phase("zero_grad")
    return phases


def measure_phases(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = "adamw",
                   steps: int = 2, prepare=None) -> list[dict]:
    """Phases of the last of `steps` steps (the first allocates optimizer state and warms up kernels).
    prepare: a function called with the model before the steps (e.g. measure/routing.py's forced routing)."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    base_req = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
    torch.cuda.reset_peak_memory_stats()
    model, ids, targets, opt = setup_step(cfg, run, variant, optimizer)
    if prepare is not None:
        prepare(model)
    phases = phased_steps(model, ids, targets, opt, run, steps, _phase)
    out = [dict(asdict(p), allocated=p.allocated - base, peak=p.peak - base, requested=p.requested - base_req,
                requested_peak=p.requested_peak - base_req) for p in phases]
    del model, opt, ids, targets
    torch.cuda.empty_cache()
    return out


def marking_tracker(mark):
    """A ComponentTracker that calls mark(label) whenever the running component changes, so a replay
    (llm_anatomy.measure.forensics) can credit allocations that carry no Python frames of ours: the
    built-in backward ops, which run on the autograd engine's device thread."""

    class Marking(ComponentTracker):
        @property
        def label(self) -> str:
            return self._label

        @label.setter
        def label(self, value: str) -> None:
            if value != getattr(self, "_label", None):
                mark(value)
            self._label = value

    return Marking


def marked_steps(model, ids, targets, opt, run: Run, steps: int, mark, device: str = "cuda") -> None:
    """`steps` training steps with component markers (marking_tracker) and phase markers."""
    with marking_tracker(mark)(model, track_backward=True) as tracker:
        for _ in range(steps):
            mark("phase:forward")
            with autocast_ctx(run, device):
                loss = model(ids, targets)
            tracker.tag_backward()
            mark("phase:backward")
            loss.backward()
            del loss
            tracker._calls.clear()  # this step's graph is gone; the next forward records its own
            if opt is not None:
                mark("phase:optimizer")
                tracker.label = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
                tracker.label = "other"
            else:
                mark("phase:zero_grad")  # the gradients are live up to here, then dropped
                model.zero_grad(set_to_none=True)
            mark("phase:end")


def _anatomy_marker(label: str) -> None:
    """Allocate and drop a block whose size encodes `label` (forensics.MARKER_LABELS); this function's
    name in the allocation's frames is what tells the replay it is a marker. 0.5-6 KiB, freed at once."""
    from llm_anatomy.measure.forensics import marker_size

    torch.empty(marker_size(label), dtype=torch.uint8, device="cuda")


def record_step(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = "adamw",
                steps: int = 2, max_entries: int = 1_000_000) -> dict:
    """The allocator snapshot (torch.cuda.memory._snapshot()) of a model build and `steps` training steps
    (the first warms up kernels and allocates optimizer state), with component and phase markers.

    History is recorded from before the model is built, so parameters, inputs and optimizer state
    carry the frames that made them; context="alloc" keeps frames on allocations only and
    stacks="python" skips C++ frames (markers and file paths are all the replay needs)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries, clear_history=True)
    try:
        model, ids, targets, opt = setup_step(cfg, run, variant, optimizer)
        marked_steps(model, ids, targets, opt, run, steps, _anatomy_marker)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del model, opt, ids, targets
    torch.cuda.empty_cache()
    return snap


def trace_phases(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = "adamw") -> dict:
    """The phase figures of the allocator trace's live bytes (record_step, replayed): each block at its
    requested size (512-rounded), what was allocated before recording left out; ends from the last
    step, peaks over both. max_memory_allocated counts whole blocks instead: a cached block reused for
    a smaller request without being split (the caching allocator splits a large block only when more
    than 1 MiB would remain) adds its slack there, and only there."""
    import itertools

    from llm_anatomy.measure.forensics import replay

    snap = record_step(cfg, run, variant, optimizer)
    r = replay(snap)
    totals = list(itertools.accumulate((ev.delta for ev in r.events), initial=r.pre_existing))  # before event i
    at = {phase: totals[pos] - r.pre_existing for pos, phase, step in r.marks if step == r.steps}
    out = dict(forward_end=at["backward"], backward_end=at["optimizer" if optimizer else "zero_grad"])
    if optimizer:
        out["optimizer_end"] = at["end"]
    for phase in ("forward", "backward"):
        rp = replay(snap, peak_phase=phase)
        out[f"{phase}_peak"] = rp.peak - rp.pre_existing
    return out


def peak_forensics(cfg: ModelConfig, run: Run, variant: str = "baseline", top: int = 12,
                   optimizer: str | None = "adamw") -> dict:
    """The largest allocations live at the peak of a training step, each attributed to a component
    (llm_anatomy.measure.forensics.attribute_peak over record_step's snapshot)."""
    from llm_anatomy.measure.forensics import attribute_peak

    return attribute_peak(record_step(cfg, run, variant, optimizer), top)
