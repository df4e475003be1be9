"""Calibrate's SDPA kernels: the main kernel's duration at grids from under one wave to many, for the
CTA-schedule fit (calculator/sdpa_schedule.py). CUDA only.

The full-wave rates (calibrate.measure_attention) are CUDA-event times of whole calls, right for
the large grids they time. A small grid's call is host-bound, so events would time the host; the
profiler's kernel durations time the GPU alone. They are also what the probes credit to a component.
The small kernels around the main one (memsets, dot(dO, O), the dQ conversion) are kept as
`*_other_ms` and are not fitted: the model lists them as kernels of their own (launches.py).
"""
from __future__ import annotations

import time

# (B, heads, S) per head dim: one wave (64-128 CTAs of 128 rows), then 2-4 waves, then many
SCHEDULE_GRIDS = ((1, 8, 512), (1, 4, 2048), (1, 16, 1024), (2, 16, 1024), (4, 8, 2048), (8, 16, 2048), (16, 8, 4096))
SCHEDULE_HEAD_DIMS = (64, 128)  # cuDNN runs hd 32 in the 64 kernel, 96 in the 128 one (sdpa_schedule.padded_head_dim)


def schedule_shapes() -> list[tuple[int, int, int, int]]:
    return [(B, h, S, hd) for hd in SCHEDULE_HEAD_DIMS for B, h, S in SCHEDULE_GRIDS]


def _label(B: int, h: int, S: int, hd: int) -> str:
    return f"sdpa B{B} h{h} S{S} hd{hd}"


def rows_from_kernels(comps: dict, shapes, reps: int, backend: str = "cudnn") -> list[dict]:
    """Calibrate's rows from attribute_kernels' {phase: {label: {ms, n, top}}}: per call, the longest
    kernel of each phase (the main one) and the rest."""
    rows = []
    for B, h, S, hd in shapes:
        f, b = (comps.get(ph, {}).get(_label(B, h, S, hd)) for ph in ("forward", "backward"))
        if not f or not b:
            continue
        fm, bm = max(f["top"].values()), max(b["top"].values())
        rows.append(dict(backend=backend, B=B, heads=h, S=S, hd=hd, reps=reps,
                         fwd_kernel_ms=fm / reps, bwd_kernel_ms=bm / reps,
                         fwd_other_ms=(f["ms"] - fm) / reps, bwd_other_ms=(b["ms"] - bm) / reps,
                         fwd_kernel=max(f["top"], key=f["top"].get)[:120], bwd_kernel=max(b["top"], key=b["top"].get)[:120]))
    return rows


def measure_sdpa_kernels(deadline: float, reps: int = 10, shapes=None) -> list[dict]:
    """cuDNN's causal SDPA, forward and backward, at `shapes` (B, heads, S, hd; schedule_shapes() by
    default): one profiler pass over every shape after a warm-up (cuDNN builds its plan per shape),
    kernels credited by marks (timeline.py)."""
    import json
    import tempfile
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile, record_function

    from llm_anatomy.measure.timeline import MARK, attribute_kernels, trace_kernels

    shapes = list(shapes or schedule_shapes())
    cases = []
    for B, h, S, hd in shapes:
        if time.monotonic() > deadline:
            break
        q, k, v = (torch.randn(B, h, S, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        cases.append(((B, h, S, hd), q, k, v, torch.randn(B, h, S, hd, device="cuda", dtype=torch.bfloat16)))

    def run(mark, n: int) -> None:
        for shape, q, k, v, g in cases:
            for _ in range(n):
                for label in ("phase:forward", _label(*shape)):
                    mark(label)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                for label in ("phase:backward", _label(*shape)):
                    mark(label)
                torch.autograd.grad(out, (q, k, v), g)  # no accumulation kernels into .grad

    def mark(label: str) -> None:
        with record_function(MARK + label):
            pass

    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            run(lambda label: None, 3)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(mark, reps)
                mark("phase:end")
                torch.cuda.synchronize()
    except RuntimeError as e:  # cuDNN attention does not run here: no schedule, the full-wave rates stay
        print(f"anatomy calibrate: cuDNN SDPA kernels not timed: {str(e).splitlines()[0][:120]}")
        return []
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    cases.clear()
    torch.cuda.empty_cache()
    return rows_from_kernels(attribute_kernels(*trace_kernels(trace)), shapes, reps)
