"""Train a few steps on a (dp, tp) mesh — tensor + sequence parallel, FSDP2 over dp — and report, per step and rank,
the loss, every collective with the mesh dim it ran on, and the rank's bytes.

    torchrun --nproc_per_node 4 -m llm_anatomy.distributed.mesh_step --tp 2 --hidden 64 --layers 2 --heads 4 \\
        --intermediate 96 --vocab 256 --batch 2 --seq 32 --dtype fp32

The world is dp x tp (dp = world / tp). Rank 0 prints one line per step; --report DIR has every rank write its
records to DIR/rank<N>.json. `train()` is the loop for library use; train_step.spawn_named(..., fn=train) runs it in
local gloo processes (the validation suite does).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.counting import CollectiveCounter, rank_memory
from llm_anatomy.distributed.strategies import default_mixed_precision, exit_rank
from llm_anatomy.distributed.tensor_parallel import (MESH_DIMS, build_mesh, check_tp, full_loss, loss_context,
                                                     parallelize)
from llm_anatomy.distributed.tp_saved import LocalSavedTracer
from llm_anatomy.distributed.train_step import _config, _Parser, add_run_arguments, init_launched, make_optimizer
from llm_anatomy.io import write_atomic
from llm_anatomy.mesh_rules import check_run
from llm_anatomy.models import build_model, make_batch


def train(cfg: ModelConfig, run: Run, tp: int, *, steps: int = 3, optimizer: str = "adamw", lr: float = 1e-3,
          param_dtype="auto", reduce_dtype="auto", reshard_after_forward: bool = True, seed: int = 0,
          trace_saved: bool = True, on_step=None, variant: str = "baseline") -> list[dict]:
    """`steps` steps on the initialized process group as a (world / tp, tp) mesh; one record per step (this rank's
    view): step, loss (this dp rank's batch, the full value), collectives [[mesh dim, op, dtype, bytes, calls], ...]
    of forward + backward + optimizer step, memory {params, grads, optimizer} after the step (local storage), and
    in step 1 with trace_saved, saved {component: bytes} that the forward kept for backward on this rank.
    variant: "baseline" or "efficient" (without its lean block: distributed/tensor_parallel.py)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    world = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        raise ConfigError(f"tp must be a positive divisor of the world size {world}, got {tp!r}")
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = build_mesh(world // tp, tp, device.type)
    check_run(run, tp, world // tp, variant)
    pd, rd = default_mixed_precision(run) if mesh["dp"].size() > 1 else (None, None)
    # the same weights on every rank; parallelize keeps this rank's shards
    model = build_model(cfg, variant, device=device, dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                        seed=seed, recompute=run.recompute)
    parallelize(model, mesh, param_dtype=pd if param_dtype == "auto" else param_dtype,
                reduce_dtype=rd if reduce_dtype == "auto" else reduce_dtype,
                reshard_after_forward=reshard_after_forward)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    # the ranks of one TP group read the same batch; each dp rank its own
    ids, targets = make_batch(cfg, run, device, seed=seed + 1 + mesh["dp"].get_local_rank())
    return _steps(model, opt, ids, targets, mesh, steps, trace_saved=trace_saved, on_step=on_step)


def _steps(model, opt, ids, targets, mesh, steps: int, *, trace_saved: bool = False, with_loss: bool = True,
           on_step=None) -> list[dict]:
    """`steps` training steps, each with the collectives by mesh dim and this rank's bytes. with_loss=False for fake
    tensors (the simulation), whose loss has no value to read."""
    tp = mesh["tp"].size()
    names = {mesh.get_group(d).group_name: d for d in MESH_DIMS}
    records = []
    for step in range(1, steps + 1):
        with CollectiveCounter() as counter:
            with loss_context(tp):  # loss_parallel must cover the backward too
                with LocalSavedTracer(model) if step == 1 and trace_saved else contextlib.nullcontext() as tr:
                    loss = model(ids, targets)
                loss.backward()
            opt.step()
        mem = rank_memory(model, opt)
        opt.zero_grad(set_to_none=True)
        rec = dict(step=step, memory=mem,
                   collectives=[[*k, n] for k, n in sorted(counter.counts_by_group(names).items())])
        if with_loss:
            rec["loss"] = full_loss(loss)
        if tr is not None:
            rec["saved"] = tr.report.by_component()  # storage bytes this rank saved for backward
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


def simulate(cfg: ModelConfig, run: Run, tp: int, dp: int, *, rank: int = 0, steps: int = 1,
             optimizer: str = "adamw", variant: str = "baseline") -> list[dict]:
    """Rank `rank`'s view of `steps` steps on a (dp, tp) mesh of dp x tp ranks, in this process: the fake process
    group (distributed.simulate) and fake tensors, so TP and FSDP2 run their own code at any size with no data.
    Records as train()'s, without the loss."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llm_anatomy.distributed.simulate import fake_process_group

    check_tp(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    if not 0 <= rank < tp * dp:
        raise ConfigError(f"rank must be in [0, {tp * dp}), got {rank!r}")
    with fake_process_group(tp * dp, rank):
        mesh = build_mesh(dp, tp)
        pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
        model = build_model(cfg, variant, device="meta", dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                            seed=None, recompute=run.recompute)
        parallelize(model, mesh, param_dtype=pd, reduce_dtype=rd)  # shards meta tensors: cheap at any size
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            ids = torch.zeros(run.batch, run.seq, dtype=torch.long)
            targets = torch.zeros(run.batch, run.seq, dtype=torch.long)
            opt = make_optimizer(optimizer, model.parameters(), 1e-3)
            return _steps(model, opt, ids, targets, mesh, steps, with_loss=False)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m llm_anatomy.distributed.mesh_step", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree (divides the world size)")
    add_run_arguments(p)
    p.set_defaults(dtype="fp32")  # amp is FSDP's policy: it needs dp > 1
    return p


@record
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        cfg, run = _config(a), Run(batch=a.batch, seq=a.seq, dtype=a.dtype)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if a.tp < 1 or world % a.tp:
            raise ConfigError(f"--tp {a.tp} must be a positive divisor of the world size {world}")
        check_tp(cfg, a.tp, world // a.tp)
        check_run(run, a.tp, world // a.tp)
        init_launched(a.backend, a.timeout_s)
    except ConfigError as e:
        print(f"mesh_step: error: {e}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()

    def show(rec):
        if rank == 0:
            n = sum(c[4] for c in rec["collectives"])
            m = rec["memory"]
            print(f"step {rec['step']}  loss {rec['loss']:.4f}  collectives {n}  rank 0 holds params "
                  f"{m['params'] / 2**20:.2f} MiB, grads {m['grads'] / 2**20:.2f} MiB, "
                  f"optimizer {m['optimizer'] / 2**20:.2f} MiB", flush=True)

    try:
        recs = train(cfg, run, a.tp, steps=a.steps, optimizer=a.optimizer, lr=a.lr, seed=a.seed, on_step=show)
    except ConfigError as e:
        dist.destroy_process_group()
        print(f"mesh_step: error: {e}", file=sys.stderr)
        return 2
    if a.report:  # one file per rank: no extra collective at the end of the job
        report = dict(tp=a.tp, dp=world // a.tp, rank=rank, config=cfg.to_dict(), run=run.to_dict(), steps=recs)
        Path(a.report).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(a.report) / f"rank{rank}.json", json.dumps(report, indent=1))
    dist.destroy_process_group()  # the clean path only: see train_step.main
    return 0

if __name__ == "__main__":
    exit_rank(main())
