"""Train a few data-parallel steps and report, per step, the loss, every collective and each rank's bytes.

    torchrun --nproc_per_node 2 -m llm_anatomy.distributed.train_step --strategy fsdp --preset seed --steps 3
    torchrun --nproc_per_node 2 -m llm_anatomy.distributed.train_step --strategy ddp --hidden 64 --layers 2 \\
        --heads 4 --intermediate 96 --vocab 256 --batch 2 --seq 32

Gloo on CPU, NCCL with GPUs (--backend auto). Rank 0 prints one line per step; --report DIR has every
rank write its records to DIR/rank<N>.json. `train()` is the same loop for library use; `spawn()` runs it in local
processes (the validation suite uses it, so the measured numbers come from the same code path).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.counting import CollectiveCounter, rank_memory
from llm_anatomy.distributed.strategies import (check_strategy, default_mixed_precision, exit_rank, init_distributed,
                                            wrap)
from llm_anatomy.io import write_atomic
from llm_anatomy.models import autocast_ctx, build_model, make_batch

OPTIMIZERS = ("adamw", "ademamix", "sgd")


def make_optimizer(name: str, params, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "ademamix":
        from llm_anatomy.optim import AdEMAMix

        return AdEMAMix(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ConfigError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def train(cfg: ModelConfig, run: Run, strategy: str, *, steps: int = 3, optimizer: str = "adamw", lr: float = 1e-3,
          param_dtype="auto", reduce_dtype="auto", reshard_after_forward: bool = True,
          bucket_cap_mb: float | None = None, seed: int = 0, on_step=None) -> list[dict]:
    """Run `steps` steps on the initialized process group; one record per step (this rank's view).

    A record: step, loss (this rank's batch), collectives [[op, dtype, bytes, calls], ...] issued by
    forward + backward + optimizer step, and memory {params, grads, optimizer} after the optimizer
    step (before zero_grad), in bytes of local storage."""
    check_strategy(strategy)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    rank = dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    opts = dict(bucket_cap_mb=bucket_cap_mb) if strategy == "ddp" else {}
    if strategy == "fsdp":
        pd, rd = default_mixed_precision(run)
        opts.update(param_dtype=pd if param_dtype == "auto" else param_dtype,
                    reduce_dtype=rd if reduce_dtype == "auto" else reduce_dtype,
                    reshard_after_forward=reshard_after_forward)
    elif cuda:
        opts["device_ids"] = [device.index]
    model = build_model(cfg, "baseline", device=device, dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                        seed=seed)  # the same weights on every rank
    model = wrap(model, strategy, **opts)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    ids, targets = make_batch(cfg, run, device, seed=seed + 1 + rank)  # each rank its own data
    # FSDP's MixedPrecisionPolicy is its amp; DDP takes autocast
    ctx = (lambda: autocast_ctx(run, device.type)) if strategy == "ddp" else contextlib.nullcontext
    return counted_steps(model, opt, ids, targets, steps, ctx, on_step=on_step)


def counted_steps(model, opt, ids, targets, steps: int, ctx, *, with_loss: bool = True, on_step=None) -> list[dict]:
    """`steps` training steps, each with the collectives the process group ran and this rank's bytes.
    with_loss=False for fake tensors (the simulation), whose loss has no value to read."""
    records = []
    for step in range(1, steps + 1):
        with CollectiveCounter() as counter:
            with ctx():
                loss = model(ids, targets)
            loss.backward()
            opt.step()
        mem = rank_memory(model, opt)
        opt.zero_grad(set_to_none=True)
        rec = dict(step=step, memory=mem, collectives=[[*k, n] for k, n in sorted(counter.counts().items())])
        if with_loss:
            rec["loss"] = float(loss.detach().float())
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


# ---- local multi-process launch (tests) -------------------------------------------------------
# A spawned rank's limit on one wait, the rendezvous' or a collective's (init_process_group's timeout): a hang fails
# after it. A rank waits only on peers that are making progress, so no wait outlasts its whole spawn. The suite's
# longest spawn measured 153 s (test_tp_recompute_efficient's world 4: 4 ranks, 40 draws' steps and phases) with
# the 2-core machine at a load of 15, and test_tensor_parallel's world-4 spawn has hit a 120 s limit under heavy
# load: 4x the longest spawn.
SPAWN_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, init_method: str, scenarios: list[dict], outdir: str, timeout_s: float,
            fn=None) -> None:
    torch.set_num_threads(1)  # W processes share the cores
    init_distributed("gloo", timeout_s, rank=rank, world_size=world, init_method=init_method)
    try:
        out = [(fn or train)(**sc) for sc in scenarios]
        write_atomic(Path(outdir) / f"rank{rank}.json", json.dumps(out))
    finally:
        dist.destroy_process_group()


def spawn(world: int, scenarios: list[dict], *, timeout_s: float = SPAWN_TIMEOUT_S, fn=None) -> list[list[list[dict]]]:
    """Run each scenario (keyword arguments of train(), or of `fn`, a module-level function that returns a
    rank's step records) on `world` local gloo processes.

    Returns results[rank][scenario] = that rank's step records. A rank that fails raises here
    (torch.multiprocessing terminates the others); a collective that never completes times out."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:  # a FileStore in it: no TCP port another process could take first
        mp.spawn(_worker, args=(world, f"file://{d}/store", scenarios, d, timeout_s, fn),
                 nprocs=world, join=True)
        return [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]


def spawn_named(world: int, scenarios: dict[str, dict], *, timeout_s: float = SPAWN_TIMEOUT_S, fn=None) -> dict[str, list]:
    """spawn() over named scenarios, each without its "dp" key (the mesh takes dp from the world size): {name:
    [rank 0's step records, rank 1's, ...]}."""
    results = spawn(world, [{k: v for k, v in sc.items() if k != "dp"} for sc in scenarios.values()],
                    timeout_s=timeout_s, fn=fn)
    return {name: [results[r][i] for r in range(world)] for i, name in enumerate(scenarios)}


# ---- CLI --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        print(f"{self.prog.rsplit('.', 1)[-1]}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m llm_anatomy.distributed.train_step", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", required=True, help="ddp or fsdp")
    add_run_arguments(p)
    p.add_argument("--param-dtype", default="auto", help="fsdp: all-gather dtype (float32, bfloat16; auto: policy)")
    p.add_argument("--reduce-dtype", default="auto", help="fsdp: reduce-scatter dtype (float32, bfloat16; auto)")
    p.add_argument("--no-reshard-after-forward", action="store_true", help="fsdp: keep Blocks gathered until backward")
    p.add_argument("--bucket-cap-mb", type=float, help="ddp: bucket size in MiB (default: 1 MiB first, then 25)")
    return p


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The model, run, optimizer and launch flags every distributed harness takes."""
    p.add_argument("--preset", help="a named config (llm_anatomy.config.PRESETS)")
    for f in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab"):
        p.add_argument(f"--{f}", type=int)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--qkv-bias", action="store_true", help="a bias on q, k and v (Qwen2)")
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", default="amp", help="amp, bf16 or fp32 (see llm_anatomy.config)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZERS))
    p.add_argument("--backend", default="auto", help="auto (nccl with a GPU, else gloo), nccl or gloo")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout: a dead rank fails the job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="a folder: each rank writes its step records to rank<N>.json")


def _config(a) -> ModelConfig:
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, intermediate=a.intermediate, vocab=a.vocab)
    if a.preset:
        if any(v is not None for v in shape.values()) or a.kv_heads is not None or a.qkv_bias:
            raise ConfigError("give --preset or the shape flags, not both")
        return ModelConfig.from_name(a.preset)
    missing = [k for k, v in shape.items() if v is None]
    if missing:
        raise ConfigError(f"without --preset, give --{' --'.join(missing)}")
    return ModelConfig(name="custom", kv_heads=a.kv_heads, tie_embeddings=a.tie_embeddings, qkv_bias=a.qkv_bias,
                       **shape)


def init_launched(backend: str, timeout_s: float) -> None:
    """The process group torchrun's variables describe; under plain `python -m`, a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    init_distributed(backend, timeout_s)


def _dtype_arg(v: str):
    return None if v in ("none", "None") else v


@record  # a failing rank writes its traceback to torchrun's error file, so the job summary shows it
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        check_strategy(a.strategy)
        cfg, run = _config(a), Run(batch=a.batch, seq=a.seq, dtype=a.dtype)
        if a.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {a.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if a.strategy == "ddp" and (a.param_dtype != "auto" or a.reduce_dtype != "auto"):
            raise ConfigError("--param-dtype and --reduce-dtype are fsdp options")
        init_launched(a.backend, a.timeout_s)
    except ConfigError as e:
        print(f"train_step: error: {e}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()

    fault = os.environ.get("ANATOMY_DIST_FAULT", "")  # "RANK:STEP": a test seam, that rank dies after that step

    def show(rec):
        if fault == f"{rank}:{rec['step']}":
            raise RuntimeError(f"injected failure on rank {rank} after step {rec['step']} (ANATOMY_DIST_FAULT)")
        if rank == 0:
            n = sum(c[3] for c in rec["collectives"])
            b = sum(c[2] * c[3] for c in rec["collectives"])
            m = rec["memory"]
            print(f"step {rec['step']}  loss {rec['loss']:.4f}  collectives {n} ({b / 2**20:.2f} MiB)  "
                  f"rank 0 holds params {m['params'] / 2**20:.2f} MiB, grads {m['grads'] / 2**20:.2f} MiB, "
                  f"optimizer {m['optimizer'] / 2**20:.2f} MiB", flush=True)

    try:
        if rank == 0:
            print(f"{a.strategy} on {world} rank(s), {dist.get_backend()}: {cfg.name} "
                  f"(hidden {cfg.hidden}, layers {cfg.layers}), batch {run.batch} x seq {run.seq} per rank, {run.dtype}",
                  flush=True)
        recs = train(cfg, run, a.strategy, steps=a.steps, optimizer=a.optimizer, lr=a.lr,
                     param_dtype=_dtype_arg(a.param_dtype), reduce_dtype=_dtype_arg(a.reduce_dtype),
                     reshard_after_forward=not a.no_reshard_after_forward, bucket_cap_mb=a.bucket_cap_mb,
                     seed=a.seed, on_step=show)
        if a.report:  # one file per rank: no extra collective at the end of the job
            out = Path(a.report)
            out.mkdir(parents=True, exist_ok=True)
            rank_report = dict(strategy=a.strategy, world_size=world, rank=rank, config=cfg.to_dict(),
                               run=dict(batch=run.batch, seq=run.seq, dtype=run.dtype), steps=recs)
            write_atomic(out / f"rank{rank}.json", json.dumps(rank_report, indent=1))
    except ConfigError as e:
        dist.destroy_process_group()
        print(f"train_step: error: {e}", file=sys.stderr)
        return 2
    # Only the clean path tears the group down. A failing rank exits with its group still open: tearing it
    # down first would make its peers fail in the collective they are in before this rank has exited, and
    # torchrun would then see a peer's failure first and could end this rank with SIGTERM, losing its error.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())
