"""`anatomy train --tp N` and `--pp N`: the run on a DeviceMesh, each composed with FSDP2 over the remaining ranks.

    --tp N   tensor + sequence parallel (llm_anatomy.distributed.tensor_parallel): a (dp, tp) mesh, dp = world / tp;
             the TP ranks of one dp group read the same batch; the loss and its backward run under loss_parallel
    --pp N   pipeline parallel (llm_anatomy.distributed.pipeline_parallel): a (pp, dp) mesh, dp = world / pp;
             torch's Schedule1F1B (--pp-schedule 1f1b) or ScheduleInterleaved1F1B (interleaved-1f1b, two stages
             per rank) runs --microbatches micro-batches per step (default pp); the last stage's ranks hold the loss
    both     tensor parallel inside each pipeline stage (llm_anatomy.distributed.pipeline_tp): a (pp, dp, tp) mesh,
             dp = world / (pp x tp); the schedule runs under loss_parallel; either variant (the efficient
             one without its lean block: its fused head vocab-parallel on the last stage)

Gradient clipping: under TP every parameter is a DTensor and torch.nn.utils.clip_grad_norm_ reduces their norms
itself. A pipeline rank holds only its stages' gradients, so the norm combines the stages as torchtitan does:
torch.nn.utils.get_total_norm on the rank's gradients, the squares summed over the "pp" group, then
torch.nn.utils.clip_grads_with_norm_ with that total.

Checkpoints on a mesh keep each rank's own tensors (llm_anatomy.train.checkpoint, "per-rank" shards): a resume
needs the same layout, and another one is refused in one line (layout()).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.train.options import TrainOptions


def _virtual(o: TrainOptions) -> int:
    return 2 if o.pp_schedule == "interleaved-1f1b" else 1


def layout(o: TrainOptions, world: int) -> str | None:
    """The mesh a checkpoint's per-rank shards belong to (None: no mesh; shards any world size can read)."""
    if o.tp > 1 and o.pp > 1:
        return (f"pp {o.pp} ({o.pp_schedule}, {_virtual(o)} stage(s) per rank) x dp {world // (o.pp * o.tp)} "
                f"x tp {o.tp}")
    if o.tp > 1:
        return f"tp {o.tp} x dp {world // o.tp}"
    if o.pp > 1:
        return f"pp {o.pp} ({o.pp_schedule}, {_virtual(o)} stage(s) per rank) x dp {world // o.pp}"
    return None


def check(cfg: ModelConfig, run: Run, variant: str, o: TrainOptions, world: int) -> None:
    """ConfigError (one line) for a mesh this run cannot take; runs before any process group exists."""
    if o.pp == 1 and (o.microbatches is not None or o.pp_schedule != "1f1b"):
        raise ConfigError("--pp-schedule and --microbatches shape a pipeline: they need --pp N > 1")
    if o.tp == 1 and o.pp == 1:
        return
    if o.strategy not in ("auto", "fsdp"):
        raise ConfigError(f"--tp/--pp compose with FSDP2 over the remaining ranks: --strategy must be auto or "
                          f"fsdp, got {o.strategy}")
    flags = [f"{f} {k}" for f, k in (("--pp", o.pp), ("--tp", o.tp)) if k > 1]
    n = o.tp * o.pp
    if world % n:
        hint = " (launch with torchrun --nproc_per_node N)" if world == 1 else ""
        what = flags[0] if len(flags) == 1 else f"{' x '.join(flags)} = {n} ranks"
        raise ConfigError(f"{what} does not divide the world size {world}{hint}")
    dp = world // n
    from llm_anatomy.mesh_rules import check_pipeline, check_run

    if o.tp > 1:
        from llm_anatomy.distributed.tensor_parallel import check_tp

        check_tp(cfg, o.tp, dp, variant=variant)
    check_run(run, o.tp, dp, variant)  # sequence parallel splits seq over tp; amp is FSDP's policy: it needs dp > 1
    if o.pp == 1:
        return
    check_pipeline(cfg, run, o.pp, dp, o.pp_schedule, o.microbatches or o.pp, _virtual(o), None)
    if variant != "baseline" and run.lean_block:
        raise ConfigError("the efficient variant's lean block hands a pending branch across Blocks: pipeline "
                          "stages run it without lean (--no-lean)")


