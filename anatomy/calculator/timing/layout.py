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
    slots: tuple[tuple[int, int], ...]  # per position: (index in components, index in PHASES)
    components: tuple[str, ...]  # in order of first appearance
    component_kernels: tuple[int, ...]  # launches per component
    phase_host: tuple[float, ...]  # per phase: host seconds, summed in order
    phase_kernels: tuple[int, ...]  # per phase: launches


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
    comps: dict[str, int] = {}
    slots = tuple((comps.setdefault(ks[i].component, len(comps)), _RANK[ks[i].phase]) for i in order)
    n_comp, ph_host, ph_n = [0] * len(comps), [0.0] * len(_RANK), [0] * len(_RANK)
    for (ci, pi), i, h in zip(slots, order, host):
        n_comp[ci] += ks[i].count
        ph_host[pi] += h
        ph_n[pi] += ks[i].count
    return Layout(order, host, host_launch, pipeline.layout([ks[i] for i in order], layers), slots, tuple(comps),
                  tuple(n_comp), tuple(ph_host), tuple(ph_n))


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


def sums(lay: Layout, timed_ks: list[tuple]) -> tuple[dict, dict]:
    """(components, phases) of estimate_time: per component its GPU seconds by phase, launches, seconds by
    bound and total; per phase its GPU and host seconds and launches. Sums in phase order."""
    per = [[0.0, 0.0, 0.0] for _ in lay.components]
    bound = [dict(compute=0.0, memory=0.0, launch=0.0) for _ in lay.components]
    gpu = [0.0, 0.0, 0.0]
    for (k, t, _), (ci, pi) in zip(timed_ks, lay.slots):
        time_s = t[3] * k.count  # roofline.row's time_s
        per[ci][pi] += time_s
        bound[ci][t[4]] += time_s
        gpu[pi] += time_s
    comps = {name: dict(forward_s=p[0], backward_s=p[1], optimizer_s=p[2], kernels=n, bound_s=b, total_s=sum(p))
             for name, p, n, b in zip(lay.components, per, lay.component_kernels, bound)}
    phases = {ph: dict(gpu_s=gpu[i], host_s=lay.phase_host[i], kernels=lay.phase_kernels[i])
              for i, ph in enumerate(pipeline.PHASES)}
    return comps, phases
