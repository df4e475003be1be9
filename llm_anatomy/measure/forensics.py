"""`anatomy forensics`: what is alive at the peak of a training step, and which component made it.

    anatomy forensics [--preset seed] [--batch 16 --seq 4096] [--variant baseline] [--optimizer adamw]
                      [--top 12] [--png PATH] [--out PATH] [--snapshot PATH] [--json]

It prints the phase table (llm_anatomy.measure.memory.measure_phases), then records the CUDA caching
allocator's history over a model build and two training steps (llm_anatomy.measure.memory.record_step)
and replays it here:
  - every allocation is attributed to a component, first by its Python frames (a frame in
    anatomy/{baseline,efficient}/<component>.py, llm_anatomy/kernels/<kernel>.py, Liger's fused CE or
    torch/optim), then by the module call stack: record_step emits a tiny marker allocation whenever
    the running component changes (module hooks in forward, autograd-node pre-hooks in backward), so
    an allocation with no Python frames of ours (every built-in backward op runs on the autograd
    engine's device thread, which has none) gets the component whose forward or backward was running;
  - the allocated total is replayed event by event (an allocation counts until its free is
    requested, as torch.cuda.memory_allocated counts it); the peak is its maximum, and the live
    allocations at that event are the peak's contents, ranked by size;
  - a PNG shows allocated memory over the last step, stacked by component (matplotlib Agg).
The replay, the attribution and the plot are pure functions of the snapshot dict. On CPU
(--device cpu, the default without a GPU) llm_anatomy.measure.liveness records the same kind of trace
from live tensor storage: exact sizes, no allocator rounding, no reserved figure.
"""
from __future__ import annotations

import io
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llm_anatomy.io import write_atomic

COMPONENTS = ("embedding", "attention", "norm", "mlp", "moe", "loss", "optimizer")
PRE_EXISTING = "pre-existing"  # allocated before the recording began (or outside its ring buffer)
COLOURS = {"embedding": "#8c564b", "attention": "#1f77b4", "norm": "#2ca02c", "mlp": "#ff7f0e", "moe": "#bcbd22",
           "loss": "#d62728", "optimizer": "#9467bd", "other": "#7f7f7f", PRE_EXISTING: "#c7c7c7"}

# The marker protocol shared with llm_anatomy.measure.memory.record_step: a marker is an allocation of
# (index + 1) * MARKER_BLOCK bytes made by a function named MARKER_FUNC; the index names a label.
# 512 B is the allocator's block granularity, so the recorded size is exactly the requested one.
MARKER_FUNC = "_anatomy_marker"
MARKER_BLOCK = 512
PHASES = ("forward", "backward", "optimizer", "end", "zero_grad")  # zero_grad: without an optimizer
MARKER_LABELS = ("other",) + COMPONENTS + tuple(f"phase:{p}" for p in PHASES)

# file -> component, for allocations whose Python frames pass through our code (or Liger's, or torch.optim)
_FILE_RULES = tuple((re.compile(p), c) for p, c in (
    (r"anatomy/(?:baseline|efficient)/attention\.py$", "attention"),
    (r"anatomy/(?:baseline|efficient)/norm\.py$", "norm"),
    (r"anatomy/(?:baseline|efficient)/mlp\.py$", "mlp"),
    (r"anatomy/(?:baseline|efficient)/moe\.py$", "moe"),
    (r"llm_anatomy/kernels/moe_unpermute\.py$", "moe"),
    (r"anatomy/(?:baseline|efficient)/loss\.py$", "loss"),
    (r"llm_anatomy/kernels/rope\.py$", "attention"),
    (r"llm_anatomy/kernels/rms_norm\.py$", "norm"),
    (r"llm_anatomy/kernels/swiglu\.py$", "mlp"),
    (r"liger_kernel/.*cross_entropy\.py$", "loss"),
    (r"(?:torch|anatomy)/optim/", "optimizer"),
))
_TRANSFORMER = re.compile(r"anatomy/(?:baseline|efficient)/transformer\.py$")


def marker_size(label: str) -> int:
    return (MARKER_LABELS.index(label) + 1) * MARKER_BLOCK


def marker_label(entry: dict) -> str | None:
    """The label of a marker allocation, or None for an ordinary one."""
    if entry.get("action") != "alloc" or not any(f.get("name") == MARKER_FUNC for f in entry.get("frames") or ()):
        return None
    i = entry["size"] // MARKER_BLOCK - 1
    return MARKER_LABELS[i] if 0 <= i < len(MARKER_LABELS) and entry["size"] % MARKER_BLOCK == 0 else None


def _path(f: dict) -> str:
    return str(f.get("filename", "")).replace("\\", "/")


def component_from_frames(frames: list[dict]) -> str | None:
    """The component whose source file appears in an allocation's frames (None if none does).

    Components do not nest in these models, so at most one component file is on any stack; the
    Transformer's own __init__ allocates exactly one parameter itself, the embedding table (every
    other parameter is made inside a component module's __init__)."""
    for f in frames:
        p = _path(f)
        for rx, comp in _FILE_RULES:
            if rx.search(p):
                return comp
    if any(_TRANSFORMER.search(_path(f)) and f.get("name") == "__init__" for f in frames):
        return "embedding"
    return None


