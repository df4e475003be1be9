"""Per-component GPU time of a training step, measured in place (no calculator import).

Method: the component markers of llm_anatomy.measure.memory.marked_steps (module hooks in forward,
autograd-node pre-hooks in backward) call mark(label) whenever the running component changes and
at every phase boundary. Each mark records a timestamp: on CUDA a torch.cuda.Event recorded on the
current stream (so the interval between two marks is the GPU time of the work enqueued between
them, idle gaps included), on CPU time.perf_counter(). attribute() turns consecutive marks into
intervals and credits each one to (phase, component): the phase of the last "phase:*" mark, the
component of the last component label (what ComponentTracker.label holds at that moment; it is
not reset by a phase mark, because the tracker only marks changes: a forward that starts in the
component the backward ended in emits no label). Intervals before the first phase mark and after
"phase:end" are not part of a step. Steps are the same loop without marks, timed around forward +
backward and around the whole step, so the markers' overhead shows as marked - plain.

The same marks also stamp the host clock (time.perf_counter), so `host` holds the same breakdown
of when the host issued each component's work: host-bound where it matches the GPU figure.

Reported (milliseconds, the median over `steps` timed steps of each entry separately, so the
medians need not add up; every entry of `per_step` does):
  components  {phase: {component: ms}}   phases  {phase: ms}
  forward_backward_ms, step_ms            (marked)
  plain_forward_backward_ms, plain_step_ms  (unmarked; plain_ms: each unmarked step's [fwd+bwd, step])
  host_ref_ms  [before, after] the unmarked steps, where a reference() was given
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.memory import marked_steps, setup_step
from llm_anatomy.models import autocast_ctx

PHASES = ("forward", "backward", "optimizer")


def attribute(marks: list[tuple[str, float]], label: str = "other") -> dict[str, dict[str, float]]:
    """{phase: {component: summed interval}} over a mark sequence [(label, time)], in the marks' time
    unit. `label` is the component running before the first mark."""
    out: dict[str, dict[str, float]] = {}
    phase = None
    for (name, t), (_, t_next) in zip(marks, marks[1:] + [(None, None)]):
        if name.startswith("phase:"):
            # zero_grad (marked only without an optimizer) is outside the step, as in the plain steps
            phase = None if name in ("phase:end", "phase:zero_grad") else name[len("phase:"):]
        else:
            label = name
        if phase is not None and t_next is not None:
            comps = out.setdefault(phase, {})
            comps[label] = comps.get(label, 0.0) + (t_next - t)
    return out


class _Clock:
    """now() stamps the current point of the device's work; ms(a, b) is the time from a to b (after sync())."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # on the calling thread's current stream (the autograd engine sets the node's stream)
        return ev

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _split_steps(marks: list[tuple[str, float]]) -> list[list[tuple[str, float]]]:
    """One mark list per step, each from its "phase:forward" to its "phase:end", led by the component
    label carried in from before (at the step's start time, so it spans nothing)."""
    steps, label, cur = [], "other", None
    for name, t in marks:
        if name == "phase:forward":
            cur = [(label, t)]
        if cur is not None:
            cur.append((name, t))
        if name == "phase:end" and cur is not None:
            steps.append(cur)
            cur = None
        if not name.startswith("phase:"):
            label = name
    return steps


def _one_step(comps: dict[str, dict[str, float]]) -> dict:
    phases = {ph: sum(comps.get(ph, {}).values(), 0.0) for ph in PHASES}
    return dict(components=comps, phases=phases, forward_backward_ms=phases["forward"] + phases["backward"],
                step_ms=sum(phases.values()))


def _median(per_step: list[dict]) -> dict:
    med = statistics.median
    keys = {(ph, c) for s in per_step for ph, cs in s["components"].items() for c in cs}
    comps: dict[str, dict[str, float]] = {}
    for ph, c in sorted(keys):
        comps.setdefault(ph, {})[c] = med(s["components"].get(ph, {}).get(c, 0.0) for s in per_step)
    return dict(components=comps, phases={ph: med(s["phases"][ph] for s in per_step) for ph in PHASES},
                forward_backward_ms=med(s["forward_backward_ms"] for s in per_step),
                step_ms=med(s["step_ms"] for s in per_step))


def _plain_steps(model, ids, targets, opt, run: Run, steps: int, clock: _Clock, device: str) -> list[tuple]:
    """`steps` unmarked steps: (start, after backward, end) stamps of each."""
    stamps = []
    for _ in range(steps):
        t0 = clock.now()
        with autocast_ctx(run, device):
            loss = model(ids, targets)
        loss.backward()
        del loss
        t1 = clock.now()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        stamps.append((t0, t1, clock.now()))
    return stamps


def component_times(cfg: ModelConfig, run: Run, variant: str, optimizer: str | None = "adamw", steps: int = 6,
                    warmup: int = 2, device: str = "cuda", plain_budget_ms: float | None = None,
                    reference: Callable[[], float] | None = None) -> dict:
    """Median per-step times (ms) per phase and component over `steps` marked steps, and of plain
    unmarked ones, each of those kept (plain_ms: [fwd+bwd, step]): `steps` of them, or with
    plain_budget_ms as many as fit in it at the marked steps' median (between `steps` and 4 x `steps`).
    reference() -> ms, where given, runs right before and right after the plain steps (the probe: the
    host's speed there, calibrate_host.HostStep); its two figures are kept as host_ref_ms."""
    clock = _Clock(device)
    model, ids, targets, opt = setup_step(cfg, run, variant, optimizer, device)  # ids, targets: (B, S) int64
    marked_steps(model, ids, targets, opt, run, warmup, lambda label: None, device)
    # (label, Event or perf_counter seconds, host perf_counter seconds), in call order
    raw: list[tuple[str, object, float]] = []
    marked_steps(model, ids, targets, opt, run, steps,
                 lambda label: raw.append((label, clock.now(), time.perf_counter())), device)
    refs = [reference()] if reference is not None else []
    n_plain = steps
    if plain_budget_ms:
        clock.sync()
        marked = _median([_one_step(attribute(s)) for s in _split_steps(
            [(name, clock.ms(raw[0][1], t)) for name, t, _ in raw])])["step_ms"]
        n_plain = min(4 * steps, max(steps, int(plain_budget_ms / max(marked, 1e-3))))
    plain = _plain_steps(model, ids, targets, opt, run, n_plain, clock, device)
    clock.sync()
    refs += [reference()] if reference is not None else []
    marks = [(name, clock.ms(raw[0][1], t)) for name, t, _ in raw]  # device ms since the first mark
    # the host's side: when the Python thread (or autograd's device thread) reached each mark. While
    # the host runs ahead of the GPU this is issue time; a host sync (Liger's .item()) adds the wait.
    host = [(name, (h - raw[0][2]) * 1e3) for name, _, h in raw]
    per_step = [_one_step(attribute(s)) for s in _split_steps(marks)]
    host_steps = [_one_step(attribute(s)) for s in _split_steps(host)]
    plain_ms = [[clock.ms(a, b), clock.ms(a, c)] for a, b, c in plain]
    out = dict(_median(per_step), host=_median(host_steps), steps=steps, warmup=warmup, device=str(device),
               marks_per_step=len(raw) // steps,
               plain_forward_backward_ms=statistics.median(fb for fb, _ in plain_ms),
               plain_step_ms=statistics.median(st for _, st in plain_ms), plain_ms=plain_ms, per_step=per_step,
               **(dict(host_ref_ms=refs) if refs else {}))
    del model, opt, ids, targets, plain
    if clock.cuda:
        torch.cuda.empty_cache()
    return out


# ---- GPU kernel time per component (torch.profiler) ------------------------------------------------
MARK = "anatomy.mark:"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def attribute_kernels(marks: list[tuple[str, float]], kernels: list[tuple[float, float, str]],
                      top: int = 12) -> dict[str, dict[str, dict]]:
    """{phase: {component: {"ms": summed kernel time, "n": kernels, "top": {kernel name: ms}}}}: each GPU kernel
    (launch time on the host, duration, name) is credited to the phase and component of the last mark
    before its launch, in the same time unit (microseconds from the profiler's trace). Unlike the
    CUDA-event intervals of component_times, this is the time kernels ran, not the time between
    marks: a component whose work the host issues slower than the GPU runs it is not charged the wait."""
    out: dict[str, dict[str, dict]] = {}
    phase, label = None, "other"
    events = sorted([(t, 0, i, name, 0.0) for i, (name, t) in enumerate(marks)]
                    + [(t, 1, i, name, d) for i, (t, d, name) in enumerate(kernels)], key=lambda e: e[:3])
    for _, is_kernel, _, name, dur in events:
        if not is_kernel:
            if name.startswith("phase:"):
                phase = None if name in ("phase:end", "phase:zero_grad") else name[len("phase:"):]
            else:
                label = name
        elif phase is not None:
            c = out.setdefault(phase, {}).setdefault(label, dict(ms=0.0, n=0, top={}))
            c["ms"] += dur / 1e3
            c["n"] += 1
            c["top"][name] = c["top"].get(name, 0.0) + dur / 1e3
    for comps in out.values():
        for c in comps.values():
            c["top"] = dict(sorted(c["top"].items(), key=lambda kv: -kv[1])[:top])
    return out


def trace_kernels(trace: dict) -> tuple[list[tuple[str, float]], list[tuple[float, float, str]]]:
    """(marks, kernels) from a torch.profiler Chrome trace: the marks are record_function ranges named
    MARK + label; each GPU event is paired with its launch on the host by the trace's correlation id."""
    evs = trace.get("traceEvents", [])
    marks = sorted(((e["name"][len(MARK):], e["ts"]) for e in evs
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith(MARK)), key=lambda m: m[1])
    launch = {e["args"]["correlation"]: e["ts"] for e in evs
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    kernels = [(launch[e["args"]["correlation"]], e["dur"], e["name"]) for e in evs
               if e.get("cat") in GPU_CATS and e.get("args", {}).get("correlation") in launch]
    return marks, kernels


def kernel_times(cfg: ModelConfig, run: Run, variant: str, optimizer: str | None = "adamw", steps: int = 2,
                 warmup: int = 2, prepare=None, top: int = 12) -> dict:
    """Mean GPU kernel time per step, per phase and component (attribute_kernels over a torch.profiler
    trace of `steps` marked steps after `warmup` unprofiled ones), each component's `top` kernels by name.
    prepare: called with the model before the steps (e.g. measure/routing.py's forced routing). CUDA only."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    model, ids, targets, opt = setup_step(cfg, run, variant, optimizer, "cuda")
    if prepare is not None:
        prepare(model)
    marked_steps(model, ids, targets, opt, run, warmup, lambda label: None, "cuda")
    torch.cuda.synchronize()

    def mark(label: str) -> None:
        with record_function(MARK + label):
            pass

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marked_steps(model, ids, targets, opt, run, steps, mark, "cuda")
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    marks, kernels = trace_kernels(trace)
    comps = attribute_kernels(marks, kernels, top)
    for phase in comps.values():
        for c in phase.values():
            c["ms"] /= steps
            c["n"] /= steps
            c["top"] = {k: v / steps for k, v in c["top"].items()}
    del model, opt, ids, targets
    torch.cuda.empty_cache()
    return dict(components=comps, steps=steps, warmup=warmup, kernels_per_step=len(kernels) / steps,
                marks_per_step=len(marks) / steps)
