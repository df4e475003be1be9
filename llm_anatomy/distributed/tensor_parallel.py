"""Tensor parallel (with sequence parallel) on DTensor, composed with FSDP2 on a 2-D DeviceMesh ("dp", "tp").

The plan is torchtitan's parallelize_llama, on this project's module names:
  embed          RowwiseParallel: vocab-parallel (the table sharded on dim 0), replicated ids in, the residual
                 stream out sequence-sharded (Shard(1): a reduce-scatter of the partial embeddings)
  *_norm, norm   SequenceParallel: the norms run on the rank's S/tp rows, weights replicated
  attn, mlp      PrepareModuleInput: the sequence-sharded input all-gathered (Replicate) before the projections
  q, k, v        ColwiseParallel (heads split over tp; bias sharded with its rows)
  o              RowwiseParallel, output Shard(1): a reduce-scatter back to the sequence-sharded stream
  gate, up       ColwiseParallel;  down: RowwiseParallel, output Shard(1)
  head.lm_head   ColwiseParallel, input Shard(1) (all-gathered), output Shard(-1) as a DTensor: the logits stay
                 vocab-sharded and torch.distributed.tensor.parallel.loss_parallel() computes the cross-entropy
                 on the shards (its reductions are all-reduces over tp)
Each Attention module is told its local head counts (heads / tp, kv_heads / tp), as torchtitan does, since its
views read them. FSDP2 (fully_shard per Block, then the root) then shards each TP-local tensor on dim 0 over "dp".

gpt-oss's attention fields: the sinks, one logit per head, Shard(0) with the heads (shard_sinks); a sliding window's
additive (S, S) mask is built whole on every rank (the attention's input is all-gathered to the whole sequence);
o's bias is RowwiseParallel's Replicate, which DTensor adds once (bias / tp into each rank's partial sum).
parallelize_module distributes each module's parameters apart, so a tied head is tied again afterwards to the
embedding's DTensor (both are sharded on the vocab). Qwen3's per-head q/k norms get SequenceParallel on the heads dim
(their input is the rank's heads), so their weight gradients are Partial over tp like the other norms'.
The efficient variant runs the same plan on its fused modules (efficient_block_plan): qkv and gate_up
ColwiseParallel on rows permuted into rank order (distributed/tp_layout.py), so each rank's local output holds its
own heads' q, k, v (its own gate and up columns) and rope_qkv and swiglu_packed run unchanged on plain local
tensors; o and down RowwiseParallel; the fused RMSNorm ops SequenceParallel through their DTensor sharding rules
(distributed/tp_kernels.py). Its head is the vocab-parallel fused linear cross-entropy
(distributed/tp_head.py, kernels/linear_ce_tp.py): the same ColwiseParallel lm_head, whose Shard(0) rows the op
reads; the ranks combine each row's max, sum of exp and target logit with three fp32 all-reduces per chunk (the
ones loss_parallel makes for the baseline), and no rank makes more than a (C, V / tp) chunk of logits.
What the engine cannot shard is refused in one line (ConfigError, llm_anatomy.mesh_rules): widths not divisible
by tp, mixture of experts, OLMoE's whole q/k norm (its mean spans the heads tp splits), the efficient variant's
lean block, and context parallel on CPU (torch's context_parallel shards SDPA's CUDA kernels only).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from llm_anatomy.config import ConfigError, ModelConfig
from llm_anatomy.distributed import tp_kernels  # noqa: F401  (the fused norms' DTensor sharding rules)
from llm_anatomy.distributed.strategies import _dtype, shard_placement
from llm_anatomy.distributed.tp_head import use_vocab_parallel_head
from llm_anatomy.distributed.tp_layout import to_rank_order
from llm_anatomy.mesh_rules import check_efficient_tp, check_mesh

MESH_DIMS = ("dp", "tp")
_MESHES: dict = {}


def check_tp(cfg: ModelConfig, tp: int, dp: int = 1, *, variant: str = "baseline", cp: int = 1,
             device: str = "cpu") -> None:
    """ConfigError (one line) for a mesh this model cannot run on (llm_anatomy.mesh_rules: the calculator applies
    the same rule)."""
    check_mesh(cfg, tp, dp, variant=variant, cp=cp, device=device)


def build_mesh(dp: int, tp: int, device_type: str = "cpu"):
    """The 2-D DeviceMesh (dp, tp) over the default process group: tp is the inner (fastest-varying) dim, so the
    ranks of one TP group are neighbours, as on a node."""
    if not dist.is_initialized():
        raise ConfigError("no process group: launch with torchrun (or init_distributed()) before build_mesh()")
    world = dist.get_world_size()
    if dp * tp != world:
        raise ConfigError(f"dp x tp = {dp} x {tp} = {dp * tp} does not match the world size {world}")
    # one mesh per shape and process group: DTensor's sharding cache keys on the mesh's layout, so a second,
    # equal mesh would have its ops run on the first one's groups
    key = (device_type, dp, tp, dist.distributed_c10d._get_default_group())
    if key not in _MESHES:
        for k in [k for k in _MESHES if k[3] is not key[3]]:  # a new default group retires the old meshes
            del _MESHES[k]
        _MESHES[key] = init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)
    return _MESHES[key]


def tp_plan() -> dict:
    """The root's plan (embedding, final norm, head); each Block's is block_plan()."""
    return {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head.lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def block_plan(cfg: ModelConfig) -> dict:
    """One Block's plan, on module names inside the Block."""
    gather = dict(input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None))
    return {"attn_norm": SequenceParallel(), "attn": PrepareModuleInput(**gather),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1))} | (qk_norm_plan() if cfg.qk_norm else {})


