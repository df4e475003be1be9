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


# cuDNN's SDPA under an additive mask, as efficient/attention_sinks.py calls it: (B, heads, kv_heads, S, hd, pad,
# keys): q (B, heads, S, hd + pad), k and v (B, kv_heads, keys, hd + pad) through enable_gqa, an (S, keys) mask in
# q's dtype. gpt-oss's shape (64 query heads over 8 kv heads, hd 64 + 8 pad columns, S + 1 keys: the sink's) at
# three S, the same at hd 128 (32 heads), and a window's call without sinks (hd 64, S keys, no pad); B x heads x
# S / 128 query blocks fill many waves on any GPU with <= 200 SMs, so each rate is a full wave's
MASKED_SHAPES = tuple((4096 // S, 64, 8, S, 64, 8, S + 1) for S in (1024, 2048, 4096)) \
    + tuple((4096 // S, 32, 8, S, 128, 8, S + 1) for S in (1024, 2048, 4096)) + ((2, 64, 8, 2048, 64, 0, 2048),)
MASKED_S = 30.0  # seconds for the masked rows (7 shapes, fwd and fwd+bwd: a few seconds)


def measure_masked_attention(deadline: float, median_ms, shapes=MASKED_SHAPES) -> tuple[list[dict], list[str]]:
    """Rows {B, heads, kv_heads, S, keys, hd, pad, fwd_ms, fwd_bwd_ms, backend} of the masked SDPA call alone
    (median_ms: calibrate's CUDA-event timer of back-to-back calls), fwd+bwd through autograd.grad (no
    accumulation into .grad); a shape the cuDNN kernel does not run is skipped with its reason."""
    import math

    import torch
    import torch.nn.functional as F

    from llm_anatomy.efficient.attention import backend_context, sdpa_backend_name
    from llm_anatomy.efficient.attention_sinks import attention_mask

    rows, skipped = [], []
    for B, nh, nkv, S, hd, pad, keys in shapes:
        if time.monotonic() > deadline:
            skipped.append(f"masked sdpa hd{hd}+{pad} S{S}: over the time budget")
            continue
        dev, wd = torch.device("cuda"), hd + pad
        q = torch.randn(B, nh, S, wd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, nkv, keys, wd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn(B, nh, S, wd, device=dev, dtype=torch.bfloat16)
        mask = attention_mask(S, None, keys == S + 1, torch.bfloat16, dev)  # (S, keys): causal, the sink column
        with backend_context(dev):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(hd),  # noqa: E731
                                                         enable_gqa=nkv != nh)
            try:
                backend = sdpa_backend_name(fwd().grad_fn)
                if backend != "cudnn":
                    skipped.append(f"masked sdpa hd{hd}+{pad} S{S}: ran {backend}, not cuDNN")
                    continue
                fwd_ms = median_ms(fwd, batches=5, per_batch=5)
                fb_ms = median_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), g), batches=5, per_batch=5)
            except RuntimeError as e:
                skipped.append(f"masked sdpa hd{hd}+{pad} S{S}: {str(e).splitlines()[0][:120]}")
                continue
        rows.append(dict(B=B, heads=nh, kv_heads=nkv, S=S, keys=keys, hd=hd, pad=pad, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
                         backend=backend))
    torch.cuda.empty_cache()
    return rows, skipped
