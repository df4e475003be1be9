"""Per-rank live storage over data-parallel training steps: the measured side of calculator.sharding.per_rank_peak.

Each rank runs the same loop as train_step.train (wrap(), a plain optimizer, FSDP's MixedPrecisionPolicy or
DDP under autocast) inside RankStorage (llm_anatomy.measure.liveness.LiveStorage for a rank), entered before the model is built, so that
everything the rank allocates is counted: the parameters (a DTensor's local shard), DDP's gradient buckets
(allocated by its reducer in C++, through the dispatcher), FSDP's all-gather and reduce-scatter buffers, the
activations, the gradients and the optimizer state. Returned per phase of the last step: the bytes alive at its
end and its peak (forward, backward with FSDP's final callbacks, optimizer step).

    from llm_anatomy.distributed.settled import spawn_peaks       # its ranks read settled
    spawn_peaks(2, [dict(cfg=..., run=..., strategy="fsdp")])   # results[rank][scenario] = [phases]
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.distributed.strategies import check_strategy, default_mixed_precision, wrap
from llm_anatomy.distributed.train_step import SPAWN_TIMEOUT_S, make_optimizer
from llm_anatomy.measure.liveness import LiveStorage
from llm_anatomy.models import autocast_ctx, build_model, make_batch


class RankStorage(LiveStorage):
    """LiveStorage for a data-parallel rank, with two additions:
      - a DTensor counts as its local shard: the mode sits above the DTensor subclass, so an op on sharded
        parameters (the optimizer's) returns a DTensor, whose storage is its _local_tensor's;
      - a storage resized in place counts at its new size: FSDP2 frees an unsharded parameter by resizing its
        storage to 0 bytes and re-gathers into the same storage (_fsdp_param.py free_storage, alloc_storage),
        neither of which is an op the mode sees. UntypedStorage.resize_ is wrapped while the mode is active."""

    def _add(self, t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)
        # a collective's output not yet waited on: its buffer (the wrapper's own storage holds no data)
        super()._add(t.elem if isinstance(t, AsyncCollectiveTensor) else t)

    def _resized(self, st, old: int) -> None:
        key = st._cdata
        if key in self._live:
            delta = st.nbytes() - old
            self._live[key] += delta
            self.allocated += delta
            if self.allocated > self.peak:
                self.peak, self.peak_op = self.allocated, "UntypedStorage.resize_"

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, size):
            old = st.nbytes()
            out = orig(st, size)
            self._resized(st, old)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


def peaks(cfg: ModelConfig, run: Run, strategy: str, *, steps: int = 3, optimizer: str = "adamw",
          reshard_after_forward: bool = True, bucket_cap_mb: float | None = None, seed: int = 0,
          storage: type[RankStorage] | None = None, variant: str = "baseline") -> list[dict]:
    """Run `steps` steps of the variant's model on the initialized (CPU) process group; the phases of the last
    one, each {name, allocated, peak, peak_op} in bytes of live storage on this rank. storage: the counter's class,
    RankStorage by default (distributed/settled.py's SettledStorage on its one-worker gloo ranks)."""
    check_strategy(strategy)
    rank = dist.get_rank()
    live = (storage or RankStorage)()
    with live:
        model = build_model(cfg, variant, dtype=torch.bfloat16 if run.dtype == "bf16" else None, seed=seed)
        if strategy == "fsdp":
            pd, rd = default_mixed_precision(run)
            model = wrap(model, "fsdp", param_dtype=pd, reduce_dtype=rd, reshard_after_forward=reshard_after_forward)
            ctx = contextlib.nullcontext  # the MixedPrecisionPolicy is FSDP's amp
        else:
            model = wrap(model, "ddp", bucket_cap_mb=bucket_cap_mb)
            ctx = lambda: autocast_ctx(run, "cpu")  # noqa: E731
        opt = make_optimizer(optimizer, model.parameters(), 1e-3)
        ids, targets = make_batch(cfg, run, seed=seed + 1 + rank)
        out = step_phases(live, model, opt, ids, targets, steps, ctx)[:3]
        del model, opt, ids, targets
    return out


def step_phases(live: LiveStorage, model, opt, ids, targets, steps: int, ctx=contextlib.nullcontext,
                 step_ctx=contextlib.nullcontext) -> list[dict]:
    """`steps` training steps read phase by phase from `live`; the last one's forward, backward, optimizer and
    zero_grad phases. ctx() wraps the forward (autocast), step_ctx() the forward and backward (loss_parallel)."""
    out = []
    for _ in range(steps):
        live.phase("start")
        with step_ctx():
            with ctx():
                loss = model(ids, targets)
            fwd = live.phase("forward")
            loss.backward()
        del loss
        bwd = live.phase("backward")
        opt.step()
        step = live.phase("optimizer")
        opt.zero_grad(set_to_none=True)
        out = [fwd, bwd, step, live.phase("zero_grad")]
    return out
