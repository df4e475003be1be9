"""Host and GPU as a pipeline: when each kernel can start, given when the host issues it.

The host runs the step's Python (module calls, autocast, autograd) and enqueues each kernel when it has
done that op's host work; the GPU runs kernels in order, each as soon as it is enqueued and the one before
has finished. So a kernel starts at max(GPU free, host issue time), and the GPU idles wherever the host has
fallen behind, even in a step whose total host time is below its GPU time: after a host sync (Liger's
.item() in forward, torch.equal at the start of backward) the queue is empty, and host-heavy ops early in a
segment leave the GPU waiting until the GEMMs build a lead again. No parameter is fitted: the GPU time per
launch and the host time per op come from the profile.

Launch order. The kernel lists hold one entry per kernel with a count over the whole step; entries of the
layers (order 1) are spread over the layers: count // layers launches per layer in list order (the code's
order), the remainder (the final norm) after the last layer in forward and before the first in backward;
backward walks the layers, and each layer's entries, in reverse. Entries before (order 0) and after (order
2) the layers run in list order, each count times in a row, except the entries of Liger's chunk loop
(Kernel.loop), which run chunk by chunk.

Cost. One launch maps the lead d = GPU clock - host clock to max(d + gpu_s - host_s, gpu_s) and moves the
host clock by host_s. Maps of the form d -> max(d + a, b) compose into the same form, and n repeats of one
have a closed form, so a layer is composed once and raised to the layer count: the work does not grow with
the layers (or the launches per entry, or Liger's chunks). `walked` counts the blocks composed.
"""
from __future__ import annotations

PHASES = ("forward", "backward", "optimizer")
_NONE = float("-inf")
IDENTITY = (0.0, _NONE, 0.0)  # (a, b, host seconds): d -> max(d + a, b)


def power(m: tuple, n: int) -> tuple:
    """m applied n times: d -> max(d + n a, b + max(0, (n - 1) a))."""
    if n <= 0:
        return IDENTITY
    a, b, h = m
    return n * a, b + max(0.0, (n - 1) * a), n * h


def launch(gpu_s: float, host_s: float, n: int = 1) -> tuple:
    """n launches of one kernel: the host issues each after host_s, the GPU runs each for gpu_s."""
    return power((gpu_s - host_s, gpu_s, host_s), n)


