"""What each TP rank saves for backward, per component: the saved-tensor tracer on DTensor's local shards.

A DTensor autograd saves (a linear's all-gathered input, a norm's sequence shard, the vocab-sharded log-probs)
is counted by its local tensor's storage, which is what the rank holds; a collective's output not yet waited on
(an AsyncCollectiveTensor: DTensor's redistributions run async, and recompute's checkpoints keep their inputs as
handed over, the embedding's reduce-scatter output among them) by its buffer, which every wrapper of it shares.
Parameters, and under FSDP the unsharded parameters the modules hold during their forward, are model state and
are left out.
"""
from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from llm_anatomy.measure.components import ComponentTracker
from llm_anatomy.measure.saved import SavedTensorTracer, _key


def _local(t: torch.Tensor) -> torch.Tensor:
    t = getattr(t, "_local_tensor", t)
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


class LocalSavedTracer(SavedTensorTracer):
    """SavedTensorTracer for a tensor-parallel model: records each saved tensor's local shard."""

    def _pack(self, t: torch.Tensor):
        # the parameters of the moment: FSDP swaps unsharded ones in for each module's forward
        self._state = {_key(_local(p)) for p in self.model.parameters()}
        super()._pack(_local(t))
        return t  # autograd keeps what it saved, the DTensor itself

    def __enter__(self):
        self._tracker = ComponentTracker(self.model).__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self
