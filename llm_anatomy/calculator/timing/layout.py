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

import llm_anatomy.calculator.timing.pipeline as pipeline
import llm_anatomy.calculator.timing.roofline as roofline
from llm_anatomy.calculator.timing.host import host_call_s, in_situ
from llm_anatomy.calculator.timing.ops import Kernel
from llm_anatomy.calculator.timing.profile import Profile
from llm_anatomy.calculator.timing.roofline import launch_term, regime_speeds

_RANK = {ph: i for i, ph in enumerate(pipeline.PHASES)}
_BURST = {cls: 1.0 for cls in ("matmul", "attention", "memory")}  # regime_speeds at weight 0
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
    priced: tuple[tuple[int, int, int], ...]  # per position: (kernel index, 3 x its component's index + its
    #                                          phase's: timed's sums, or -1 for host work alone, phase index)
    kernels: tuple[Kernel, ...]  # per position: the entry as first laid out (pipeline.compose reads its name
    #                              and sync, which the key decides)


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
                  tuple(ks[i].calls for i in order), {},
                  tuple((i, -1 if ks[i].kind == "host" else 3 * ci + pi, pi) for i, (ci, pi) in zip(order, slots)),
                  tuple(ks[i] for i in order))


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
          layers: int, rows: bool = True) -> tuple[list[tuple], list[float], dict, dict, dict]:
    """The step's kernels at its sustained weight, in phase order: ([(kernel, roofline.timed figures, host
    seconds of all its launches)] where rows is true (else [] when the launch counts were laid out before),
    GPU seconds per launch, pipeline.prepare's blocks, the components and the phases of estimate_time). Each
    entry's seconds per launch and bound as roofline.timed gives them from its kernel_terms, written out in one
    pass. Per component: GPU seconds by phase, launches, seconds by bound and total; per phase: GPU and host
    seconds and launches."""
    speeds = regime_speeds(prof, sustained) if sustained else None
    scaled = speeds or _BURST  # x / 1.0 is x: burst rates divide by 1.0
    mem = scaled["memory"]
    launch_s, gap = prof.launch_s, launch_term(prof)
    acc = [0.0] * (3 * len(lay.components))  # GPU seconds by (component, phase): lay.priced's cells
    by_bound = [0.0] * (3 * len(lay.components))  # by (component, bound): compute, memory, launch
    gpu = [0.0, 0.0, 0.0]
    gpu_s, counts = [], [k.count for k in ks]
    for i, cell, pi in lay.priced:
        if cell < 0:  # host work alone (an optimizer call's Python): no GPU time, no launch
            gpu_s.append(0.0)
            continue
        t_c, t_m, cls, _, _ = terms[i]
        t_c /= scaled[cls]
        t_m /= mem
        t = t_m if t_m > t_c else t_c  # max(t_c, t_m)
        if launch_s > t:
            per, b = t + launch_s, 2  # launch-bound
        else:  # a kernel of real size waits for the one before to drain
            per, b = t + gap, 0 if t_c >= t_m else 1
        gpu_s.append(per)
        time_s = per * counts[i]  # roofline.row's time_s
        acc[cell] += time_s
        by_bound[cell - pi + b] += time_s
        gpu[pi] += time_s
    counts = tuple(counts)
    fixed = lay.blocks.get(counts)  # the host side and the launches follow the counts alone
    out = []
    if rows or fixed is None:
        for i, unit, f, calls in zip(lay.order, lay.host_call, lay.host_factor, lay.calls):
            k = ks[i]
            host = ((k.count if calls is None else calls) * unit) * f  # host.host_seconds x the host factor
            out.append((k, roofline.timed(k, prof, sustained, terms[i], speeds), host))
    if fixed is None:
        if len(lay.blocks) >= MEMO_SIZE:
            lay.blocks.clear()
        fixed = lay.blocks[counts] = _fixed(lay, out, layers)
    blocks, n_comp, host_ph, n_ph = fixed
    comps = {name: {"forward_s": acc[j], "backward_s": acc[j + 1], "optimizer_s": acc[j + 2], "kernels": n,
                    "bound_s": {"compute": by_bound[j], "memory": by_bound[j + 1], "launch": by_bound[j + 2]},
                    "total_s": sum(acc[j:j + 3])}
             for name, n, j in zip(lay.components, n_comp, range(0, len(acc), 3))}
    phases = {ph: {"gpu_s": gpu[i], "host_s": host_ph[i], "kernels": n_ph[i]} for i, ph in enumerate(pipeline.PHASES)}
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
