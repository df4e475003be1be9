"""What a step's kernel list fixes apart from its sizes, prepared once per model and reused for every
micro-batch: the phase order the kernels are timed in, each entry's host seconds (host.host_seconds, with
host_scale), and the host/GPU pipeline's blocks (pipeline.layout). Only the kernels' sizes (FLOPs, bytes,
shapes) follow the micro-batch; the entries, their order, counts and host calls follow the model, the
policy and the counts that grow with the tokens (Liger's chunks, the embedding backward's launches).

A layout is kept per profile (a Profile is frozen), keyed by what builds the kernel list but the micro-batch
and sequence, and by every entry's launch count: validations/test_estimate_rate.py checks over a grid of
runs that the key decides every field a layout reads.
"""
from __future__ import annotations

from typing import NamedTuple

import anatomy.calculator.timing.pipeline as pipeline
from anatomy.calculator.timing.host import host_seconds, in_situ
from anatomy.calculator.timing.ops import Kernel
from anatomy.calculator.timing.profile import Profile
from anatomy.calculator.timing.roofline import launch_term, regime_speeds

_RANK = {ph: i for i, ph in enumerate(pipeline.PHASES)}
MEMO_SIZE = 256  # layouts kept per profile: models x policies x optimizers of a sweep; cleared when full


class Layout(NamedTuple):
    order: tuple[int, ...]  # kernel indices in phase order (stable: within a phase, order 0, 1, 2)
    host: tuple[float, ...]  # per position in that order: host seconds of all the entry's launches
    host_launch: tuple[float, ...]  # per position: host seconds per launch (the pipeline's)
    blocks: dict  # pipeline.layout over the kernels in phase order


def skeleton(k: Kernel) -> tuple:
    """The fields of a kernel entry a layout reads or passes on unpriced: all but its sizes (FLOPs, bytes,
    shape, and the rows of its calibrated op)."""
    return k[:5] + k[8:16] + k[17:]


def build(ks: list[Kernel], prof: Profile, scale: float, layers: int) -> Layout:
    """The layout of a kernel list of `layers` layers on a profile; scale is host.host_scale's factor for its
    variant."""
    order = tuple(sorted(range(len(ks)), key=lambda i: (_RANK[ks[i].phase], ks[i].order)))
    host = tuple(host_seconds(ks[i], prof) * (scale if ks[i].phase != "optimizer" and not in_situ(ks[i], prof) else 1.0)
                 for i in order)
    host_launch = tuple(h / ks[i].count for h, i in zip(host, order))
    return Layout(order, host, host_launch, pipeline.layout([ks[i] for i in order], layers))


def of(ks: list[Kernel], prof: Profile, scale: float, key: tuple, layers: int) -> Layout:
    """The layout of this kernel list (build), from the profile's memo where the same model, policy and
    counts were laid out before. key: what built the list but the micro-batch and sequence."""
    memo = getattr(prof, "_layout_memo", None)
    if memo is None:
        memo = {}
        if isinstance(prof, Profile):
            object.__setattr__(prof, "_layout_memo", memo)
    full = (key, scale, layers, tuple([k.count for k in ks]))
    lay = memo.get(full)
    if lay is None:
        lay = build(ks, prof, scale, layers)
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        memo[full] = lay
    return lay


def timed(ks: list[Kernel], lay: Layout, prof: Profile, sustained: float, terms: list[tuple]) -> list[tuple]:
    """[(kernel, roofline.timed figures, host seconds of all its launches)] in phase order: roofline.timed of
    each entry at the step's sustained weight, from its kernel_terms, written out."""
    speeds = regime_speeds(prof, sustained) if sustained else None
    launch_s, gap = prof.launch_s, launch_term(prof)
    out = []
    for i, host in zip(lay.order, lay.host):
        t_c, t_m, cls, rate, note = terms[i]
        if sustained:
            speed = speeds[cls]
            t_c, rate = t_c / speed, rate * speed
            t_m /= speeds["memory"]
        t = t_c if t_c >= t_m else t_m
        if launch_s > t:
            out.append((ks[i], (t_c, t_m, launch_s, t + launch_s, "launch", rate, note), host))
        else:
            out.append((ks[i], (t_c, t_m, gap, t + gap, "compute" if t_c >= t_m else "memory", rate, note), host))
    return out
