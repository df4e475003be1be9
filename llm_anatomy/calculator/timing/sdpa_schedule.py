"""How long a causal flash-attention kernel runs, from how its CTAs land on the SMs (pure Python).

A flash kernel (cuDNN's on Hopper) runs one CTA per (batch, head, 128-row block). Under a causal mask
the blocks do unequal work: in the forward, query block i visits i + 1 key blocks; in the backward,
key block i is visited by n - i query blocks. One CTA runs per SM at a time (a measured fit: two per SM
fits the H200's kernels 4-6x worse), so the kernel's time is the makespan of those CTAs
greedily scheduled on the SMs in launch order, each costing o + c * blocks, plus a fixed a:

    t = a + makespan(o + c * w_i over the CTAs, on `sms` slots)

- Many waves: the makespan is the total work over the SMs plus a ragged tail (a throughput rate).
- Under one wave: it is the longest CTA, o + c * n, which grows with S, not with batch x heads. A full-
  wave rate scaled by wave quantization (roofline.attention_wave_efficiency) charges such a grid its average
  CTA instead, at full occupancy, and under-predicts it 2-3x (tiny-gqa B4 S512: 8.6 us measured).
- cuDNN pads the head dim to its kernel's tile (64 or 128): a head dim of 32 runs the 64 kernel
  (knob ..._64x128x64 in every hd32 trace), so it costs what hd 64 costs.

`anatomy calibrate` times the main kernel (the profiler's duration, without the small kernels around
it) at grids from under one wave to many, and `fit` finds (a, o, c) per head dim and phase."""
from __future__ import annotations

import heapq
from functools import lru_cache

BLOCK = 128  # rows per CTA (query block in the forward, key block in the backward)
PHASES = ("forward", "backward")


def padded_head_dim(hd: int) -> int:
    """The head dim cuDNN's kernel runs: the next multiple of 64, at least 64."""
    return max(64, -(-hd // 64) * 64)


def cta_work(seq: int, phase: str) -> list[int]:
    """Key x query blocks each CTA of one (batch, head) visits under the causal mask, in launch order."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    n = -(-seq // BLOCK)
    return [i + 1 for i in range(n)] if phase == "forward" else [n - i for i in range(n)]


# (seq, sms, ratio, phase) -> (heads scheduled, the slots' heap after them): the schedule of n + k heads is
# the schedule of n heads continued, so a larger grid of the same shape resumes from the largest one scheduled
# (the same heap operations in the same order, so the same floats) instead of starting over; a plan's search
# over micro-batches then schedules each head once
_RESUME: dict[tuple, tuple[int, list[float]]] = {}
RESUME_SIZE = 256


@lru_cache(maxsize=4096)
def makespan_units(heads_total: int, seq: int, sms: int, ratio: float, phase: str) -> float:
    """Makespan in units of c, for CTAs costing ratio + w each (ratio = o / c), greedy on `sms` slots:
    each CTA, in launch order, starts on the slot that frees first. heads_total = batch x heads."""
    work = [ratio + w for w in cta_work(seq, phase)]
    if heads_total * len(work) <= sms:
        return max(work)
    key = (seq, sms, ratio, phase)
    done, slots = _RESUME.get(key, (0, None))
    if slots is None or done > heads_total:
        done, slots = 0, [0.0] * sms
    else:
        slots = slots.copy()
    for _ in range(heads_total - done):
        for w in work:
            heapq.heapreplace(slots, slots[0] + w)
    if heads_total > _RESUME.get(key, (0, None))[0]:
        if len(_RESUME) >= RESUME_SIZE:
            _RESUME.clear()
        _RESUME[key] = (heads_total, slots)
    return max(slots)


def kernel_s(sched: dict, batch: int, heads: int, seq: int, sms: int, phase: str) -> float:
    """Seconds of one kernel launch, from a fitted {"a", "o", "c"} (seconds)."""
    c = sched["c"]
    return sched["a"] + c * makespan_units(batch * heads, seq, sms, round(sched["o"] / c, 6), phase)


def fit(rows: list[tuple[int, int, int, float]], sms: int, phase: str) -> dict:
    """{"a", "o", "c"} (seconds) minimising the squared relative error over rows of (batch, heads, seq,
    seconds): for each o / c on a log grid, a and c are a weighted linear least-squares fit (a >= 0)."""
    if len(rows) < 3:
        raise ValueError(f"fitting a schedule needs at least 3 timed shapes, got {len(rows)}")
    best = None
    for i in range(81):
        r = 0.01 * 10 ** (i / 20)  # 0.01 .. 100
        xs = [(1 / t, makespan_units(b * h, s, sms, round(r, 6), phase) / t) for b, h, s, t in rows]
        s11, s12, s22 = (sum(x * x for x, _ in xs), sum(x * y for x, y in xs), sum(y * y for _, y in xs))
        b1, b2 = sum(x for x, _ in xs), sum(y for _, y in xs)
        det = s11 * s22 - s12 * s12
        a, c = ((b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det) if det > 0 else (0.0, b2 / s22)
        if a < 0:
            a, c = 0.0, b2 / s22
        if c <= 0:
            continue
        err = sum((a * x + c * y - 1) ** 2 for x, y in xs)
        if best is None or err < best[0]:
            best = (err, dict(a=a, o=round(r, 6) * c, c=c))
    if best is None:
        raise ValueError("no schedule fits these timings (every fit had c <= 0)")
    return best[1]


def errors(sched: dict, rows: list[tuple[int, int, int, float]], sms: int, phase: str) -> list[float]:
    """(fitted - measured) / measured per row: how well the fit holds its own calibration."""
    return [(kernel_s(sched, b, h, s, sms, phase) - t) / t for b, h, s, t in rows]


def lookup(prof: dict, backend: str, head_dim: int) -> tuple[dict | None, str]:
    """A profile's fitted schedule of `backend` at the head dim its kernel runs (cuDNN pads to 64 or 128),
    or the nearest one calibrated, and a note saying which; (None, "") where the profile has none (timing
    then uses the full-wave rates)."""
    table = (prof.get("sdpa_schedule") or {}).get(backend)
    if not table:
        return None, ""
    want = padded_head_dim(head_dim) if backend == "cudnn" else head_dim
    key = str(want) if str(want) in table else min(table, key=lambda h: abs(int(h) - want))
    pad = f" (runs the hd{want} kernel)" if want != head_dim else ""
    near = "" if key == str(want) else f" (nearest calibrated to hd{want})"
    return table[key], f"{backend} hd{key} CTA schedule{pad}{near}"
