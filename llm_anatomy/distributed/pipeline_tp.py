"""Tensor parallel inside pipeline stages, FSDP2 over dp: the 3-D DeviceMesh ("pp", "dp", "tp").

tp is the inner (fastest-varying) dim, so the ranks of one TP group are neighbours, as on a node; dp next; pp the
outer. Each rank builds the whole model with the same weights, tensor-parallelises it over its tp sub-mesh with
the plan of TP alone (distributed/tensor_parallel.apply_tp: vocab-parallel embedding, column/row-wise projections,
sequence-parallel norms, the head's vocab-sharded logits for loss_parallel), then keeps its pipeline stages
(distributed/pipeline_parallel.build_stages: the model's own, now DTensor, modules) and FSDP2-shards each over dp.

The efficient variant (without its lean block, which pipeline stages and tp both refuse) takes the same road:
apply_tp on the whole model puts its fused qkv and gate_up rows in rank order (distributed/tp_layout.py) and
parallelizes them with efficient_block_plan, and swaps its head for the vocab-parallel fused linear cross-entropy
(distributed/tp_head.py) before the stages are cut, so the last stage holds that head and every stage the fused
Blocks; each stage builds its fp32 RoPE tables for the whole sequence (the attention's all-gathered input) and
its masks once per forward (pipeline_parallel.StageModule).

Between stages the residual stream is the rank's sequence shard, (micro-batch, S / tp, hidden): every Block's
output and the embedding's are the plan's Shard(1) stream, handed over as the local tensor, so each TP rank of a
stage sends its shard to the same TP rank of the next stage. The last stage's loss and its backward run under
loss_parallel (loss_context), which the caller wraps around the schedule's step (the efficient head makes no
DTensor logits and runs the same under it).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from llm_anatomy.config import ConfigError
from llm_anatomy.distributed.pipeline_parallel import StageModule, build_stages, shard_stage
from llm_anatomy.distributed.tensor_parallel import apply_tp

MESH_DIMS = ("pp", "dp", "tp")
_MESHES: dict = {}


def build_pp_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu"):
    """The ("pp", "dp", "tp") DeviceMesh over the default process group, one per shape and group (DTensor's
    sharding cache keys on a mesh's layout: an equal second mesh would run its ops on the first one's groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise ConfigError(f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp} does not match the world size {world}")
    group = dist.distributed_c10d._get_default_group()
    for k in [k for k, (g, _) in _MESHES.items() if g is not group]:  # a new default group retires the old meshes
        del _MESHES[k]
    key = (device_type, pp, dp, tp)
    if key not in _MESHES:
        _MESHES[key] = (group, init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS))
    return _MESHES[key][1]


def tp_stages(model: nn.Module, mesh, *, virtual: int = 1, split=None, param_dtype=None,
              reduce_dtype=None) -> list[StageModule]:
    """This rank's stage modules: the model tensor-parallel over mesh["tp"], cut into the pipeline's stages,
    each FSDP2-sharded over mesh["dp"] when it has more than one rank."""
    tp, dp, pp = mesh["tp"].size(), mesh["dp"].size(), mesh["pp"].size()
    apply_tp(model, mesh["tp"])
    mods = build_stages(model, pp, mesh["pp"].get_local_rank(), virtual=virtual, split=split)
    for m in mods:
        m.seq_shards = tp
    if dp > 1:
        mods = [shard_stage(m, mesh["dp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype) for m in mods]
    return mods
