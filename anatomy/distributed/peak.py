"""Per-rank live storage over data-parallel training steps: the measured side of calculator.sharding.per_rank_peak.

Each rank runs the same loop as train_step.train (wrap(), a plain optimizer, FSDP's MixedPrecisionPolicy or
DDP under autocast) inside anatomy.measure.liveness.LiveStorage, entered before the model is built, so that
everything the rank allocates is counted: the parameters (a DTensor's local shard), DDP's gradient buckets
(allocated by its reducer in C++, through the dispatcher), FSDP's all-gather and reduce-scatter buffers, the
activations, the gradients and the optimizer state. Returned per phase of the last step: the bytes alive at its
end and its peak (forward, backward with FSDP's final callbacks, optimizer step).

    from anatomy.distributed.peak import spawn_peaks
    spawn_peaks(2, [dict(cfg=..., run=..., strategy="fsdp")])   # results[rank][scenario] = [phases]
"""
from __future__ import annotations

import contextlib
import json
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from anatomy.config import ModelConfig, Run
from anatomy.distributed.strategies import check_strategy, default_mixed_precision, init_distributed, wrap
from anatomy.distributed.train_step import make_optimizer
from torch.utils._pytree import tree_leaves

from anatomy.io import write_atomic
from anatomy.measure.liveness import LiveStorage
from anatomy.models import autocast_ctx, build_model, make_batch


class RankStorage(LiveStorage):
    """LiveStorage for a data-parallel rank, with two differences:
      - a DTensor counts as its local shard: the mode sits above the DTensor subclass, so an op on sharded
        parameters (the optimizer's) returns a DTensor, whose storage is its _local_tensor's;
      - bytes are each storage's size *now*, summed after every op: FSDP2 frees an unsharded parameter by
        resizing its storage to 0 bytes (_fsdp_param.free_storage) and re-gathers into the same storage
        (alloc_storage), neither of which is an op the mode sees or a storage's death."""

    def __init__(self):
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}

    def _add(self, t: torch.Tensor) -> None:
        st = getattr(t, "_local_tensor", t).untyped_storage()
        key = st._cdata
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, lambda _, k=key: self._refs.pop(k, None))

    def _now(self) -> int:
        return sum(st.nbytes() for r in list(self._refs.values()) if (st := r()) is not None)

    def phase(self, name: str) -> dict:
        self.allocated = self._now()
        return super().phase(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.allocated = self._now()
        if self.allocated > self.peak:
            self.peak, self.peak_op = self.allocated, str(func)
        return out


def peaks(cfg: ModelConfig, run: Run, strategy: str, *, steps: int = 3, optimizer: str = "adamw",
          reshard_after_forward: bool = True, bucket_cap_mb: float | None = None, seed: int = 0) -> list[dict]:
    """Run `steps` steps on the initialized (CPU) process group; the phases of the last one, each
    {name, allocated, peak, peak_op} in bytes of live storage on this rank."""
    check_strategy(strategy)
    rank = dist.get_rank()
    live = RankStorage()
    with live:
        model = build_model(cfg, "baseline", dtype=torch.bfloat16 if run.dtype == "bf16" else None, seed=seed)
        if strategy == "fsdp":
            pd, rd = default_mixed_precision(run)
            model = wrap(model, "fsdp", param_dtype=pd, reduce_dtype=rd, reshard_after_forward=reshard_after_forward)
            ctx = contextlib.nullcontext  # the MixedPrecisionPolicy is FSDP's amp
        else:
            model = wrap(model, "ddp", bucket_cap_mb=bucket_cap_mb)
            ctx = lambda: autocast_ctx(run, "cpu")  # noqa: E731
        opt = make_optimizer(optimizer, model.parameters(), 1e-3)
        ids, targets = make_batch(cfg, run, seed=seed + 1 + rank)
        out = []
        for _ in range(steps):
            live.phase("start")
            with ctx():
                loss = model(ids, targets)
            fwd = live.phase("forward")
            loss.backward()
            del loss
            bwd = live.phase("backward")
            opt.step()
            step = live.phase("optimizer")
            opt.zero_grad(set_to_none=True)
            out = [fwd, bwd, step]
        del model, opt, ids, targets
    return out


def _worker(rank: int, world: int, init_method: str, scenarios: list[dict], outdir: str, timeout_s: float) -> None:
    torch.set_num_threads(1)  # W processes share the cores
    init_distributed("gloo", timeout_s, rank=rank, world_size=world, init_method=init_method)
    try:
        write_atomic(Path(outdir) / f"rank{rank}.json", json.dumps([peaks(**sc) for sc in scenarios]))
    finally:
        dist.destroy_process_group()


def spawn_peaks(world: int, scenarios: list[dict], *, timeout_s: float = 120.0) -> list[list[list[dict]]]:
    """Each scenario (keyword arguments of peaks()) on `world` local gloo processes:
    results[rank][scenario] = the last step's phases."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, f"file://{d}/store", scenarios, d, timeout_s), nprocs=world, join=True)
        return [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]
