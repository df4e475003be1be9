"""Host and GPU as a pipeline: when each kernel can start, given when the host issues it.

The host runs the step's Python (module calls, autocast, autograd) and enqueues each kernel when it
has done that op's host work; the GPU runs kernels in order, each as soon as it is enqueued and the
one before has finished. So a kernel starts at max(GPU free, host issue time), and the GPU idles
wherever the host has fallen behind, even in a step whose total host time is below its GPU time:
after a host sync (Liger's .item() in forward, torch.equal at the start of backward) the queue is
empty, and host-heavy ops early in a segment (a norm's backward, the custom ops' autograd) leave
the GPU waiting until the GEMMs build a lead again. max(GPU, host) per segment, the model before
session 7, had no such idle and under-predicted the GPU-bound steps by up to 14% (docs/timing.md).

Launch order. The kernel lists (launches.py) hold one entry per kernel with a count over the whole
step; entries of the layers (order 1) are spread over the layers: count // layers launches per layer
in list order (the code's order), the remainder (the final norm) after the last layer in forward and
before the first in backward, and backward walks the layers, and each layer's entries, in reverse.
Entries before (order 0) and after (order 2) the layers run in list order, each count times in a row,
except the entries of Liger's chunk loop (Kernel.loop), which run chunk by chunk.
No parameter is fitted: the GPU time per launch and the host time per op come from the profile.
"""
from __future__ import annotations

PHASES = ("forward", "backward", "optimizer")


def launch_order(entries: list, phase: str, layers: int) -> list:
    """[(entry, launches)] of one phase in execution order; entry.kernel has phase, order and count."""
    mine = [e for e in entries if e.kernel.phase == phase]
    pre = [(e, e.kernel.count) for e in mine if e.kernel.order == 0]
    post = _chunked([e for e in mine if e.kernel.order == 2])
    mid = [e for e in mine if e.kernel.order == 1]
    per_layer = [(e, e.kernel.count // layers) for e in mid if e.kernel.count >= layers]
    rest = [(e, e.kernel.count - (e.kernel.count // layers) * layers if e.kernel.count >= layers else e.kernel.count)
            for e in mid]
    rest = [(e, n) for e, n in rest if n]
    if phase == "backward":
        return pre + rest + per_layer[::-1] * layers + post
    return pre + per_layer * layers + rest + post


def _chunked(entries: list) -> list:
    """[(entry, launches)] in list order, except that a run of consecutive loop entries with one count n
    (Liger's chunk loop) goes chunk by chunk: each entry once, n times over."""
    out, i = [], 0
    while i < len(entries):
        k = entries[i].kernel
        j = i + 1
        while k.loop and j < len(entries) and entries[j].kernel.loop and entries[j].kernel.count == k.count:
            j += 1
        out += [(e, 1) for _ in range(k.count) for e in entries[i:j]] if k.loop else [(entries[i], k.count)]
        i = j
    return out


def simulate(entries: list, layers: int) -> list[dict]:
    """Segments {phase, starts_at, gpu_s, host_s, time_s, idle_s, bound} of a step. Each entry has
    .kernel (launches.Kernel), .gpu_s (per launch) and .host_s (per launch, host_scale applied). A
    segment ends at a host sync (the host waits for the GPU to drain) or where the optimizer starts."""
    h = g = 0.0  # host clock (issue time of the last op), GPU clock (end of the last kernel)
    segs: list[dict] = []
    for phase in PHASES:
        for e, n in launch_order(entries, phase, layers):
            k = e.kernel
            new = not segs or k.sync or (phase == "optimizer") != (segs[-1]["phase"] == "optimizer")
            if new:
                h = g = max(h, g)  # a sync, or the optimizer after backward: both clocks meet
                segs.append(dict(phase=phase, starts_at=k.name, gpu_s=0.0, host_s=0.0, start=h))
            for _ in range(n):
                h += e.host_s
                g = max(g, h) + e.gpu_s
            segs[-1]["gpu_s"] += n * e.gpu_s
            segs[-1]["host_s"] += n * e.host_s
            segs[-1]["end"] = max(g, h)
    for sg in segs:
        sg["time_s"] = sg.pop("end") - sg.pop("start")
        sg["idle_s"] = max(0.0, sg["time_s"] - sg["gpu_s"])
        sg["bound"] = "host" if sg["host_s"] > sg["gpu_s"] else "gpu"
    return segs


def steady(entries: list, layers: int) -> dict:
    """{forward_backward_s, step_s} of a step run back to back with the one before, as a training loop
    (and scripts/probe_timing.py's unmarked steps) runs them: nothing waits between steps, so the next
    forward is issued while the GPU still runs this backward and optimizer, and only the host syncs
    (Liger's .item() and torch.equal) make the clocks meet. Each figure is read as the probe's CUDA
    events read it: an event enqueued at host time h is stamped when the GPU reaches it, max(GPU, h);
    forward_backward is from the step's start to after its backward, step to after its optimizer.
    The second of two simulated steps is reported (the first starts on an idle GPU, as bench/step.py's
    synchronized steps do: simulate())."""
    h = g = 0.0
    for _ in range(2):
        t0 = max(g, h)
        for phase in PHASES:
            if phase == "optimizer":
                t1 = max(g, h)
            for e, n in launch_order(entries, phase, layers):
                if e.kernel.sync:
                    h = g = max(h, g)
                for _ in range(n):
                    h += e.host_s
                    g = max(g, h) + e.gpu_s
    return dict(forward_backward_s=t1 - t0, step_s=max(g, h) - t0)
