"""Train a few pipeline-parallel steps (x FSDP2 over dp) and report, per step and rank, what the rank did and held.

    torchrun --nproc_per_node 2 -m llm_anatomy.distributed.pipeline_step --pp 2 --schedule 1f1b \\
        --hidden 64 --layers 4 --heads 4 --intermediate 96 --vocab 256 --batch 4 --seq 32 --microbatches 4 --dtype fp32

The world is a DeviceMesh ("pp", "dp", "tp"), pp x dp x tp ranks (distributed/pipeline_tp.build_pp_mesh): every dp
rank of a pipeline column runs its own data; the pipeline ranks of a column pass activations forward and their
gradients back through torch.distributed.pipelining (PipelineStage, Schedule1F1B or ScheduleInterleaved1F1B); with
--tp > 1 each stage is tensor parallel over its tp group (the sequence shard passes between stages), and with
dp > 1 each stage is FSDP2-sharded over its dp row (llm_anatomy/distributed/pipeline_parallel.py, pipeline_tp.py).

A record per step: step, loss (the rank holding the last stage: the mean of its micro-batch losses, the batch's
mean loss; None elsewhere), collectives [[op, dtype, bytes, calls], ...] (every send, recv and FSDP collective of
the step, CollectiveCounter), memory {params, grads, optimizer} after the optimizer step (local storage),
saved_peak (the most bytes of saved activations alive at once on the rank, SavedInFlight) and chunks_peak (the
most stage forwards holding saved tensors at once). `spawn()` runs train_pp() in local gloo processes for tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from llm_anatomy.mesh_rules import SCHEDULES, check_mesh, check_pipeline, check_run
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.counting import CollectiveCounter, rank_memory
from llm_anatomy.distributed.pipeline_parallel import make_schedule, pipeline_stages
from llm_anatomy.distributed.pipeline_tp import MESH_DIMS, build_pp_mesh, tp_stages
from llm_anatomy.distributed.saved_in_flight import SavedInFlight
from llm_anatomy.distributed.strategies import default_mixed_precision, exit_rank
from llm_anatomy.distributed.tensor_parallel import loss_context
from llm_anatomy.distributed.train_step import (SPAWN_TIMEOUT_S, _config, _Parser, add_run_arguments, init_launched,
                                              make_optimizer)
from llm_anatomy.io import write_atomic
from llm_anatomy.models import VARIANTS, build_model, make_batch


def train_pp(cfg: ModelConfig, run: Run, *, pp: int, dp: int = 1, tp: int = 1, schedule: str = "1f1b",
             microbatches: int = 2, virtual: int = 1, split=None, variant: str = "baseline", steps: int = 2,
             optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0) -> list[dict]:
    """`steps` pipeline steps on the initialized process group of pp x dp x tp ranks; this rank's records."""
    check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    if dist.get_world_size() != pp * dp * tp:
        raise ConfigError(f"pp x dp x tp = {pp * dp * tp} ranks, but the job has {dist.get_world_size()}")
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = build_pp_mesh(pp, dp, tp, device.type)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = build_model(cfg, variant, device=device, dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                        seed=seed, recompute=run.recompute)  # the same weights on every rank
    pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
    mods = tp_stages(model, mesh, virtual=virtual, split=split, param_dtype=pd, reduce_dtype=rd)
    ids, targets = make_batch(cfg, run, device, seed=seed + 1 + dp_rank)  # each dp rank its own data
    act = torch.bfloat16 if run.dtype in ("bf16", "amp") else torch.float32
    stages = pipeline_stages(mods, pp_rank, pp, ids[:run.batch // microbatches], cfg.hidden, act, mesh["pp"], tp)
    sched = make_schedule(schedule, stages, microbatches)
    opt = make_optimizer(optimizer, torch.nn.ModuleList(mods).parameters(), lr)
    return pp_steps(sched, mods, opt, ids, targets, mesh, steps)


def pp_steps(sched, mods: list, opt, ids: torch.Tensor, targets: torch.Tensor, mesh, steps: int, *,
             with_loss: bool = True) -> list[dict]:
    """`steps` steps of the schedule over this rank's stage modules, each recorded (the module docstring's
    fields, and by_dim: [[mesh dim, op, dtype, bytes, calls], ...]). with_loss=False for fake tensors, whose loss
    has no value to read."""
    holder = torch.nn.ModuleList(mods)
    first, last = any(m.first for m in mods), any(m.last for m in mods)
    names = {mesh.get_group(d).group_name: d for d in MESH_DIMS}
    tp = mesh["tp"].size()
    records = []
    for step in range(1, steps + 1):
        losses: list[torch.Tensor] = []
        kw = dict(targets=targets, target=targets, losses=losses) if last else {}
        with CollectiveCounter() as counter, SavedInFlight(mods) as saved, loss_context(tp):
            sched.step(*((ids,) if first else ()), return_outputs=False, **kw)
            opt.step()
        mem = rank_memory(holder, opt)
        opt.zero_grad(set_to_none=True)
        rec = dict(step=step, memory=mem, collectives=[[*k, n] for k, n in sorted(counter.counts().items())],
                   by_dim=[[*k, n] for k, n in sorted(counter.counts_by_group(names).items())],
                   saved_peak=saved.peak, chunks_peak=saved.chunks_peak, pp_rank=mesh["pp"].get_local_rank(),
                   dp_rank=mesh["dp"].get_local_rank(), tp_rank=mesh["tp"].get_local_rank(), loss=None)
        if last and with_loss:
            rec["loss"] = float(torch.stack([local_loss(x) for x in losses]).detach().float().mean())
        records.append(rec)
    return records


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as a plain tensor: under loss_parallel a DTensor replicated over tp."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def spawn(world: int, scenarios: list[dict], *, timeout_s: float = SPAWN_TIMEOUT_S) -> list[list[list[dict]]]:
    """Each scenario (keyword arguments of train_pp(), pp x dp = world) on `world` local gloo processes:
    results[rank][scenario] = that rank's step records."""
    from llm_anatomy.distributed import train_step

    return train_step.spawn(world, scenarios, timeout_s=timeout_s, fn=train_pp)


# ---- CLI (torchrun) ---------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m llm_anatomy.distributed.pipeline_step", description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks (stages: pp x virtual)")
    p.add_argument("--dp", type=int, help="FSDP2 ranks per stage (default: world size / (pp x tp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside each stage")
    p.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    # not --virtual: torchrun's own parser takes it for an abbreviation of its --virtual-local-rank
    p.add_argument("--stages-per-rank", type=int, help="interleaved-1f1b's stages per rank (default 2; 1f1b: 1)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: pp); --batch must divide")
    p.add_argument("--split", help="layers per stage, comma-separated (default: balanced)")
    p.add_argument("--variant", default="baseline", help=", ".join(VARIANTS))
    add_run_arguments(p)
    return p


def _split(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"split must be layer counts separated by commas, got {text!r}") from None


@record  # a failing rank writes its traceback to torchrun's error file
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        cfg, run = _config(a), Run(batch=a.batch, seq=a.seq, dtype=a.dtype)
        virtual = a.stages_per_rank or (1 if a.schedule == "1f1b" else 2)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = a.dp or max(1, world // (a.pp * max(a.tp, 1)))
        kw = dict(pp=a.pp, dp=dp, tp=a.tp, schedule=a.schedule, microbatches=a.microbatches or a.pp,
                  virtual=virtual, split=_split(a.split), variant=a.variant, steps=a.steps, optimizer=a.optimizer,
                  lr=a.lr, seed=a.seed)
        check_pipeline(cfg, run, a.pp, dp, a.schedule, kw["microbatches"], virtual, kw["split"])
        check_mesh(cfg, a.tp, dp, variant=a.variant)
        check_run(run, a.tp, dp, a.variant)
        if a.pp * dp * a.tp != world:
            dims = "pp x dp" + (" x tp" if a.tp > 1 else "")
            raise ConfigError(f"{dims} = {a.pp * dp * a.tp} ranks, but the job has {world} (torchrun --nproc_per_node)")
        init_launched(a.backend, a.timeout_s)
    except ConfigError as e:
        print(f"pipeline_step: error: {e}", file=sys.stderr)
        return 2
    rank = dist.get_rank()
    try:
        recs = train_pp(cfg, run, **kw)
    except ConfigError as e:
        dist.destroy_process_group()
        print(f"pipeline_step: error: {e}", file=sys.stderr)
        return 2
    for rec in recs:
        if rec["loss"] is not None and rec["dp_rank"] == rec["tp_rank"] == 0:  # the first pipeline's last stage
            sends = sum(c[3] for c in rec["collectives"] if c[0] in ("send", "recv"))
            print(f"step {rec['step']}  loss {rec['loss']:.4f}  sends+recvs {sends}  saved at peak "
                  f"{rec['saved_peak'] / 2**20:.2f} MiB ({rec['chunks_peak']} chunks)", flush=True)
    if a.report:  # one file per rank: no extra collective at the end of the job
        out = Path(a.report)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / f"rank{rank}.json", json.dumps(dict(world_size=dist.get_world_size(), rank=rank,
                                                               config=cfg.to_dict(), steps=recs, **{
                                                                   k: kw[k] for k in ("pp", "dp", "tp", "schedule",
                                                                                      "microbatches", "virtual",
                                                                                      "split", "variant")}),
                                                          indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())