def launch_order(entries: list, phase: str, layers: int) -> list[tuple[list, int]]:
    """[(block, repeats)] of one phase in execution order, a block being [(entry, launches)]; the layers'
    block appears once, with `layers` repeats. entry.kernel has phase, order and count."""
    pre, post, per_layer, rest = [], [], [], []
    for e in entries:  # one pass, in list order
        k = e.kernel
        if k.phase != phase:
            continue
        if k.order == 0:
            pre.append(([(e, k.count)], 1))
        elif k.order == 2:
            post.append(e)
        elif k.order == 1:
            n = k.count
            if n >= layers:
                per_layer.append((e, n // layers))
                n -= (n // layers) * layers
            if n:
                rest.append(([(e, n)], 1))
    post = _chunked(post)
    layer = per_layer[::-1] if phase == "backward" else per_layer
    if any(e.kernel.sync for e, _ in layer):  # a sync makes the clocks meet: each layer is walked, cut at syncs
        cuts = [i for i, (e, _) in enumerate(layer) if e.kernel.sync and i] + [len(layer)]
        body = [(layer[a:b], 1) for a, b in zip([0] + cuts[:-1], cuts)] * layers
    else:  # the layers never sync: one block, composed once and repeated
        body = [(layer, layers)] if layer else []
    return pre + rest + body + post if phase == "backward" else pre + body + rest + post


def expand(blocks: list[tuple[list, int]]) -> list[tuple[object, int]]:
    """[(entry, launches)] in execution order, every repeat written out (for reading and for tests: its
    length grows with the layers, which the pipeline itself never walks)."""
    return [pair for block, reps in blocks for _ in range(reps) for pair in block]


def _chunked(entries: list) -> list[tuple[list, int]]:
    """[(block, repeats)] in list order, except that a run of consecutive loop entries with one count n
    (Liger's chunk loop) is one block of one launch each, repeated n times."""
    out, i = [], 0
    while i < len(entries):
        k = entries[i].kernel
        j = i + 1
        while k.loop and j < len(entries) and entries[j].kernel.loop and entries[j].kernel.count == k.count:
            j += 1
        out.append(([(e, 1) for e in entries[i:j]], k.count) if k.loop else ([(entries[i], k.count)], 1))
        i = j
    return out


def layout(kernels: list, layers: int) -> dict[str, list[tuple[list[tuple[int, int]], int]]]:
    """{phase: [(block, repeats)]}: launch_order of each phase over these kernels (ops.Kernel), a block being
    [(index into kernels, launches)]. It reads only what fixes the order (phase, order, count, sync, loop), so
    one layout serves every micro-batch of a model (timing.layout caches it)."""
    by_phase = {phase: [] for phase in PHASES}
    for i, k in enumerate(kernels):  # one pass: launch_order then reads its phase's entries only
        by_phase[k.phase].append(_Slot(k, i))
    return {phase: [([(e.i, n) for e, n in block], reps) for block, reps in launch_order(by_phase[phase], phase, layers)]
            for phase in PHASES}


class _Slot:
    """An entry of launch_order: a kernel and its index."""
    __slots__ = ("kernel", "i")

    def __init__(self, kernel, i: int):
        self.kernel, self.i = kernel, i


def prepare(lay: dict, host_s: list[float]) -> dict[str, list[tuple]]:
    """{phase: [(block as [(index, launches, host seconds per launch)], repeats, its first index, the host
    seconds of its map, its host seconds)]}: what compose takes from the host side of a layout, which the
    GPU seconds do not change (kept with a layout's count pattern: timing/layout.py)."""
    out = {}
    for phase, blocks in lay.items():
        steps = []
        for block, reps in blocks:
            m2, host, pairs = 0.0, 0.0, []
            for i, n in block:  # compose's host terms, in its order
                h = host_s[i]
                m2 += n * h if n > 0 else 0.0
                host += n * h
                pairs.append((i, n, h))
            steps.append((pairs, reps, block[0][0], m2, host))
        out[phase] = steps
    return out


def compose(prepared: dict, kernels: list, gpu_s: list[float]) -> dict[str, list[tuple]]:
    """{phase: [(first kernel, map, GPU seconds, host seconds, blocks)]}: each block of a prepared layout
    composed once into its map over all its repeats, from each kernel's GPU seconds per launch; simulate and
    steady walk these."""
    out = {}
    for phase, blocks in prepared.items():
        steps = []
        for pairs, reps, first, m2, host in blocks:
            m0, m1, gpu = 0.0, _NONE, 0.0  # IDENTITY
            for i, n, h in pairs:  # m = compose(m, launch(gpu_s[i], h, n)), written out
                g = gpu_s[i]
                if n == 1:  # most entries: as below with n = 1 (1 * a is a, (n - 1) * a is +-0.0), the same floats
                    a = g - h
                    x, y = m1 + a, g + 0.0
                    m0, m1, gpu = m0 + a, y if y > x else x, gpu + g
                elif n > 0:  # max(x, y) written `y if y > x else x`: the same value, without a call
                    a = g - h
                    la = n * a
                    x = (n - 1) * a
                    y = g + (x if x > 0.0 else 0.0)
                    x = m1 + la
                    m0, m1 = m0 + la, y if y > x else x
                    gpu += n * g
                else:
                    m0, m1 = m0 + 0.0, max(m1 + 0.0, _NONE)
                    gpu += n * g
            # power(m, 1) is (m0, m1 + 0.0, m2): 1 * x is x, and max(0.0, 0 * m0) is 0.0
            m = (m0, m1 + 0.0, m2) if reps == 1 else power((m0, m1, m2), reps)
            steps.append((kernels[first], m, reps * gpu, reps * host, len(pairs)))
        out[phase] = steps
    return out


def compose_layout(lay: dict, kernels: list, gpu_s: list[float], host_s: list[float]) -> dict[str, list[tuple]]:
    """compose over prepare: a layout's blocks composed from each kernel's GPU and host seconds per launch."""
    return compose(prepare(lay, host_s), kernels, gpu_s)


def plan(entries: list, layers: int) -> dict[str, list[tuple]]:
    """compose_layout over layout(): each block of launch_order composed once into its map over all its
    repeats. Each entry has .kernel, .gpu_s and .host_s (per launch)."""
    ks = [e.kernel for e in entries]
    return compose_layout(layout(ks, layers), ks, [e.gpu_s for e in entries], [e.host_s for e in entries])


class Clock:
    """The host and GPU clocks, advanced by composed blocks of launches."""

    def __init__(self):
        self.h = self.g = 0.0
        self.walked = 0  # blocks composed: the model's cost, independent of the layer count

    def meet(self) -> None:
        """A host sync (or the optimizer after backward): the host waits for the GPU."""
        self.h = self.g = max(self.h, self.g)

    def run(self, m: tuple) -> None:
        a, b, dh = m
        d = max(self.g - self.h + a, b)
        self.h += dh
        self.g = self.h + d


def simulate(entries: list, layers: int, clock: Clock | None = None, steps: dict | None = None) -> list[dict]:
    """Segments {phase, starts_at, gpu_s, host_s, time_s, idle_s, bound} of a step on an idle GPU. Each
    entry has .kernel (ops.Kernel), .gpu_s (per launch) and .host_s (per launch, host_scale applied). A
    segment ends at a host sync (the host waits for the GPU to drain) or where the optimizer starts.
    steps: plan(entries, layers), where the caller has it."""
    clk, segs = clock or Clock(), []
    steps = steps or plan(entries, layers)
    h, g, walked, seg, seg_opt = clk.h, clk.g, clk.walked, None, False
    for phase in PHASES:
        opt = phase == "optimizer"
        for k, m, gpu, host, n in steps[phase]:
            if seg is None or k.sync or opt != seg_opt:
                if seg is not None:  # the segment before ends where its last block left the clocks
                    seg[5] = h if h > g else g
                h = g = g if g > h else h  # Clock.meet: max(h, g)
                seg, seg_opt = [phase, k.name, 0.0, 0.0, h, h], opt  # phase, starts_at, gpu_s, host_s, start, end
                segs.append(seg)
            a, b, dh = m  # Clock.run, written out (max(x, y) as `y if y > x else x`)
            d = g - h + a
            d = b if b > d else d
            h += dh
            g = h + d
            walked += n
            seg[2] += gpu
            seg[3] += host
    if seg is not None:
        seg[5] = h if h > g else g
    clk.h, clk.g, clk.walked = h, g, walked
    out = []
    for phase, starts_at, gpu, host, start, end in segs:
        time_s = end - start
        out.append({"phase": phase, "starts_at": starts_at, "gpu_s": gpu, "host_s": host, "time_s": time_s,
                    "idle_s": max(0.0, time_s - gpu), "bound": "host" if host > gpu else "gpu"})
    return out


def steady(entries: list, layers: int, steps: dict | None = None) -> dict:
    """{forward_backward_s, step_s} of a step run back to back with the one before, as a training loop (and
    scripts/probe_timing.py's unmarked steps) runs them: nothing waits between steps, so the next forward is
    issued while the GPU still runs this backward and optimizer, and only the host syncs make the clocks
    meet. Each figure is read as the probe's CUDA events read it: an event enqueued at host time h is
    stamped when the GPU reaches it, max(GPU, h); forward_backward is from the step's start to after its
    backward, step to after its optimizer. The second of two simulated steps is reported (the first starts
    on an idle GPU, as bench/step.py's synchronized steps do: simulate())."""
    steps = steps or plan(entries, layers)
    h = g = 0.0  # a Clock's, written out
    for _ in range(2):
        t0 = max(g, h)
        for phase in PHASES:
            if phase == "optimizer":
                t1 = max(g, h)
            for k, (a, b, dh), _, _, _ in steps[phase]:
                if k.sync:
                    h = g = g if g > h else h  # max(h, g)
                d = g - h + a  # max(g - h + a, b)
                d = b if b > d else d
                h += dh
                g = h + d
    return dict(forward_backward_s=t1 - t0, step_s=max(g, h) - t0)
