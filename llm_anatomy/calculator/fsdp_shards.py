"""FSDP2's shard of one parameter on one rank: which dim, how many elements it holds and allocates. Pure Python.

FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.13, _fsdp_param.py `_init_sharded_param`):
  1. every parameter is sharded on dim 0 with torch.chunk semantics: chunk = ceil(d0 / W) rows;
     rank r holds rows [r*chunk, min((r+1)*chunk, d0)), possibly none (d0 < W*chunk leaves the
     last ranks short or empty);
  2. each rank *allocates* the padded chunk, chunk x d1 x ..., whatever it holds ("pre-pad the
     sharded parameter to avoid padding before all-gather"); the nn.Parameter is a narrow view
     of that buffer. So parameter storage per rank = padded numel, the same on every rank;
  3. gradients: the reduce-scatter output is one flat buffer per FSDP unit, sum of the padded
     shards, in the parameter's (storage) dtype; each sharded grad is an as_strided view into
     it (_fsdp_collectives.py `foreach_reduce`). Gradient storage = padded numel, like params;
  4. optimizer state is built with zeros_like(param): the DTensor's local tensor is the
     *unpadded* shard, so AdamW state per rank = 8 B x the rows this rank really holds (rank 0
     holds the most), plus torch's 4-byte `step` tensor per parameter tensor;
  5. stacked experts (fsdp_shard_dim): a 3-D tensor with fewer rows on dim 0 than ranks, (E, 2I, H)
     or (E, H, I) with E < W, is Shard(1) when W divides its dim 1 (llm_anatomy/distributed/
     strategies.py shard_placement applies the same rule): FSDP2 takes only even non-zero-dim shards,
     so every rank holds and allocates E x dim1 / W x dim2, no padding; the all-gather and the
     reduce-scatter move the same W x shard elements as a dim-0 tensor would. Its layout costs two
     copies (_fsdp_collectives.py): the copy-out gathers into an empty_like temporary of each such
     tensor and torch.cat's its W chunks on dim 1 into the unsharded parameter (every temporary
     alive until the copy-out returns); before the reduce-scatter each such gradient is re-chunked
     on dim 0 into a new tensor (torch.cat), and the loop's `chunks` keeps the last one's original
     alive until the reduce-scatter returns.
"""
from __future__ import annotations

from math import prod

from llm_anatomy.calculator.param_layout import Shape


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(rows this rank holds, padded rows every rank allocates) for torch.chunk-style dim-0 sharding."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk)), chunk


def fsdp_shard_dim(shape: Shape, world: int) -> int:
    """The dim FSDP2 shards a parameter of `shape` on over `world` ranks: 1 for a 3-D tensor with fewer rows on
    dim 0 than ranks whose dim 1 `world` divides (stacked experts with E < world), else 0 (module docstring)."""
    return 1 if len(shape) == 3 and shape[0] < world and shape[1] % world == 0 else 0


def shard_numel(shape: Shape, world: int, rank: int) -> tuple[int, int]:
    """(local numel, padded numel) of one parameter's shard on `rank`: dim 0's torch.chunk rows, padded; on dim 1
    (fsdp_shard_dim) an even 1 / world of every expert."""
    if fsdp_shard_dim(shape, world):
        return prod(shape) // world, prod(shape) // world
    local, padded = shard_rows(shape[0], world, rank)
    rest = prod(shape[1:])
    return local * rest, padded * rest
