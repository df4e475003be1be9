"""How each calibrated op is timed: one registry entry per op, no branches on op names elsewhere.

A memory-bound op whose kernels run below the copy roofline (our fused ops, the mixed-dtype residual add,
Liger's CE kernel, the eager baseline's chains, torch's fused optimizers, ATen's embedding backward) has
an entry here. `anatomy calibrate` times it at several widths and row counts
(calibrate_kernels:measure_fused, rows in Profile.fused_rows); efficiency() turns those timings into the
fraction of the copy bandwidth (Profile.hbm_Bps) the op reaches at the width and rows asked for:

    efficiency = minimal bytes / hbm_Bps / (measured seconds - launches x launch_s - own_fill)

piecewise linear in log(width) at each calibrated row count, then in log(rows) between them, flat beyond
the calibrated range; where the profile has no rows for the op, the efficiency of the op it names `like`
(the same kernel shape), else 1.0 (the copy roofline, as on a datasheet).

Op names follow the components: rms_norm, add_rms_norm, swiglu, rope_qkv, linear_ce (impl liger), linear_ce.anatomy (ours),
residual_add, embedding.backward, optimizer.<name>, and the baseline's eager chains (eager_norm, eager_mlp, ...).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from llm_anatomy.config import ConfigError
from llm_anatomy.calculator.timing.op_bytes import (EAGER_CHAINS, anatomy_ce_width, dw_sum_bytes,
                                                embedding_backward_launches, fused_bytes, liger_ce_width)


@dataclass(frozen=True)
class Op:
    name: str  # the registry key a Kernel's `fused` tuple names
    rows: str  # the op name of its rows in Profile.fused_rows, as calibrate_kernels:measure_fused writes it
    impl: str = "ours"  # whose kernel: ours, liger, aten, torch
    # minimal HBM bytes one calibrated call moves at (width, tokens), bf16 compute and an fp32 stream
    nbytes: Callable[[int, int], int] | None = None
    # the width its time follows, where not the op's width (Liger's CE: the lanes of its passes, masked past V)
    lanes: Callable[[int], int] | None = None
    # interpolate only over calibrated widths with the same width % align == 0 (0: all widths)
    align: int = 0
    own_fill: bool = False  # the calibrated call includes a (vocab, width) fp32 zero fill timed at hbm_Bps
    # kernels one call launches at (width, tokens): its timing less these launches is its busy time
    launches: Callable[[int, int], int] = lambda width, tokens: 1
    # where the profile has no rows of its own: the op whose calibrated efficiency it runs at (same kernel shape)
    like: str | None = None
    # a measured profile without rows of this op refuses to price it: its kernel runs far from the copy rate (rows
    # of S + 1 fp32 values are not 16-byte aligned: ATen runs them unvectorized), so 1.0 would be no estimate
    required: bool = False

    def call_bytes(self, width: int, tokens: int) -> int:
        return self.nbytes(width, tokens) if self.nbytes else sum(fused_bytes(self.rows, width, tokens))


def _rms_norm_backward_bytes(width: int, tokens: int) -> int:
    """The op is two kernels: the row pass, and the sum of the (programs, H) fp32 dw partials."""
    return sum(fused_bytes("rms_norm.backward", width, tokens)) + sum(dw_sum_bytes(width, tokens))


def _add_rms_norm_backward_bytes(width: int, tokens: int) -> int:
    """As rms_norm's backward: the row pass (with d_x_new), and the dw partials' sum."""
    return sum(fused_bytes("add_rms_norm.backward", width, tokens)) + sum(dw_sum_bytes(width, tokens))


_OURS = ("rms_norm.forward", "swiglu.forward", "swiglu.backward", "rope_qkv.forward", "rope_qkv.backward")
_ATEN = ("residual_add", "sxs.scale", "sxs.mask_add", "sxs.float", "sxs.to_compute", "sxs.softmax",
         "sxs.softmax.backward", "sxs.sink_cat", "sxs.sink_slice_cast", "sxs.sink_slice_backward", *EAGER_CHAINS)
OPS: dict[str, Op] = {o.name: o for o in (
    *(Op(n, n) for n in _OURS),
    Op("rms_norm.backward", "rms_norm.backward", nbytes=_rms_norm_backward_bytes, launches=lambda w, t: 2),
    # the residual add + RMSNorm (anatomy::add_rms_norm): calibrate times it; a profile calibrated before it did
    # (profiles/h200.json) prices it at rms_norm's efficiency, the same row kernels with one more stream in and
    # out (kernels/add_rms_norm.py): on one H200's calibration with both, within 4% forward and 4-7% low backward
    Op("add_rms_norm.forward", "add_rms_norm.forward", like="rms_norm.forward"),
    Op("add_rms_norm.backward", "add_rms_norm.backward", nbytes=_add_rms_norm_backward_bytes,
       launches=lambda w, t: 2, like="rms_norm.backward"),
    *(Op(n, n, "aten", required=n.startswith("sxs.sink")) for n in _ATEN if n not in EAGER_CHAINS),
    # the baseline's eager chains: each timed as a whole, one launch per op of the chain
    *(Op(n, n, "aten", launches=lambda w, t, n=n: len(EAGER_CHAINS[n](t, w))) for n in EAGER_CHAINS),
    # Liger's CE kernel: a vocab that is not a multiple of 16 loses Triton's aligned loads (its stride
    # specialisation), so it is read only against calibrated vocabs of its own alignment
    Op("linear_ce", "liger_ce", "liger", lanes=liger_ce_width, align=16),
    # our CE row kernel (anatomy::linear_cross_entropy's): rows "anatomy_ce"; the copy roofline until
    # calibrate times it
    Op("linear_ce.anatomy", "anatomy_ce", lanes=anatomy_ce_width),
    Op("embedding.backward", "embedding.backward", "aten", own_fill=True, launches=embedding_backward_launches),
    Op("optimizer.adamw", "optimizer.adamw", "torch"),
    Op("optimizer.ademamix", "optimizer.ademamix", "torch"),
)}


def launches(name: str, width: int, tokens: int) -> int:
    """Kernels one call of registry op `name` launches."""
    return OPS[name].launches(width, tokens)


def log_interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (x, y) points (x a log), flat beyond the first and last."""
    pts = sorted(pts)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, e0), (x1, e1) in zip(pts, pts[1:]):
        if x <= x1:
            return e0 + (e1 - e0) * (x - x0) / (x1 - x0) if x1 > x0 else e1
    return pts[-1][1]


