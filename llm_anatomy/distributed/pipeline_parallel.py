"""Pipeline stages of a Transformer for torch.distributed.pipelining, optionally sharded with FSDP2 per stage.

A stage module holds some of the model's own modules, not copies: stage 0 the embedding, the last stage the
final norm and the head with its loss (the efficient variant's fused linear cross-entropy), every stage a run of
consecutive decoder Blocks (llm_anatomy.mesh_rules says which). Blocks keep their model names
(layers.<i>) in a ModuleDict, as torchtitan's pipeline split does, so a stage's state dict is a slice of the
model's. Each stage rebuilds the RoPE tables (and the baseline's causal bias) for its own forward, and the
efficient stage builds each kind of attention mask its layers use once per forward (efficient/attention_sinks.py
shared_masks, as the efficient model's forward).

The last stage's forward takes the targets as a keyword (the schedule hands a rank's step() keywords, split into
micro-batches, to every stage it runs) and returns the micro-batch's mean loss; the schedule's loss_fn passes it
on. Schedule1F1B and ScheduleInterleaved1F1B divide the summed gradients by the micro-batch count
(scale_grads), so equal micro-batches give the full batch's mean-loss gradient.

With dp > 1 every stage is fully_shard'ed on the mesh's "dp" dimension, Blocks first and then the stage
(embedding / norm / head), without resharding after forward: the pipeline runs several micro-batches through a
stage before their backwards, and the stage's parameters stay gathered until its last backward
(PipelineStage sets reshard_after_backward and gradient sync off until then), so each unit all-gathers and
reduce-scatters once per step.
"""
from __future__ import annotations

import torch
from torch import nn

from llm_anatomy.baseline.transformer import compute_dtype, rope_tables
from llm_anatomy.efficient.attention_sinks import shared_masks
from llm_anatomy.mesh_rules import check_schedule, rank_stages, stage_layers
from llm_anatomy.config import ConfigError


class StageModule(nn.Module):
    """Stage `index` of `stages`: the embedding on the first, norm + head + loss on the last."""

    seq_shards = 1  # tensor parallel's sequence shards: the stream between stages is (B, S / tp, H) on a rank

    def __init__(self, model: nn.Module, layers: list[int], index: int, stages: int):
        super().__init__()
        self.cfg, self.variant = model.cfg, model.variant
        self.first, self.last = index == 0, index == stages - 1
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.variant == "baseline":
            return self._forward(x, targets)
        with shared_masks():  # each kind of attention mask built once per stage forward, as the model's forward does
            return self._forward(x, targets)

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        S = x.shape[1] * (1 if self.first else self.seq_shards)  # the tables cover the whole sequence
        if self.first:
            x = self.embed(x)  # ids (B, S) -> (B, S, H)
        dev = x.device
        if self.variant == "baseline":
            dt = compute_dtype(x)
            cos, sin = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, dev, dt)
            extra = (torch.full((S, S), float("-inf"), device=dev, dtype=dt).triu(1),)
        else:  # the efficient Block's RoPE kernel reads fp32 tables
            cos, sin = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, dev, torch.float32)
            extra = ()
        for layer in self.layers.values():
            x = layer(x, cos, sin, *extra)
        if not self.last:
            return x
        return self.head(self.norm(x), targets)  # the micro-batch's mean loss


def check_model(model: nn.Module, pp: int) -> None:
    cfg = model.cfg
    if pp > 1 and cfg.tie_embeddings:
        raise ConfigError(f"{cfg.name} ties its embedding and head, which pipeline stages 0 and {pp - 1} would "
                          f"both hold; pipeline parallel runs untied models")
    if getattr(model, "lean", False):
        raise ConfigError("the efficient variant's lean block hands a pending branch across Blocks; "
                          "pipeline stages run it without lean")


def build_stages(model: nn.Module, pp: int, rank: int, *, virtual: int = 1, split=None) -> list[StageModule]:
    """The stage modules pipeline rank `rank` runs, in stage order (stage s on rank s % pp)."""
    check_model(model, pp)
    per_stage = stage_layers(model.cfg.layers, pp, virtual, split)
    n = len(per_stage)
    return [StageModule(model, per_stage[s], s, n) for s in rank_stages(pp, rank, virtual)]


def shard_stage(stage: StageModule, dp_mesh, *, param_dtype=None, reduce_dtype=None) -> StageModule:
    """FSDP2 on one stage over the dp mesh: each Block a unit, then the stage (its embedding / norm / head).
    param_dtype / reduce_dtype: 'float32', 'bfloat16' or None, the MixedPrecisionPolicy's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from llm_anatomy.distributed.strategies import _dtype, shard_placement

    mp = MixedPrecisionPolicy(param_dtype=_dtype(param_dtype, "param_dtype"),
                              reduce_dtype=_dtype(reduce_dtype, "reduce_dtype"))
    place = shard_placement(dp_mesh.size())
    for block in stage.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)
    return stage


def pipeline_stages(mods: list[StageModule], pp_rank: int, pp: int, mb_ids: torch.Tensor, hidden: int,
                    act_dtype: torch.dtype, pp_mesh, seq_shards: int = 1) -> list:
    """torch's PipelineStage for each of this rank's stage modules (stage pp_rank + v·pp), with the static shapes
    of one micro-batch: its ids (mb_ids) into the first stage, (mb, S / seq_shards, hidden) activations between
    stages (under tensor parallel each rank passes its sequence shard)."""
    from torch.distributed.pipelining import PipelineStage

    device = mb_ids.device
    mb, S = mb_ids.shape
    # requires_grad: the activations' gradients flow back
    act = torch.empty(mb, S // seq_shards, hidden, dtype=act_dtype, device=device, requires_grad=True)
    n_stages = pp * len(mods)
    return [PipelineStage(m, pp_rank + v * pp, n_stages, device, input_args=mb_ids if m.first else act,
                          output_args=torch.empty((), device=device) if m.last else act, group=pp_mesh.get_group())
            for v, m in enumerate(mods)]


def make_schedule(name: str, stages: list, microbatches: int):
    """torch's schedule for `name` over this rank's PipelineStages; the last stage's output is its loss."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    check_schedule(name, len(stages))
    loss_fn = _stage_loss
    if name == "1f1b":
        return Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)


def _stage_loss(loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return loss  # the last stage computed it (its head holds the loss)
