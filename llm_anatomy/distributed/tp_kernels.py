"""DTensor sharding rules for the efficient model's fused RMSNorm ops, so that SequenceParallel runs them as it runs
the baseline's aten norm: torch's own DTensor dispatch (torch.distributed.tensor.experimental.register_sharding),
the kernels unchanged on each rank's local rows.

    anatomy::rms_norm(x, weight, eps, out_dtype) -> y
        x sharded on any dim but the normalised (last) one, weight Replicate -> y sharded like x; or all Replicate
    anatomy::rms_norm_backward(dy, x, weight, eps) -> (dx, dweight)
        dy and x sharded alike, weight Replicate -> dx sharded like x, dweight Partial (each rank sums its rows)

The other fused ops of the block (rope_qkv, swiglu_packed) read the outputs of the column-parallel qkv and gate_up,
which the plan hands on as plain local tensors (use_local_output): they need no rule. Registering is idempotent and
happens on import.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import llm_anatomy.kernels  # noqa: F401  (defines the anatomy:: ops)


def _row_dims(x) -> range:
    return range(len(x.shape) - 1)  # every dim but the normalised one


@register_sharding(torch.ops.anatomy.rms_norm.default)
def _rms_norm_sharding(x, weight, eps, out_dtype=None):
    out = [([Replicate()], [Replicate(), Replicate(), None, None])]
    return out + [([Shard(d)], [Shard(d), Replicate(), None, None]) for d in _row_dims(x)]


@register_sharding(torch.ops.anatomy.rms_norm_backward.default)
def _rms_norm_backward_sharding(dy, x, weight, eps):
    out = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None])]
    return out + [([Shard(d), Partial()], [Shard(d), Shard(d), Replicate(), None]) for d in _row_dims(x)]