def _table(prof, op: Op, aligned: bool | None) -> dict[int, list[tuple[float, float]]]:
    """{tokens: [(log lanes, efficiency per lane)]} of the profile's rows of this op."""
    cal = [r for r in prof.get("fused_rows") or () if r["op"] == op.rows and r.get("queued", True)]
    if op.align:
        cal = [r for r in cal if (r["width"] % op.align == 0) == aligned] or cal
    lanes = op.lanes or (lambda w: w)
    by_rows: dict[int, list] = {}
    for r in cal:
        busy = r["ms"] * 1e-3 - op.launches(r["width"], r["tokens"]) * prof["launch_s"]
        if op.own_fill:
            busy -= r["vocab"] * r["width"] * 4 / prof["hbm_Bps"] + prof["launch_s"]
        if busy > 0:
            per_lane = lanes(r["width"]) / r["width"]
            by_rows.setdefault(r["tokens"], []).append(
                (math.log(lanes(r["width"])), op.call_bytes(r["width"], r["tokens"]) / prof["hbm_Bps"] / busy * per_lane))
    return by_rows


def efficiency(prof, name: str, width: int, rows: int | None = None) -> float:
    """The fraction of the copy bandwidth op `name` reaches over `rows` rows of `width` (see the module doc)."""
    memo = _memo(prof)
    if (hit := memo.get((name, width, rows))) is not None:  # the same ops at the same sizes recur in every estimate
        return hit
    op = OPS[name]
    aligned = width % op.align == 0 if op.align else None
    key = (name, aligned)
    if key not in memo:
        memo[key] = _table(prof, op, aligned)
    by_rows = memo[key]
    if not by_rows and op.like:
        eff = efficiency(prof, op.like, width, rows)
    elif not by_rows:
        if op.required and prof.get("fused_rows"):
            raise ConfigError(f"gpu profile {prof['name']!r} has no calibration of {name} (the baseline's attention "
                              "sinks: rows of S + 1 fp32 values, not 16-byte aligned; `anatomy calibrate` measures it)")
        eff = 1.0
    else:
        lanes = op.lanes(width) if op.lanes else width
        at = [(math.log(t), log_interp(pts, math.log(lanes))) for t, pts in by_rows.items()]
        eff = (log_interp(at, math.log(rows)) if rows else max(at)[1]) / (lanes / width)
    if len(memo) < MEMO_SIZE:
        memo[(name, width, rows)] = eff
    return eff


MEMO_SIZE = 1 << 16  # results kept per profile: far more than the (op, width, rows) of a sweep's shapes


def known(prof) -> dict:
    """efficiency's results so far on this profile, keyed by (name, width, rows): a caller with a kernel's
    three-part `fused` reads it there before calling efficiency."""
    return _memo(prof)


def _memo(prof) -> dict:
    """A per-profile cache of the prepared tables and of efficiency's results (a Profile is frozen: its rows
    never change)."""
    memo = getattr(prof, "_registry_memo", None)
    if memo is None:
        memo = {}
        if hasattr(prof, "__dataclass_fields__"):
            object.__setattr__(prof, "_registry_memo", memo)
    return memo
