"""The activations a rank holds for backward, live: the measured side of the pipeline's in-flight saved bytes.

SavedInFlight is a torch.autograd.graph.saved_tensors_hooks pair. The pack hook wraps every tensor autograd saves
(parameters excluded: they are model state, not activations) in a holder; the holder goes when autograd frees the
saved variable (after that node's backward, or with the graph), and its finalizer takes the storage's bytes off.
A storage counts once while any holder of it lives (a view and its base are one storage), so `live` is the bytes
of saved activations alive on this rank at any moment, whichever micro-batch and stage saved them, and `peak` its
maximum. Each forward of a stage module opens a chunk; `chunks_peak` is the most chunks holding saved tensors at
once (the micro-batches in flight, summed over this rank's stages).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from llm_anatomy.distributed.tp_saved import _local


def _storage(t: torch.Tensor):
    # a DTensor's: its local shard's, what the rank holds; a collective's output not yet waited on (an
    # AsyncCollectiveTensor, as recompute's checkpoints keep the embedding's reduce-scatter output): its buffer's
    return _local(t).untyped_storage()


def _key(t: torch.Tensor) -> int:
    return _storage(t)._cdata


class _Held:
    __slots__ = ("t", "key", "chunk", "owner")

    def __init__(self, owner: "SavedInFlight", t: torch.Tensor, key: int, chunk: int):
        self.owner, self.t, self.key, self.chunk = owner, t, key, chunk

    def __del__(self):
        self.owner._release(self.key, self.chunk)


class SavedInFlight:
    """with SavedInFlight(stage_modules) as s: schedule.step(...)   ->   s.peak, s.chunks_peak"""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.live = self.peak = self.chunks_peak = 0
        self._refs: Counter = Counter()
        self._bytes: dict[int, int] = {}
        self._chunk_refs: Counter = Counter()
        self._chunk = -1
        self._opened = 0

    def _param_keys(self) -> set[int]:
        # read at pack time: FSDP2 swaps a unit's sharded parameters for gathered ones around its forward
        return {_key(getattr(p, "_local_tensor", p)) for m in self.modules for p in m.parameters()}

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        key = _key(t)
        if key in self._param_keys():
            return t
        if self._refs[key] == 0:
            self._bytes[key] = _storage(t).nbytes()
            self.live += self._bytes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        self._chunk_refs[self._chunk] += 1
        self.chunks_peak = max(self.chunks_peak, len(self._chunk_refs))
        return _Held(self, t, key, self._chunk)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _release(self, key: int, chunk: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._bytes.pop(key)
            del self._refs[key]
        self._chunk_refs[chunk] -= 1
        if self._chunk_refs[chunk] == 0:
            del self._chunk_refs[chunk]

    def _open_chunk(self, *_):
        self._chunk, self._opened = self._opened, self._opened + 1

    def __enter__(self):
        self._handles = [m.register_forward_pre_hook(self._open_chunk) for m in self.modules]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return False
