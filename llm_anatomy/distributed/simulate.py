"""One rank of a large data-parallel job, in one CPU process: the fake process group plus fake tensors.

The fake process group (torch.testing._internal.distributed.fake_pg) accepts every collective
and moves nothing, so one process can be rank r of 1024. FSDP2 runs its real code: it shards a
meta-device model for that rank (only shapes exist), the shards are materialized as fake tensors
(FakeTensorMode: shapes, dtypes and storage sizes, no data), and a full forward, backward and
optimizer step run on them. What FSDP issues and what the rank ends up holding are therefore
FSDP's own, at the size of llama3-8b, with no memory and no compute.

DDP cannot run on fake or meta tensors (its constructor reads parameter values to verify them
across ranks), so its simulation runs real CPU tensors: fine for small configs, and DDP's
per-rank bytes and buckets do not depend on the world size anyway. Its buckets go through a
comm hook that does what DDP's built-in reduction does, because the fake group's futures carry
no tensor for DDP's reducer to read back.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.strategies import check_strategy, default_mixed_precision, wrap
from llm_anatomy.distributed.train_step import counted_steps, make_optimizer
from llm_anatomy.models import build_model

DDP_MAX_PARAMS = 50_000_000  # the DDP simulation allocates real tensors: ~16 B per parameter


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("a process group is already initialized in this process; simulate needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate(cfg: ModelConfig, run: Run, world_size: int, strategy: str, *, rank: int = 0, steps: int | None = None,
             optimizer: str = "adamw", param_dtype="auto", reduce_dtype="auto", reshard_after_forward: bool = True,
             bucket_cap_mb: float | None = None, gradient_divide_factor: float | None = None) -> list[dict]:
    """Rank `rank`'s view of `steps` training steps on `world_size` ranks (default: 1 for fsdp, 3 for
    ddp, whose buckets settle in step 3). Returns step records as train_step.train() does."""
    check_strategy(strategy)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
    steps = steps or (3 if strategy == "ddp" else 1)
    with fake_process_group(world_size, rank):
        if strategy == "fsdp":
            return _fsdp(cfg, run, steps, optimizer, param_dtype, reduce_dtype, reshard_after_forward,
                         gradient_divide_factor)
        return _ddp(cfg, run, steps, optimizer, bucket_cap_mb)


def _steps(model, opt, ids, targets, steps: int, ctx) -> list[dict]:
    return counted_steps(model, opt, ids, targets, steps, ctx, with_loss=False)


def _fsdp(cfg, run, steps, optimizer, param_dtype, reduce_dtype, reshard_after_forward, divide) -> list[dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    pd, rd = default_mixed_precision(run)
    model = build_model(cfg, "baseline", device="meta", dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                        seed=None)
    # sharding a meta model is cheap (torch.chunk on fake tensors at W=1024 is not): wrap first
    model = wrap(model, "fsdp", param_dtype=pd if param_dtype == "auto" else param_dtype,
                 reduce_dtype=rd if reduce_dtype == "auto" else reduce_dtype,
                 reshard_after_forward=reshard_after_forward, gradient_divide_factor=divide)
    # allow_non_fake_inputs: to_empty reads the meta shards to allocate their fake replacements
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # FSDP re-pads each shard as it materializes it
        ids = torch.zeros(run.batch, run.seq, dtype=torch.long)
        targets = torch.zeros(run.batch, run.seq, dtype=torch.long)
        opt = make_optimizer(optimizer, model.parameters(), 1e-3)
        return _steps(model, opt, ids, targets, steps, contextlib.nullcontext)


def _fake_pg_allreduce_hook(state, bucket):
    # DDP's default reduction, except for the hand-back: the fake group's Work future holds no
    # tensor, which DDP's reducer rejects. The bucket, and the all_reduce counted, are DDP's own.
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _ddp(cfg, run, steps, optimizer, bucket_cap_mb) -> list[dict]:
    from llm_anatomy.calculator import param_count  # a size guard, not a prediction under test
    from llm_anatomy.models import autocast_ctx, make_batch

    if param_count(cfg) > DDP_MAX_PARAMS:
        raise ConfigError(f"the ddp simulation runs real CPU tensors; {cfg.name} has {param_count(cfg):,} parameters "
                          f"(limit {DDP_MAX_PARAMS:,}); its per-rank bytes do not depend on the world size")
    torch.manual_seed(0)
    model = build_model(cfg, "baseline", dtype=torch.bfloat16 if run.dtype == "bf16" else None)
    model = wrap(model, "ddp", bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(None, _fake_pg_allreduce_hook)
    opt = make_optimizer(optimizer, model.parameters(), 1e-3)
    ids, targets = make_batch(cfg, run)
    return _steps(model, opt, ids, targets, steps, lambda: autocast_ctx(run, "cpu"))