def kind_of(frames: list[dict], phase: str) -> str:
    names = {f.get("name") for f in frames}
    if "__init__" in names or "build_model" in names:
        return "parameter"
    if "make_batch" in names:
        return "input"
    if any(re.search(r"(?:torch|anatomy)/optim/", _path(f)) for f in frames):
        return "optimizer state"
    return {"forward": "activation", "backward": "gradient / backward buffer", "optimizer": "optimizer temporary",
            "setup": "setup"}.get(phase, phase)


def where(frames: list[dict]) -> str:
    """file:line:function of the innermost frame in the models or kernels (frames are innermost
    first), else the innermost in anatomy/, else the innermost at all; "?" without frames."""
    for pattern in (r"anatomy/(?:baseline|efficient|kernels)/", r"anatomy/"):
        for f in frames:
            if re.search(pattern, _path(f)):
                return f"{_path(f).split('anatomy/', 1)[1]}:{f.get('line')}:{f.get('name')}"
    return f"{_path(frames[0]).rsplit('/', 1)[-1]}:{frames[0].get('line')}:{frames[0].get('name')}" if frames else "?"


@dataclass
class Alloc:
    addr: int
    size: int
    component: str
    via: str  # "frames" | "module stack" | "none"
    kind: str
    phase: str  # the phase it was made in
    step: int
    where: str


@dataclass
class Event:
    """One alloc (delta > 0) or requested free (delta < 0); alloc None: a free of pre-existing memory."""
    alloc: Alloc | None
    delta: int
    phase: str
    step: int
    running: str  # the component running when it happened (the module call stack's label)

    @property
    def component(self) -> str:
        return self.alloc.component if self.alloc else PRE_EXISTING


@dataclass
class Replay:
    events: list[Event] = field(default_factory=list)
    marks: list[tuple[int, str, int]] = field(default_factory=list)  # (event position, phase, step)
    pre_existing: int = 0  # bytes live before the first event
    steps: int = 0
    peak: int = 0  # bytes, pre-existing included
    peak_pos: int = -1  # event position of the peak; -1: before the first event

    @property
    def peak_event(self) -> Event | None:
        return self.events[self.peak_pos] if self.peak_pos >= 0 else None

    def live_at(self, pos: int) -> list[Alloc]:
        live: dict[int, Alloc] = {}
        for ev in self.events[:pos + 1]:
            if ev.alloc is not None:
                if ev.delta > 0:
                    live[id(ev.alloc)] = ev.alloc
                else:
                    live.pop(id(ev.alloc), None)
        return list(live.values())


def replay(snapshot: dict, device: int = 0, peak_phase: str | None = None) -> Replay:
    """Replay device `device`'s allocator trace (torch.cuda.memory._snapshot()["device_traces"]).

    Memory allocated before the trace began shows up as frees with no recorded alloc, or as blocks
    still allocated at the end (snapshot["segments"]) with none: it is `pre_existing`, live from
    the start, and its frees subtract from it as they happen."""
    traces = snapshot.get("device_traces") or [[]]
    r = Replay()
    live, markers = _walk(traces[device] if device < len(traces) else [], r)
    end_unseen = sum(b["size"] for s in snapshot.get("segments", []) for b in s.get("blocks", [])
                     if b.get("state") == "active_allocated" and b.get("address") not in live
                     and b.get("address") not in markers)
    r.pre_existing = end_unseen - sum(ev.delta for ev in r.events if ev.alloc is None)
    _find_peak(r, peak_phase)
    return r


def _walk(trace: list[dict], r: Replay) -> tuple[dict[int, Alloc], set[int]]:
    """Fill r.events, r.marks and r.steps from the trace; returns the allocations still live at its
    end and the marker blocks not yet freed (both by address)."""
    label, phase, step = "other", "setup", 0
    live: dict[int, Alloc] = {}
    markers: set[int] = set()
    for e in trace:
        act = e.get("action")
        if act == "alloc":
            lab = marker_label(e)
            if lab is not None:  # a marker: the running component or phase changes, no memory event
                markers.add(e["addr"])
                if lab.startswith("phase:"):
                    phase = lab.removeprefix("phase:")
                    step += phase == "forward"
                    r.marks.append((len(r.events), phase, step))
                else:
                    label = lab
                continue
            frames = e.get("frames") or []
            comp, via = component_from_frames(frames), "frames"
            if comp is None:
                comp, via = (label, "module stack") if label != "other" else ("other", "none")
            a = Alloc(e["addr"], e["size"], comp, via, kind_of(frames, phase), phase, step, where(frames))
            live[a.addr] = a
            r.events.append(Event(a, a.size, phase, step, label))
        elif act in ("free_requested", "free"):  # "free": traces of torches without the requested/completed split
            addr = e.get("addr")
            if addr in markers:
                markers.discard(addr)
            elif addr in live:
                a = live.pop(addr)
                r.events.append(Event(a, -a.size, phase, step, label))
            else:
                r.events.append(Event(None, -int(e.get("size", 0)), phase, step, label))
        # free_completed (the block becomes reusable: memory_allocated already dropped at the request),
        # segment_alloc/segment_free (cudaMalloc/cudaFree: reserved memory), snapshot, oom: no change
    r.steps = step
    return live, markers


