"""What a step's kernel list fixes apart from its sizes, prepared once per model and reused for every
micro-batch: the phase order the kernels are timed in, each entry's host seconds per call (host.host_call_s,
with host_scale) and the component and phase each entry is summed into. Only the kernels' sizes (FLOPs,
bytes, shapes) and the launch counts that follow the tokens (the loss's chunks, the embedding backward's
launches) change with the micro-batch: host seconds per entry and the host/GPU pipeline's blocks are
derived from the counts at each call (the blocks kept per count pattern, pipeline.layout).

A layout is kept per profile (a Profile is frozen), keyed by what builds the kernel list but the micro-batch
and sequence, and by the list's length: validations/test_estimate_rate.py checks over a grid of runs that the
key decides every field a layout reads.
"""
from __future__ import annotations

from typing import NamedTuple

import anatomy.calculator.timing.pipeline as pipeline
from anatomy.calculator.timing.host import host_call_s, in_situ
from anatomy.calculator.timing.ops import Kernel
from anatomy.calculator.timing.profile import Profile
from anatomy.calculator.timing.roofline import launch_term, regime_speeds

_RANK = {ph: i for i, ph in enumerate(pipeline.PHASES)}
MEMO_SIZE = 256  # layouts kept per profile (models x policies x optimizers of a sweep), and block layouts kept
#                 per layout (count patterns: the loss's chunk counts); each memo is cleared when full


class Layout(NamedTuple):
    order: tuple[int, ...]  # kernel indices in phase order (stable: within a phase, order 0, 1, 2)
    slots: tuple[tuple[int, int], ...]  # per position: (index in components, index in PHASES)
    components: tuple[str, ...]  # in order of first appearance
    host_call: tuple[float, ...]  # per position: host seconds per host call (host.host_call_s)
    host_factor: tuple[float, ...]  # per position: host_scale, or 1.0 (the optimizer, calls measured in situ)
    calls: tuple[int | None, ...]  # per position: the entry's host calls (None: one per launch)
    blocks: dict  # {launch counts: timed's _fixed (pipeline.prepare's blocks, launches, host seconds)}


def key(cfg, run, variant: str, sdpa_backend: str | None, optimizer: str | None) -> tuple:
    """What builds a kernel list (timing.kernels) but the micro-batch and sequence."""
    return cfg, variant, sdpa_backend, optimizer, run.dtype, run.recompute, run.loss_impl


def skeleton(k: Kernel) -> tuple:
    """The fields of a kernel entry a layout reads or passes on unpriced: all but its sizes (FLOPs, bytes,
    shape, the rows of its calibrated op) and its launch count."""
    return k[:4] + k[8:16] + k[17:]


def build(ks: list[Kernel], prof: Profile, scale: float) -> Layout:
    """The layout of a kernel list on a profile; scale is host.host_scale's factor for its variant."""
    order = tuple(sorted(range(len(ks)), key=lambda i: (_RANK[ks[i].phase], ks[i].order)))
    comps: dict[str, int] = {}
    slots = tuple((comps.setdefault(ks[i].component, len(comps)), _RANK[ks[i].phase]) for i in order)
    factor = tuple(scale if ks[i].phase != "optimizer" and not in_situ(ks[i], prof) else 1.0 for i in order)
    return Layout(order, slots, tuple(comps), tuple(host_call_s(ks[i], prof) for i in order), factor,
                  tuple(ks[i].calls for i in order), {})


def _memo(owner, attr: str) -> dict:
    memo = getattr(owner, attr, None)
    if memo is None:
        memo = {}
        if isinstance(owner, Profile):
            object.__setattr__(owner, attr, memo)
    return memo


def of(ks: list[Kernel], prof: Profile, scale: float, key: tuple) -> Layout:
    """The layout of this kernel list (build), from the profile's memo where the same model and policy were
    laid out before. key: what built the list but the micro-batch and sequence; with the list's length, it
    decides every field build reads (validations/test_estimate_rate.py checks that over a grid of runs)."""
    memo = _memo(prof, "_layout_memo")
    full = (key, scale, len(ks))  # the entries a run's tokens add or leave out: the loss's last, shorter chunk
    lay = memo.get(full)
    if lay is None:
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        lay = memo[full] = build(ks, prof, scale)
    return lay