def efficient_block_plan(cfg: ModelConfig, recompute: str = "none") -> dict:
    """One efficient Block's plan: its fused qkv and gate_up column-parallel (rows in rank order), o and down
    row-parallel, the fused norms sequence-parallel.

    recompute "mlp" hands attention and the MLP the residual stream, (B, S / tp, H) on each rank, and each runs its
    norm inside its checkpoint (efficient/attention.py, mlp.py): attention's input is only marked Shard(1) (a
    DTensor of the global shape, no collective), the MLP's is left local, and qkv's and gate_up's ColwiseParallel
    (input Shard(1)) all-gather the normed output inside the checkpoints, so backward's re-run gathers again.
    Under "full" the block's checkpoint holds the whole plan and re-runs it as the forward did."""
    gather = dict(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    plan = {"attn_norm": SequenceParallel(), "attn": PrepareModuleInput(**gather),
            "attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))}
    if recompute == "mlp":  # ColwiseParallel redistributes by its declared input layout, not the DTensor's own
        del plan["mlp"]
        plan |= {"attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Shard(1), None, None)),
                 "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
                 "mlp.gate_up": ColwiseParallel(input_layouts=Shard(1))}
    return plan | (qk_norm_plan() if cfg.qk_norm else {})


def qk_norm_plan() -> dict:
    """Qwen3's per-head q/k norms see the rank's heads, (B, S, heads / tp, hd): SequenceParallel on the heads dim
    replicates the weight and makes its gradient Partial over tp, as for the other norms."""
    return {"attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def shard_sinks(attn: nn.Module, tp_mesh) -> None:
    """gpt-oss's sinks, one logit per head, Shard(0) with the heads: rank r holds the sinks of the heads its q
    shard holds (ColwiseParallel's r-th row block; the efficient qkv's rank order keeps the same heads), and the
    attention reads its local tensor, whose gradient is Shard(0) too: no collective."""
    if getattr(attn, "sinks", None) is not None:
        attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))


def apply_tp(model: nn.Module, tp_mesh, *, one_rank: bool = False) -> nn.Module:
    """TP + SP on the 1-D tp mesh (in place): the root's plan, then each Block's (the pipeline's stages reuse it).
    A mesh of one rank is left alone unless one_rank=True, which applies the plan there too (DTensor's code path
    with no peer: validations/test_mesh_cuda.py runs it on one GPU)."""
    tp, cfg = tp_mesh.size(), model.cfg
    if tp > 1 or one_rank:
        efficient = getattr(model, "variant", "baseline") == "efficient"
        if efficient:  # each rank's fused rows in rank order
            check_efficient_tp(tp, model.lean)
            to_rank_order(model, tp)
        parallelize_module(model, tp_mesh, tp_plan())
        if cfg.tie_embeddings:  # both are Shard(0) over the vocab: the head takes the embedding's DTensor again
            model.head.lm_head.weight = model.embed.weight
        if efficient:  # the fused linear cross-entropy on the rank's vocabulary rows (distributed/tp_head.py)
            use_vocab_parallel_head(model, tp_mesh)
        for block in model.layers:
            plan = efficient_block_plan(cfg, model.recompute) if efficient else block_plan(cfg)
            parallelize_module(block, tp_mesh, plan)
            block.attn.heads, block.attn.kv_heads = cfg.heads // tp, cfg.kv_heads // tp
            shard_sinks(block.attn, tp_mesh)
    return model


def parallelize(model: nn.Module, mesh, *, param_dtype=None, reduce_dtype=None,
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply TP + SP on mesh["tp"], then FSDP2 on mesh["dp"] when it has more than one rank (in place).

    param_dtype / reduce_dtype: FSDP2's MixedPrecisionPolicy (as distributed.strategies.wrap)."""
    check_tp(model.cfg, mesh["tp"].size(), mesh["dp"].size(), variant=getattr(model, "variant", "baseline"))
    apply_tp(model, mesh["tp"])
    if mesh["dp"].size() > 1:
        mp = MixedPrecisionPolicy(param_dtype=_dtype(param_dtype, "param_dtype"),
                                  reduce_dtype=_dtype(reduce_dtype, "reduce_dtype"))
        place = shard_placement(mesh["dp"].size())
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=place)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)
    return model


def loss_context(tp: int):
    """The context forward and backward run in: loss_parallel() under TP (the baseline's logits are vocab-sharded;
    the efficient head makes no DTensor logits, and runs the same under it)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def full_loss(loss: torch.Tensor) -> float:
    """The loss as a number: a DTensor's full value (replicated over tp), else the tensor's."""
    full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return float(full.detach().float())
