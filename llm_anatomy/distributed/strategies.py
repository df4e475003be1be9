"""Data-parallel strategies: DDP (the baseline) and FSDP2 (the efficient one), behind one `wrap()`.

  ddp   torch.nn.parallel.DistributedDataParallel: a full replica per rank, gradients
        all-reduced in buckets during backward.
  fsdp  torch.distributed.fsdp.fully_shard (FSDP2) on every transformer Block, then on the root
        (embedding, final norm, head). Parameters live sharded on dim 0, the stacked experts
        of a mixture of experts with fewer experts than ranks on dim 1 (shard_placement); each
        unit is all-gathered before its forward (and again before its backward when
        reshard_after_forward), and its gradients reduce-scattered after its backward.
        The root is never resharded after forward: its backward starts right after.

What each costs is predicted by llm_anatomy.calculator.comm / sharding; validations/test_distributed.py
compares the two.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from llm_anatomy.config import ConfigError, Run

STRATEGIES = ("ddp", "fsdp")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_mixed_precision(run: Run) -> tuple[str | None, str | None]:
    """(param_dtype, reduce_dtype) of FSDP's MixedPrecisionPolicy for a dtype policy.

    amp: bf16 compute and all-gathers, fp32 gradient reduction (FSDP's own form of amp; no autocast
    needed). bf16 and fp32: no casts, the parameters' dtype throughout."""
    return {"amp": ("bfloat16", "float32"), "bf16": (None, None), "fp32": (None, None)}[run.dtype]


def _dtype(name, what: str) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{what} must be float32 or bfloat16, got {name!r}") from None


def init_distributed(backend: str = "auto", timeout_s: float = 120.0, **kw) -> str:
    """init_process_group with a timeout, so a rank that dies fails the others instead of hanging them.

    backend 'auto' is nccl with a GPU, gloo without. Extra keywords (rank, world_size, init_method,
    store) go to init_process_group; without them the env:// variables torchrun sets are read."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo", "fake"):
        raise ConfigError(f"backend must be auto, nccl, gloo or fake, got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("backend nccl needs a CUDA GPU; this machine has none (use gloo)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", kw.get("rank", 0))))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return backend


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def shard_placement(world: int):
    """FSDP2's shard_placement_fn for a shard group of `world` ranks (torchtitan's rule for MoE experts):
    Shard(1) for a 3-D tensor with fewer rows on dim 0 than ranks whose dim 1 `world` divides (the stacked
    experts (E, 2I, H) and (E, H, I) with E < world), None (FSDP2's default Shard(0)) for everything else.

    Dim 0 would give each rank ceil(E / world) = 1 padded expert: world / E times the tensor in every rank's
    shard and all-gather. FSDP2 takes Shard(1) only when world divides dim 1 (it refuses uneven non-zero-dim
    shards), and then pays a copy of the gathered tensor to lay it out (its all-gather copy-out) and a
    re-chunked copy of its gradient before the reduce-scatter. A 2-D expert bias (E, M) stays on dim 0: its
    padding is under 0.1% of the Block's all-gather (docs/moe.md). calculator/fsdp_shards.py's fsdp_shard_dim
    states the same rule."""
    from torch.distributed.tensor import Shard

    def place(p: torch.Tensor):
        return Shard(1) if p.ndim == 3 and p.shape[0] < world and p.shape[1] % world == 0 else None

    return place


def _check_fsdp_world(model: nn.Module, world: int) -> None:
    # FSDP2 pads every dim-0 shard, so any world size runs; past the largest dim 0, though, some
    # ranks hold nothing at all, which is a mistake, not a configuration.
    largest = max(p.shape[0] for p in model.parameters())
    if world > largest:
        name = getattr(getattr(model, "cfg", None), "name", "the model")
        raise ConfigError(f"fsdp cannot shard {name} over {world} ranks: its largest parameter has {largest} rows "
                          f"on dim 0, so ranks >= {largest} would hold no shard of anything")


def wrap(model: nn.Module, strategy: str, *, param_dtype=None, reduce_dtype=None, reshard_after_forward: bool = True,
         bucket_cap_mb: float | None = None, gradient_divide_factor: float | None = None, mesh=None,
         device_ids=None) -> nn.Module:
    """Wrap `model` (a Transformer with .layers) for data-parallel training on the default process group.

    fsdp: param_dtype / reduce_dtype ('float32', 'bfloat16' or None) make the MixedPrecisionPolicy;
    reshard_after_forward applies to the Blocks; gradient_divide_factor replaces the default
    mean over ranks (NCCL's PREMUL_SUM: gloo has none). ddp: bucket_cap_mb as DDP's own.
    """
    check_strategy(strategy)
    pd, rd = _dtype(param_dtype, "param_dtype"), _dtype(reduce_dtype, "reduce_dtype")
    if not isinstance(reshard_after_forward, bool):
        raise ConfigError(f"reshard_after_forward must be true or false, got {reshard_after_forward!r}")
    if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if not dist.is_initialized():
        raise ConfigError("no process group: launch with torchrun (or call init_distributed()) before wrap()")
    world, backend = dist.get_world_size(), dist.get_backend()
    if strategy == "ddp":
        if pd is not None or rd is not None or gradient_divide_factor is not None:
            raise ConfigError("param_dtype, reduce_dtype and gradient_divide_factor are fsdp options; "
                              "ddp follows the run's dtype policy")
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if bucket_cap_mb is not None:
        raise ConfigError("bucket_cap_mb is a ddp option; fsdp communicates one buffer per unit")
    _check_fsdp_world(model, world)
    if gradient_divide_factor is not None and backend == "gloo":
        raise ConfigError("gradient_divide_factor needs ReduceOp.PREMUL_SUM, which gloo lacks; run it on nccl, "
                          "or simulate it with the fake process group (llm_anatomy.distributed.simulate)")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    place = shard_placement(mesh.size())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=place)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=place)
    if gradient_divide_factor is not None:  # a per-unit setting: every FSDP module, not just the root
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(gradient_divide_factor))
    return model


def exit_rank(code: int) -> None:
    """End a process launched as one rank of several (torchrun sets WORLD_SIZE) without interpreter
    finalization, once its process group is destroyed and its files are written; any other process
    exits normally. At finalization gloo's worker threads can still hold work objects whose destruction
    aborts the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291
    describes the race), which the two-rank CPU tests hit in full-suite runs, never alone (docs/history.md)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