def _find_peak(r: Replay, peak_phase: str | None) -> None:
    """r.peak and r.peak_pos: the largest running total, pre-existing bytes included (inside
    `peak_phase` when given)."""
    total, r.peak, r.peak_pos = r.pre_existing, r.pre_existing, -1
    for i, ev in enumerate(r.events):
        total += ev.delta
        if total > r.peak and peak_phase in (None, ev.phase):
            r.peak, r.peak_pos = total, i


def attribute_peak(snapshot: dict, top: int = 12, device: int = 0, phase: str | None = None) -> dict:
    """The peak's contents: bytes live at the peak by component and by kind, and the `top` largest."""
    r = replay(snapshot, device, phase)  # the peak inside `phase` when given
    live = r.live_at(r.peak_pos)
    by_comp: dict[str, int] = defaultdict(int)
    by_kind: dict[str, int] = defaultdict(int)
    for a in live:
        by_comp[a.component] += a.size
        by_kind[a.kind] += a.size
    pre_left = r.peak - sum(a.size for a in live)  # pre-existing bytes not yet freed at the peak
    if pre_left:
        by_comp[PRE_EXISTING] += pre_left
        by_kind[PRE_EXISTING] += pre_left
    ev = r.peak_event
    return dict(
        peak_bytes=r.peak, peak_event=r.peak_pos, peak_phase=ev.phase if ev else "setup",
        peak_step=ev.step if ev else 0, peak_during=ev.running if ev else "other",
        pre_existing_bytes=r.pre_existing, events=len(r.events), steps=r.steps,
        by_component=dict(sorted(by_comp.items(), key=lambda kv: -kv[1])),
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        attributed_by={v: sum(a.size for a in live if a.via == v) for v in ("frames", "module stack", "none")},
        top=[dict(asdict(a), addr=hex(a.addr)) for a in sorted(live, key=lambda a: -a.size)[:top]],
    )


def step_series(r: Replay, step: int | None = None) -> tuple[list[int], dict[str, list[int]], list[tuple[int, str]]]:
    """Live bytes per component after every event of one step (default: the last), counting what was
    live when the step began (parameters, inputs, optimizer state) under its own component.
    Returns (event positions, {component: bytes after each}, [(position, phase) at each boundary])."""
    step = r.steps if step is None else step
    cur: dict[str, int] = defaultdict(int)
    cur[PRE_EXISTING] = r.pre_existing
    xs: list[int] = []
    rows: list[dict[str, int]] = []
    for i, ev in enumerate(r.events):
        cur[ev.component] += ev.delta
        if ev.step == step:
            xs.append(i)
            rows.append(dict(cur))
    names = [c for c in list(COLOURS) + sorted(set(cur) - set(COLOURS)) if any(row.get(c) for row in rows)]
    ys = {c: [row.get(c, 0) for row in rows] for c in names}
    marks = [(pos, ph) for pos, ph, s in r.marks if s == step and ph != "end"]
    return xs, ys, marks


def plot_timeline(r: Replay, path: str | Path, title: str = "", step: int | None = None,
                  max_points: int = 4000) -> Path:
    """Stacked area of allocated memory (GiB) over one step's allocator events, one colour per component."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys, marks = step_series(r, step)
    keep = list(range(0, len(xs), max(1, len(xs) // max_points)))
    if r.peak_pos in xs:  # thinning must not drop the peak
        keep = sorted(set(keep) | {xs.index(r.peak_pos)})
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=120)
    if xs:
        names, x0 = list(ys), xs[0]  # x counts events from the start of the step
        # a step plot holds each value until the next event; repeat the last so it gets a width too
        ax.stackplot([xs[i] - x0 for i in keep] + [xs[-1] - x0 + 1],
                     [[ys[c][i] / 2**30 for i in keep] + [ys[c][-1] / 2**30] for c in names], labels=names,
                     colors=[COLOURS.get(c, "#17becf") for c in names], step="post", linewidth=0)
        for pos, ph in marks:
            ax.axvline(pos - x0, color="black", lw=0.6, ls=":")
            ax.text(pos - x0, 0.99, f" {ph}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        if r.peak_pos in xs:
            ax.axvline(r.peak_pos - x0, color="red", lw=0.8, ls="--")
            ax.text(r.peak_pos - x0, 0.9, f" peak {r.peak / 2**30:,.2f} GiB", color="red",
                    transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        ax.legend(loc="upper left", fontsize=8, ncol=len(names), frameon=False, bbox_to_anchor=(0, -0.13))
    ax.set_xlabel("allocator event (alloc or free) in the step")
    ax.set_ylabel("allocated (GiB = 2^30 B)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    buf = io.BytesIO()  # rendered in memory, then written all or nothing (a unique temp name, no link followed)
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    write_atomic(path, buf.getvalue(), parents=True)
    return path
