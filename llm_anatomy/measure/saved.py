"""Saved-tensor tracer: every tensor autograd keeps for backward, attributed to its component.

Built on torch.autograd.graph.saved_tensors_hooks. Two figures per component:
- tensor bytes: numel × itemsize of each saved tensor as autograd sees it (views counted at their size);
- storage bytes: each underlying storage once, at its full size, attributed to the first component
  that saved it. A view and its base count once; a small view of a big buffer costs the whole buffer.
Parameters and buffers (and their views) are model state, not activations, and are excluded.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from llm_anatomy.measure.components import ComponentTracker


@dataclass
class SavedRecord:
    component: str
    shape: tuple
    dtype: str
    tensor_bytes: int
    storage_bytes: int  # bytes of the storage if this record is its first sighting, else 0
    storage_key: int


@dataclass
class SavedReport:
    records: list[SavedRecord] = field(default_factory=list)

    def storage_bytes(self, component: str | None = None) -> int:
        return sum(r.storage_bytes for r in self.records if component in (None, r.component))

    def tensor_bytes(self, component: str | None = None) -> int:
        return sum(r.tensor_bytes for r in self.records if component in (None, r.component))

    def by_component(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.component] += r.storage_bytes
        return dict(out)

    def count(self, component: str, shape: tuple | None = None) -> int:
        """How many distinct storages a component saved (optionally: of one shape)."""
        return sum(1 for r in self.records if r.component == component and r.storage_bytes
                   and (shape is None or r.shape == tuple(shape)))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl address: shared by a view and its base, also on meta


class SavedTensorTracer:
    """with SavedTensorTracer(model) as tr: loss = model(...)   ->   tr.report"""

    def __init__(self, model: nn.Module):
        self.model = model
        self.report = SavedReport()
        self._seen: set[int] = set()
        self._keep: list[torch.Tensor] = []  # keeps storages alive so their keys cannot be reused

    def _pack(self, t: torch.Tensor):
        key = _key(t)
        if key in self._state:
            return t
        first = key not in self._seen
        self._seen.add(key)
        self._keep.append(t)
        self.report.records.append(SavedRecord(
            self._tracker.label, tuple(t.shape), str(t.dtype).removeprefix("torch."),
            t.numel() * t.element_size(), t.untyped_storage().nbytes() if first else 0, key))
        return t

    def __enter__(self):
        self._state = {_key(t) for t in list(self.model.parameters()) + list(self.model.buffers())}
        self._tracker = ComponentTracker(self.model).__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._tracker.__exit__(*exc)
        self._keep.clear()
        return False
