"""Per-rank live storage over tensor-parallel (x FSDP2), pipeline-parallel (x FSDP2) and expert-parallel (x FSDP2)
steps: the measured side of llm_anatomy.calculator.tp_memory and llm_anatomy.calculator.ep_memory.

Each rank runs the loop of distributed/mesh_step.py (TP) or distributed/pipeline_step.py (PP) inside SettledStorage
(distributed/settled.py: distributed/peak.py's live storage, a DTensor counted as its local shard and FSDP2's in-place
storage resizes counted, read at each boundary after every collective's buffers are dropped), entered before the
model is built, so everything the rank allocates is counted. The ranks run settled.BACKEND, gloo with one worker
thread per process group. Returned: the phases of the last step, each {name, allocated, peak, peak_op} in bytes
of live storage on this rank:
  TP  forward (the loss returned), backward (loss.backward() done, the loss dropped), optimizer (opt.step()),
      zero_grad (gradients set to None);
  PP  step (the schedule's forwards and backwards of every micro-batch), optimizer, zero_grad;
  EP  as TP (distributed/expert_parallel.py's build: the efficient model, its experts split over every rank, FSDP2
      over the same ranks on the rest; a forced routing where given).

    from llm_anatomy.distributed.mesh_peak import spawn_mesh_peaks
    spawn_mesh_peaks(2, [dict(cfg=..., run=..., tp=2)])            # results[rank][scenario] = [phases]
    spawn_mesh_peaks(2, [dict(cfg=..., run=..., pp=2, microbatches=2)], fn="pp")
    spawn_mesh_peaks(2, [dict(cfg=..., run=..., route="skewed")], fn="ep")
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.distributed.peak import step_phases
from llm_anatomy.distributed.settled import SettledStorage, spawn_settled
from llm_anatomy.distributed.strategies import default_mixed_precision
from llm_anatomy.distributed.train_step import SPAWN_TIMEOUT_S, make_optimizer
from llm_anatomy.models import build_model, make_batch


def tp_peaks(cfg: ModelConfig, run: Run, tp: int, *, steps: int = 2, optimizer: str = "adamw",
             reshard_after_forward: bool = True, seed: int = 0, variant: str = "baseline") -> list[dict]:
    """`steps` steps on the initialized (CPU) process group as a (world / tp, tp) mesh; the last one's phases.
    variant "efficient": its plain block, under run.recompute."""
    from llm_anatomy.distributed.tensor_parallel import build_mesh, loss_context, parallelize
    from llm_anatomy.mesh_rules import check_run

    world = dist.get_world_size()
    mesh = build_mesh(world // tp, tp)
    check_run(run, tp, world // tp, variant)
    dp_rank = mesh["dp"].get_local_rank()
    live = SettledStorage()
    with live:
        model = build_model(cfg, variant, dtype=torch.bfloat16 if run.dtype == "bf16" else None, seed=seed,
                            recompute=run.recompute)
        pd, rd = default_mixed_precision(run) if world // tp > 1 else (None, None)
        parallelize(model, mesh, param_dtype=pd, reduce_dtype=rd, reshard_after_forward=reshard_after_forward)
        opt = make_optimizer(optimizer, model.parameters(), 1e-3)
        ids, targets = make_batch(cfg, run, seed=seed + 1 + dp_rank)
        # loss_parallel covers the backward too
        out = step_phases(live, model, opt, ids, targets, steps, step_ctx=lambda: loss_context(tp))
        del model, opt, ids, targets
    return out


def pp_peaks(cfg: ModelConfig, run: Run, pp: int, *, microbatches: int, dp: int = 1, tp: int = 1,
             schedule: str = "1f1b", virtual: int = 1, split=None, steps: int = 2, optimizer: str = "adamw",
             seed: int = 0, variant: str = "baseline") -> list[dict]:
    """`steps` pipeline steps on the initialized (CPU) process group of pp x dp x tp ranks; the last one's phases.
    tp > 1: tensor parallel inside the stages on the (pp, dp, tp) mesh (distributed/pipeline_tp.py), the schedule
    under loss_context; variant "efficient" (tp > 1): its plain block, under run.recompute."""
    from torch.distributed.device_mesh import init_device_mesh

    from llm_anatomy.distributed.pipeline_parallel import build_stages, make_schedule, pipeline_stages, shard_stage
    from llm_anatomy.distributed.pipeline_tp import build_pp_mesh, tp_stages
    from llm_anatomy.distributed.tensor_parallel import loss_context
    from llm_anatomy.mesh_rules import check_mesh, check_pipeline, check_run

    check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    if tp > 1 or variant != "baseline":
        mesh = build_pp_mesh(pp, dp, tp)  # the tp sub-mesh is sliced by the engine, inside the count
    else:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_mesh, dp_mesh = mesh["pp"], mesh["dp"]  # the mesh's own tensors are made before counting starts
    pp_rank, dp_rank = pp_mesh.get_local_rank(), dp_mesh.get_local_rank()
    live = SettledStorage()
    with live:
        model = build_model(cfg, variant, dtype=torch.bfloat16 if run.dtype == "bf16" else None, seed=seed,
                            recompute=run.recompute)
        pd, rd = default_mixed_precision(run) if dp > 1 else (None, None)
        if tp > 1 or variant != "baseline":
            mods = tp_stages(model, mesh, virtual=virtual, split=split, param_dtype=pd, reduce_dtype=rd)
        else:
            mods = build_stages(model, pp, pp_rank, virtual=virtual, split=split)
            if dp > 1:
                mods = [shard_stage(m, dp_mesh, param_dtype=pd, reduce_dtype=rd) for m in mods]
        del model  # the stages hold the modules they run; the others are freed
        ids, targets = make_batch(cfg, run, seed=seed + 1 + dp_rank)
        act = torch.bfloat16 if run.dtype in ("bf16", "amp") else torch.float32
        stages = pipeline_stages(mods, pp_rank, pp, ids[:run.batch // microbatches], cfg.hidden, act, pp_mesh, tp)
        sched = make_schedule(schedule, stages, microbatches)
        holder = torch.nn.ModuleList(mods)
        opt = make_optimizer(optimizer, holder.parameters(), 1e-3)
        first, last = any(m.first for m in mods), any(m.last for m in mods)
        out = []
        for _ in range(steps):
            live.phase("start")
            kw = dict(targets=targets, target=targets) if last else {}
            with loss_context(tp):
                sched.step(*((ids,) if first else ()), return_outputs=False, **kw)
            ran = live.phase("step")
            opt.step()
            step = live.phase("optimizer")
            opt.zero_grad(set_to_none=True)
            out = [ran, step, live.phase("zero_grad")]
        del holder, mods, stages, sched, opt, ids, targets
    return out


def ep_peaks(cfg: ModelConfig, run: Run, *, route: str | None = None, steps: int = 2, optimizer: str = "adamw",
             seed: int = 0, ep: int | None = None) -> list[dict]:
    """`steps` expert-parallel steps on the initialized (CPU) process group, every rank its own batch, ep over ep
    ranks (expert_parallel.build's: every rank by default); the last one's phases. route: measure/routing.py's
    forced routing ("balanced", "skewed"), None the router's own."""
    from llm_anatomy.distributed.expert_parallel import build

    live = SettledStorage()
    with live:
        model, mesh = build(cfg, run, seed=seed, route=route, ep=ep)
        opt = make_optimizer(optimizer, model.parameters(), 1e-3)
        ids, targets = make_batch(cfg, run, seed=seed + 1 + dist.get_rank())
        out = step_phases(live, model, opt, ids, targets, steps)
        del model, mesh, opt, ids, targets
    return out


PEAKS = {"tp": tp_peaks, "pp": pp_peaks, "ep": ep_peaks}


def _run(default: str, fn=None, **kw):
    """One scenario on a spawned rank: its own fn (a name in PEAKS or a module-level function), else `default`."""
    fn = fn or default
    return (PEAKS[fn] if isinstance(fn, str) else fn)(**kw)


def spawn_mesh_peaks(world: int, scenarios: list[dict], *, fn: str = "tp",
                     timeout_s: float = SPAWN_TIMEOUT_S) -> list[list]:
    """Each scenario (keyword arguments of tp_peaks(), or of pp_peaks() / ep_peaks() with fn="pp" / "ep") on
    `world` local one-worker gloo processes (settled.spawn_settled): results[rank][scenario] = the last step's
    phases. A scenario's own "fn" key (a name in PEAKS, or a module-level function that returns a rank's records)
    overrides fn, so one set of processes runs every measurement a test file makes of a mesh (each process imports
    torch: seconds)."""
    from functools import partial

    # the first scenario of each fn runs twice and its first run is dropped: a process makes a few bytes of lazy
    # state (the pipeline's first step: 4 bytes) that every later run shares
    runs, kept, kinds = [], [], set()
    for sc in scenarios:
        kind = sc.get("fn", fn)
        if kind not in kinds:
            kinds.add(kind)
            runs.append(sc)
        kept.append(len(runs))
        runs.append(sc)
    return [[rank[i] for i in kept] for rank in spawn_settled(world, runs, partial(_run, fn), timeout_s=timeout_s)]