def timed(ks: list[Kernel], lay: Layout, prof: Profile, sustained: float, terms: list[tuple],
          layers: int) -> tuple[list[tuple], list[float], dict, dict, dict]:
    """The step's kernels at its sustained weight, in one pass in phase order: ([(kernel, roofline.timed
    figures, host seconds of all its launches)], GPU seconds per launch, pipeline.prepare's blocks, the
    components and the phases of estimate_time). roofline.timed of each entry from its kernel_terms and
    host.host_seconds x the host factor, written out. Per component: GPU seconds by phase, launches, seconds
    by bound and total; per phase: GPU and host seconds and launches."""
    speeds = regime_speeds(prof, sustained) if sustained else None
    launch_s, gap = prof.launch_s, launch_term(prof)
    per_c = [[0.0, 0.0, 0.0] for _ in lay.components]
    bound_c = [dict(compute=0.0, memory=0.0, launch=0.0) for _ in lay.components]
    gpu = [0.0, 0.0, 0.0]
    out, gpu_s = [], []
    for i, unit, f, calls, (ci, pi) in zip(lay.order, lay.host_call, lay.host_factor, lay.calls, lay.slots):
        k = ks[i]
        n = k.count
        host = ((n if calls is None else calls) * unit) * f
        if k.kind == "host":  # host work alone (an optimizer call's Python): no GPU time, no launch
            out.append((k, (0.0, 0.0, 0.0, 0.0, "host", 0.0, ""), host))
            gpu_s.append(0.0)
            continue
        t_c, t_m, cls, rate, note = terms[i]
        if sustained:
            speed = speeds[cls]
            t_c, rate = t_c / speed, rate * speed
            t_m /= speeds["memory"]
        t = t_m if t_m > t_c else t_c  # max(t_c, t_m)
        if launch_s > t:
            per, bound = t + launch_s, "launch"
            out.append((k, (t_c, t_m, launch_s, per, bound, rate, note), host))
        else:
            per, bound = t + gap, "compute" if t_c >= t_m else "memory"
            out.append((k, (t_c, t_m, gap, per, bound, rate, note), host))
        gpu_s.append(per)
        time_s = per * n  # roofline.row's time_s
        per_c[ci][pi] += time_s
        bound_c[ci][bound] += time_s
        gpu[pi] += time_s
    counts = tuple([k.count for k in ks])
    fixed = lay.blocks.get(counts)  # the host side and the launches follow the counts alone
    if fixed is None:
        if len(lay.blocks) >= MEMO_SIZE:
            lay.blocks.clear()
        fixed = lay.blocks[counts] = _fixed(lay, out, layers)
    blocks, n_comp, host_ph, n_ph = fixed
    comps = {name: dict(forward_s=p[0], backward_s=p[1], optimizer_s=p[2], kernels=n, bound_s=b, total_s=sum(p))
             for name, p, n, b in zip(lay.components, per_c, n_comp, bound_c)}
    phases = {ph: dict(gpu_s=gpu[i], host_s=host_ph[i], kernels=n_ph[i]) for i, ph in enumerate(pipeline.PHASES)}
    return out, gpu_s, blocks, comps, phases


def _fixed(lay: Layout, out: list[tuple], layers: int) -> tuple:
    """(pipeline.prepare's blocks, launches per component, host seconds and launches per phase) of timed's
    entries: what their counts decide."""
    n_comp, host, n_ph = [0] * len(lay.components), [0.0, 0.0, 0.0], [0, 0, 0]
    for (k, _, h), (ci, pi) in zip(out, lay.slots):
        n = 0 if k.kind == "host" else k.count  # a host-only entry launches nothing
        n_comp[ci] += n
        host[pi] += h
        n_ph[pi] += n
    blocks = pipeline.prepare(pipeline.layout([k for k, _, _ in out], layers), [h / k.count for k, _, h in out])
    return blocks, n_comp, host, n_ph
