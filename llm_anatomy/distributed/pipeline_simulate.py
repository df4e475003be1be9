"""One rank of a large pipeline x FSDP x tensor-parallel job, in one CPU process, on the fake process group
(distributed.simulate.fake_process_group), which accepts every send, receive and collective and moves nothing.

The model is built on the meta device, tensor-parallelised, cut into this rank's stages and FSDP2-sharded by the
engine's own code (distributed/pipeline_tp.py); only this rank's shards are then allocated (uninitialised CPU
memory: the values are never read), so a small model's rank of a mesh of hundreds runs torch's schedule, DTensor
and FSDP2 for real. The records are pipeline_step.pp_steps' without the loss: what the rank issues and holds.

One value is read: the schedule's first step has the stages vote on static or dynamic shapes, a product of int32
votes sent down the pipeline and back, and reads the result. These stages have complete static shapes and plain
tensors between them (InferenceMode.needs_dynamic is False on every stage of every rank), so a real group
delivers the product 1; _Votes gives the fake group's int32 receives that value (checked per stage).
"""
from __future__ import annotations

import torch
from torch.distributed.pipelining._utils import InferenceMode
from torch.utils._python_dispatch import TorchDispatchMode

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.pipeline_parallel import make_schedule, pipeline_stages
from llm_anatomy.distributed.pipeline_step import pp_steps
from llm_anatomy.distributed.pipeline_tp import build_pp_mesh, tp_stages
from llm_anatomy.distributed.simulate import fake_process_group
from llm_anatomy.distributed.strategies import default_mixed_precision
from llm_anatomy.distributed.train_step import make_optimizer
from llm_anatomy.mesh_rules import check_mesh, check_pipeline, check_run
from llm_anatomy.models import build_model


def simulate_pp(cfg: ModelConfig, run: Run, *, pp: int, dp: int = 1, tp: int = 1, rank: int = 0,
                schedule: str = "1f1b", microbatches: int | None = None, virtual: int = 1, split=None,
                steps: int = 1, optimizer: str = "adamw", variant: str = "baseline") -> list[dict]:
    """Global rank `rank`'s view of `steps` steps on a (pp, dp, tp) mesh of pp x dp x tp ranks (tp innermost);
    variant "efficient": its plain block under run.recompute."""
    microbatches = microbatches or pp
    check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    world = pp * dp * tp
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"rank must be in [0, {world}), got {rank!r}")
    with fake_process_group(world, rank):
        mesh = build_pp_mesh(pp, dp, tp)
        pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
        model = build_model(cfg, variant, device="meta", dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                            seed=None, recompute=run.recompute)
        mods = tp_stages(model, mesh, virtual=virtual, split=split, param_dtype=pd, reduce_dtype=rd)
        for m in mods:
            m.to_empty(device="cpu")
        ids = torch.zeros(run.batch, run.seq, dtype=torch.long)
        act = torch.bfloat16 if run.dtype in ("bf16", "amp") else torch.float32
        stages = pipeline_stages(mods, mesh["pp"].get_local_rank(), pp, ids[:run.batch // microbatches],
                                 cfg.hidden, act, mesh["pp"], tp)
        for st in stages:
            if InferenceMode.needs_dynamic(st._user_meta, True):
                raise ConfigError(f"stage {st.stage_index} would vote for dynamic shapes; the simulation "
                                  "delivers the static vote only")
        sched = make_schedule(schedule, stages, microbatches)
        opt = make_optimizer(optimizer, torch.nn.ModuleList(mods).parameters(), 1e-3)
        with _Votes():
            return pp_steps(sched, mods, opt, ids, torch.zeros_like(ids), mesh, steps, with_loss=False)


class _Votes(TorchDispatchMode):
    """The fake group's int32 receives (the schedule's shape vote; nothing else is int32) get the product every
    stage's static vote makes, 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._overloadpacket.__name__ == "recv_":
            for t in args[0]:
                if t.dtype == torch.int32:
                    t.fill_(1)
        return out


def simulate_ranks(ranks: list[int], *, workers: int = 2, **kw) -> dict[int, list[dict]]:
    """simulate_pp(rank=r, **kw) for each r, each in a fresh process: DTensor caches its sharding decisions by
    mesh, and the meshes of two ranks are equal, so a second rank in one process would run on the first one's
    (destroyed) process groups. {rank: records}."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        futures = {r: pool.submit(simulate_pp, rank=r, **kw) for r in ranks}
        return {r: f.result() for r, f in futures.items()}