def build_tp(model: nn.Module, o: TrainOptions, run: Run, device: torch.device) -> nn.Module:
    """The model tensor parallel over (world / tp, tp), FSDP2 over dp when dp > 1 (in place)."""
    from llm_anatomy.distributed.strategies import default_mixed_precision
    from llm_anatomy.distributed.tensor_parallel import build_mesh, parallelize

    dp = dist.get_world_size() // o.tp
    mesh = build_mesh(dp, o.tp, device.type)
    pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
    return parallelize(model, mesh, param_dtype=pd, reduce_dtype=rd)


def dp_coordinates(o: TrainOptions) -> tuple[int, int]:
    """(this rank's dp index, dp size) on the run's mesh (pp, dp, tp): tp the inner dim, pp the outer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // (o.pp * o.tp)
    return (rank // o.tp) % dp, dp


class Pipelined(nn.ModuleList):
    """This rank's stage modules, in stage order, and the schedule that runs them (forward and backward)."""

    def __init__(self, model: nn.Module, o: TrainOptions, run: Run, device: torch.device):
        from llm_anatomy.distributed.pipeline_parallel import make_schedule, pipeline_stages
        from llm_anatomy.distributed.pipeline_tp import build_pp_mesh, tp_stages
        from llm_anatomy.distributed.strategies import default_mixed_precision

        dp = dist.get_world_size() // (o.pp * o.tp)
        mesh = build_pp_mesh(o.pp, dp, o.tp, device.type)
        pp_rank = mesh["pp"].get_local_rank()
        act = torch.bfloat16 if run.dtype in ("bf16", "amp") else next(model.parameters()).dtype
        pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
        mods = tp_stages(model, mesh, virtual=_virtual(o), param_dtype=pd, reduce_dtype=rd)
        super().__init__(mods)
        self.microbatches, self.tp = o.microbatches or o.pp, o.tp
        self.reports_loss = mesh["tp"].get_local_rank() == 0  # one copy of the loss per pipeline (loss_ranks)
        mb_ids = torch.zeros(run.batch // self.microbatches, run.seq, dtype=torch.long, device=device)
        self._schedule = make_schedule(o.pp_schedule, pipeline_stages(mods, pp_rank, o.pp, mb_ids, model.cfg.hidden,
                                                                       act, mesh["pp"], o.tp), self.microbatches)
        self._pp_group = mesh["pp"].get_group()
        n = torch.tensor([sum(p.numel() for p in self.parameters())], dtype=torch.int64, device=device)
        dist.all_reduce(n, group=self._pp_group)  # every stage once (a DTensor counts its dp shards' whole)
        self.n_params = int(n.item())
        self.first, self.last = any(m.first for m in mods), any(m.last for m in mods)

    def run_schedule(self, x: torch.Tensor, y: torch.Tensor, *, backward: bool) -> torch.Tensor:
        """One step of the schedule on the batch (x, y): the batch's mean loss on the last stage's ranks (the mean
        of its equal micro-batches' means), 0 elsewhere. backward=False runs the forwards only (eval)."""
        from llm_anatomy.distributed.pipeline_step import local_loss
        from llm_anatomy.distributed.tensor_parallel import loss_context

        losses: list[torch.Tensor] = []
        kw = dict(targets=y, target=y, losses=losses) if self.last else {}
        run = self._schedule.step if backward else self._schedule.eval
        with loss_context(self.tp):  # the last stage's loss and its backward: loss_parallel under TP
            run(*((x,) if self.first else ()), return_outputs=False, **kw)
        if not (self.last and self.reports_loss):
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([local_loss(t).detach().double() for t in losses]).mean()

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The gradient norm over every stage (each rank's norm squared, summed over "pp"), and the clip by it."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2's dp shards
            norm = norm.full_tensor()
        sq = norm.detach().double().pow(2).reshape(1)
        dist.all_reduce(sq, group=self._pp_group)
        total = sq.sqrt()[0].to(norm.dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def forward(self, *_):
        raise RuntimeError("a pipeline rank's stages run through its schedule (run_schedule), not forward()")
