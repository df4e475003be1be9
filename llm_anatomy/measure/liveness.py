"""Live tensor storage on any device, phase by phase: the CPU's stand-in for torch.cuda.max_memory_allocated.

A TorchDispatchMode sees every op's outputs; each new storage is counted until a weakref finalizer
says it is gone. So `allocated` is the bytes of the storages alive now and `peak` the largest such
sum since the last phase boundary, checked after every op. Outputs are counted at their exact size
(no allocator rounding, no workspace inside a kernel): a tensor-level figure, which the calculator
predicts with device="cpu".

torch.distributed._tools.mem_tracker.MemTracker counts the same storages, but its peak is one
figure per tracker with no public reset between phases, and the backward's own peak is what the
memory model is checked on; this instrument keeps one peak per phase.

With record=True it also writes a trace in the format of torch.cuda.memory._snapshot()
(device_traces of alloc / free_requested entries with Python frames, innermost first), with the
same component and phase markers llm_anatomy.measure.memory.record_step leaves, so `anatomy forensics`
replays, attributes and plots a CPU step with the code it uses for a CUDA one.
"""
from __future__ import annotations

import itertools
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llm_anatomy.config import ModelConfig, Run


class LiveStorage(TorchDispatchMode):
    def __init__(self, record: bool = False):
        super().__init__()
        self._live: dict[int, int] = {}  # storage id -> bytes
        self.allocated = 0
        self.peak = 0
        self.peak_op = ""  # the op after which the phase's peak was reached
        self.trace: list[dict] | None = [] if record else None
        self._marker_addr = itertools.count(-1, -1)  # markers get addresses no storage has

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the mode (parameters, inputs)."""
        for t in tensors:
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        self._live[key] = st.nbytes()
        self.allocated += st.nbytes()
        if self.trace is not None:
            self.trace.append(dict(action="alloc", addr=key, size=st.nbytes(), frames=_frames()))
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        n = self._live.pop(key)
        self.allocated -= n
        if self.trace is not None:
            self.trace.append(dict(action="free_requested", addr=key, size=n))

    def marker(self, label: str) -> None:
        """A zero-cost marker in the trace (forensics.MARKER_LABELS): the running component or phase."""
        from llm_anatomy.measure.forensics import MARKER_FUNC, marker_size

        if self.trace is not None:
            addr = next(self._marker_addr)
            self.trace.append(dict(action="alloc", addr=addr, size=marker_size(label),
                                   frames=[dict(name=MARKER_FUNC, filename=__file__, line=0)]))
            self.trace.append(dict(action="free_requested", addr=addr, size=marker_size(label)))

    def snapshot(self) -> dict:
        """The trace as torch.cuda.memory._snapshot() lays it out (one device, no segments)."""
        return {"device_traces": [list(self.trace or [])], "segments": []}

    def phase(self, name: str) -> dict:
        """The phase that ends now: bytes alive, and the peak since the last boundary; resets the peak."""
        row = dict(name=name, allocated=self.allocated, peak=max(self.peak, self.allocated), peak_op=self.peak_op)
        self.peak, self.peak_op = self.allocated, ""
        return row

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        if self.allocated > self.peak:
            self.peak, self.peak_op = self.allocated, str(func)
        return out


def _frames(limit: int = 40) -> list[dict]:
    """Python frames of the caller, innermost first, as the CUDA allocator's history records them."""
    out, f = [], sys._getframe(3)
    while f is not None and len(out) < limit:
        if f.f_code.co_filename != __file__:  # the instrument's own frames say nothing about the tensor
            out.append(dict(filename=f.f_code.co_filename, line=f.f_lineno, name=f.f_code.co_name))
        f = f.f_back
    return out


def measure_phases_live(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = None,
                        device: str = "cpu", steps: int = 2, prepare=None) -> list[dict]:
    """The phases of measure.memory.measure_phases, counted by LiveStorage on `device` (CPU by default):
    init, forward, backward (its peak is the peak inside backward), optimizer. The last of `steps` steps.
    prepare: a function called with the model before the steps (e.g. one that forces the MoE routing)."""
    from llm_anatomy.measure.memory import phased_steps, setup_step

    model, ids, targets, opt = setup_step(cfg, run, variant, optimizer, device)
    if prepare is not None:
        prepare(model)
    live = LiveStorage()
    live.track(*model.parameters(), ids, targets)
    with live:
        return phased_steps(model, ids, targets, opt, run, steps, live.phase, torch.device(device).type)


def record_step_live(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = "adamw",
                     steps: int = 2, device: str = "cpu") -> dict:
    """The CPU counterpart of llm_anatomy.measure.memory.record_step: a model build and `steps` training
    steps recorded by LiveStorage, with component and phase markers, as a snapshot dict."""
    from llm_anatomy.measure.memory import marked_steps, setup_step

    live = LiveStorage(record=True)
    with live:
        model, ids, targets, opt = setup_step(cfg, run, variant, optimizer, device)
        marked_steps(model, ids, targets, opt, run, steps, live.marker, torch.device(device).type)
        del model, opt, ids, targets
    return live.snapshot()
