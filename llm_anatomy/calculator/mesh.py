"""One rank of a dp x tp x pp device mesh: which links its groups cross, the shard it computes, its step time.

Pure Python: no torch. The mesh is laid out as torchtitan and Megatron lay it out, tensor parallel innermost:
global rank = ((pp_index x dp) + dp_index) x tp + tp_index. So
  tp group   tp consecutive ranks: inside one node whenever tp divides the node (the planner keeps it so);
  dp group   dp ranks tp apart: it leaves the node once dp x tp > gpus per node;
  pp group   pp ranks dp x tp apart: a stage boundary crosses nodes once dp x tp >= gpus per node.
A group's collective runs over its slowest link (calculator/comm.py link(): NVLink inside a node, the node's
NIC across).

The shard one rank computes is itself a ModelConfig (shard_config): tensor parallel splits heads, kv heads,
the MLP width and the vocabulary by tp (Megatron's column/row split: q, k, v, gate, up by output rows; o and
down by input columns; the embedding and head by vocabulary rows), and the heaviest pipeline stage holds
ceil(layers / pp) layers with the head and loss (the last stage). Its compute time is the timing model's time
for that config; with sequence parallel the norms and the residual stream run on seq / tp tokens, which this
prices at full seq (an over-estimate of a few percent of the layer; stated, not fitted).

Step time of one optimizer step with m micro-batches per rank (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", sec. 2.2):
  1F1B               (m + pp - 1) x (t_f + t_b): pp - 1 micro-batch slots of bubble, one in and one out per stage;
  interleaved 1F1B   (m + (pp - 1) / v) x (t_f + t_b) with v model chunks per rank (torch's
                     ScheduleInterleaved1F1B), at v times the stage boundaries' sends;
  tensor parallel    with sequence parallel, per layer and micro-batch: an all-gather before attention and
                     before the MLP and a reduce-scatter after each (forward), the same four in backward, each
                     of micro-batch x seq x hidden activations; torch's eager TP runs them on the compute
                     stream, so all are exposed (no async TP);
  pipeline sends     one activation (forward) and one gradient (backward) per micro-batch and stage boundary,
                     micro-batch x seq x hidden (/ tp with sequence parallel), on the critical path;
  data parallel      FSDP2 over dp on each stage's shard: its gathers and reduce-scatters as comm.py prices
                     them, overlapped with the stage's compute by comm.py's overlap rule;
  optimizer          the rank's own shard: the whole model's optimizer time / (tp x pp x dp).
Gradients are synchronized over dp once per optimizer step, after the last micro-batch (what torch's pipelining
schedules do to FSDP2 units: set_requires_gradient_sync(False) before it).

Expert parallel (Mesh.ep > 1: a mixture of experts, tp = pp = 1, the experts over ep of the dp ranks):
step_time and rank_peak are calculator/ep_mesh.py's (all-to-alls, host syncs, FSDP2 on the rest; ep_memory's
heaviest rank), after mesh_rules.check_ep.

Memory of the heaviest rank (rank_peak): calculator/tp_memory.py's phases of each rank, exact at the phase
boundaries on gloo and an upper bound at the peak (validations/test_tp_memory.py): without pipeline stages the
(dp, tp) rank's (TP-local shards, sequence-parallel norms, the collectives' buffers, FSDP's gathered units); with
them the heaviest pipeline rank's (its stages' parameters, gradients and optimizer state, the receive buffers and
the saved activations of every micro-batch the schedule keeps in flight, in torch's order).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from llm_anatomy.calculator import comm
from llm_anatomy.calculator.tensor_parallel import recompute_collectives
from llm_anatomy.config import ConfigError, ModelConfig, Run

SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"  # with pp > 1
    virtual: int = 1  # model chunks per pipeline rank (interleaved-1f1b: 2 or more)
    ep: int = 1  # expert parallel over ep of the dp ranks (calculator/ep_mesh.py), tp = pp = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        dims = " x ".join([f"dp {self.dp}"] + [f"ep {self.ep}"] * (self.ep > 1) + [f"tp {self.tp}"] * (self.tp > 1)
                          + [f"pp {self.pp}"] * (self.pp > 1))
        if self.pp == 1:
            return dims
        return dims + f" ({self.schedule}" + (f", {self.virtual} chunks)" if self.virtual > 1 else ")")


def check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
    """A ConfigError in one line naming what the mesh cannot split."""
    for name in ("dp", "tp", "pp", "virtual"):
        v = getattr(mesh, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if mesh.schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {mesh.schedule!r}")
    if mesh.schedule == "1f1b" and mesh.virtual != 1:
        raise ConfigError("1f1b runs one model chunk per rank: virtual stages need interleaved-1f1b")
    for field in ("heads", "kv_heads", "intermediate"):
        if getattr(cfg, field) % mesh.tp:
            raise ConfigError(f"tp {mesh.tp} does not divide {field}={getattr(cfg, field)}")
    if cfg.moe and mesh.tp > 1:
        raise ConfigError("tensor parallel over mixture-of-experts layers is not modelled: plan MoE models with data "
                          "parallelism (expert parallel over the dp ranks: calculator/expert_parallel.py)")
    if cfg.qk_norm_whole and mesh.tp > 1:  # as mesh_rules.check_mesh refuses it to the engine
        raise ConfigError("tp > 1 does not shard OLMoE's whole q/k norm (qk_norm_whole): its mean spans every head")
    if mesh.pp * mesh.virtual > cfg.layers:
        raise ConfigError(f"pp {mesh.pp} x {mesh.virtual} chunks is more stages than layers={cfg.layers}")
    if mesh.ep > 1 and (mesh.tp > 1 or mesh.pp > 1):
        raise ConfigError("expert parallel is modelled over the data-parallel ranks alone (tp = pp = 1)")


def shard_config(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
    """The model one rank of the heaviest stage computes: tp-split widths, ceil(layers / pp) layers."""
    check_mesh(cfg, mesh)
    tp = mesh.tp
    return replace(cfg, heads=cfg.heads // tp, kv_heads=cfg.kv_heads // tp, head_dim=cfg.head_dim,
                   intermediate=cfg.intermediate // tp, vocab=-(-cfg.vocab // tp),
                   layers=-(-cfg.layers // mesh.pp), name=f"{cfg.name} shard")


def group_link(gpu: str, size: int, stride: int, gpus_per_node: int) -> int:
    """The node count of comm.link()'s ring a group of `size` ranks `stride` apart spans, as an equivalent
    contiguous world: the group stays in a node exactly when size x stride <= gpus per node."""
    return size if size * stride <= gpus_per_node else gpus_per_node + 1


def _ring_time(op: str, nbytes: int, size: int, stride: int, gpu: str, gpus_per_node: int) -> float:
    if size == 1:
        return 0.0
    span = group_link(gpu, size, stride, gpus_per_node)
    lk = comm.link(gpu, span, gpus_per_node)
    return lk["alpha_us"] * 1e-6 + nbytes * comm.bus_factor(op, size) / (lk["GBps"] * 1e9)


def bubble_fraction(mesh: Mesh, microbatches: int) -> float:
    """The fraction of an optimizer step a pipeline rank idles (calculator/pipeline_schedule.py)."""
    if mesh.pp == 1:
        return 0.0
    from llm_anatomy.calculator.pipeline_schedule import bubble_fraction as idle

    return idle(mesh.schedule, mesh.pp, microbatches, mesh.virtual)


def step_time(cfg: ModelConfig, run: Run, variant: str, gpu: str, mesh: Mesh, microbatches: int, *,
              gpus_per_node: int = 8, optimizer: str = "adamw") -> dict:
    """Seconds of one optimizer step of the heaviest rank, and where they go. run is one micro-batch."""
    from llm_anatomy.calculator.timing import estimate_time

    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"micro-batches per step must be a positive integer, got {microbatches!r}")
    if mesh.pp > 1 and microbatches < mesh.pp:
        raise ConfigError(f"a {mesh.pp}-stage pipeline needs at least {mesh.pp} micro-batches per step, "
                          f"got {microbatches}")
    if mesh.ep > 1:
        return _ep_step(cfg, run, variant, gpu, mesh, microbatches, gpus_per_node, optimizer)
    shard = shard_config(cfg, mesh)
    t = estimate_time(shard, run, variant, gpu=gpu, optimizer=optimizer)
    fb = t["steady"]["forward_backward_s"]  # forward + backward of one micro-batch
    whole = _whole(cfg, run.seq, run.dtype, variant, gpu, optimizer)
    opt = whole["optimizer_s"] / (mesh.tp * mesh.pp * mesh.dp)
    act = run.batch * run.seq * cfg.hidden * (4 if run.dtype == "fp32" else 2)  # one activation, bytes
    tp_s = 0.0
    if mesh.tp > 1:  # 4 all-gathers and 4 reduce-scatters per layer and micro-batch, and recompute's re-runs
        again = {r["op"]: r["count"] for r in recompute_collectives(run, 1, act, run.dtype)}
        tp_s = shard.layers * sum((4 + again.get(op, 0)) * _ring_time(op, act, mesh.tp, 1, gpu, gpus_per_node)
                                  for op in ("all_gather", "reduce_scatter"))
    p2p_s = 0.0
    if mesh.pp > 1:  # a send each way per boundary the rank owns (v chunks: v boundaries)
        span = mesh.dp * mesh.tp
        lk = comm.link(gpu, gpus_per_node + 1 if span >= gpus_per_node else 2, gpus_per_node)
        p2p_s = 2 * mesh.virtual * (lk["alpha_us"] * 1e-6 + act / mesh.tp / (lk["GBps"] * 1e9))
    per_micro = fb + tp_s + p2p_s
    slots = microbatches + (mesh.pp - 1) / mesh.virtual
    dp_exposed = 0.0
    if mesh.dp > 1:
        ph = t["phases"]
        compute = dict(forward=ph["forward"]["gpu_s"] * microbatches, backward=ph["backward"]["gpu_s"] * microbatches)
        d = comm.estimate_distributed(shard, run, mesh.dp, "fsdp", variant=variant, optimizer=optimizer,
                                      gpu=gpu, gpus_per_node=max(1, gpus_per_node // mesh.tp), compute_s=compute)
        dp_exposed = d["comm"]["exposed_s"]
    step = slots * per_micro + dp_exposed + opt
    return dict(step_s=step, compute_s=microbatches * fb, bubble_s=(slots - microbatches) * per_micro,
                tp_comm_s=microbatches * tp_s, p2p_s=microbatches * p2p_s, dp_exposed_s=dp_exposed, optimizer_s=opt,
                bubble_fraction=bubble_fraction(mesh, microbatches), model_flops=whole["mfu"]["model"]
                * whole["forward_backward_s"] * whole["mfu"]["peak_flops"] * run.batch * microbatches
                / (mesh.tp * mesh.pp))


def _ep_step(cfg: ModelConfig, run: Run, variant: str, gpu: str, mesh: Mesh, microbatches: int, gpus_per_node: int,
             optimizer: str) -> dict:
    """step_time's form of calculator/ep_mesh.py's step: `microbatches` micro-steps (each its all-to-alls, host
    syncs and FSDP2 collectives: every backward synchronizes) and one optimizer step."""
    from llm_anatomy.calculator import ep_mesh
    from llm_anatomy.mesh_rules import check_ep

    check_mesh(cfg, mesh)
    check_ep(cfg, run, mesh.ep, variant)
    t = ep_mesh.step_time(cfg, run, gpu, mesh.ep, mesh.dp, gpus_per_node=gpus_per_node, optimizer=optimizer)
    k = microbatches
    return dict(step_s=k * (t["step_s"] - t["optimizer_s"]) + t["optimizer_s"], compute_s=k * t["compute_s"],
                bubble_s=0.0, tp_comm_s=0.0, p2p_s=0.0, ep_comm_s=k * t["ep_comm_s"], host_sync_s=k * t["host_sync_s"],
                dp_exposed_s=k * t["dp_exposed_s"], optimizer_s=t["optimizer_s"], bubble_fraction=0.0,
                model_flops=k * t["model_flops"])


@lru_cache(maxsize=256)
def _whole(cfg: ModelConfig, seq: int, dtype: str, variant: str, gpu: str, optimizer: str) -> dict:
    """The whole model's timing at one sequence: its optimizer step and model FLOPs per sequence."""
    from llm_anatomy.calculator.timing import estimate_time

    t = estimate_time(cfg, Run(batch=1, seq=seq, dtype=dtype), variant, gpu=gpu, optimizer=optimizer)
    return dict(optimizer_s=t["optimizer_s"], mfu=t["mfu"], forward_backward_s=t["forward_backward_s"])


def in_flight(mesh: Mesh, microbatches: int) -> float:
    """Micro-batches of a whole stage's activations the first pipeline rank holds at once: torch's schedule order
    (calculator/pipeline_schedule.py), its chunks counted at 1 / v of the rank's layers each."""
    if mesh.pp == 1:
        return 1.0
    from llm_anatomy.calculator.pipeline_schedule import in_flight as chunks

    return chunks(mesh.schedule, mesh.pp, 0, microbatches, mesh.virtual) / mesh.virtual


def rank_peak(cfg: ModelConfig, run: Run, variant: str, mesh: Mesh, microbatches: int, *,
              optimizer: str = "adamw") -> int:
    """Predicted peak allocated bytes of the heaviest rank (CUDA), run being one micro-batch: calculator/tp_memory.py's
    phases. Without pipeline stages, tp_phases of the (dp, tp) mesh (the TP-local shards, FSDP over dp); with them,
    the largest pp_phases over the pipeline ranks of the TP-local model (tensor_parallel.tp_local_config: heads,
    MLP width and vocabulary over tp), its micro-batches in flight as the schedule holds them."""
    return _rank_peak(cfg, run, variant, mesh, microbatches, optimizer)


@lru_cache(maxsize=4096)
def _rank_peak(cfg: ModelConfig, run: Run, variant: str, mesh: Mesh, microbatches: int, optimizer: str) -> int:
    from llm_anatomy.calculator.tensor_parallel import tp_local_config
    from llm_anatomy.calculator.tp_memory import pp_phases, tp_phases

    check_mesh(cfg, mesh)
    if mesh.ep > 1:
        from llm_anatomy.calculator import ep_mesh
        from llm_anatomy.mesh_rules import check_ep

        check_ep(cfg, run, mesh.ep, variant)
        return ep_mesh.rank_peak(cfg, run, mesh.ep, mesh.dp, optimizer=optimizer)["peak"]
    if mesh.pp == 1:
        return tp_phases(cfg, run, mesh.tp, mesh.dp, optimizer=optimizer, variant=variant, device="cuda",
                         plan=True)["peak"]
    local = tp_local_config(cfg, mesh.tp) if mesh.tp > 1 else cfg
    whole = replace(run, batch=run.batch * microbatches, dtype="bf16" if run.dtype == "amp" and mesh.dp == 1
                    else run.dtype)  # amp is FSDP's policy: priced as bf16 compute where no FSDP runs it
    return max(pp_phases(local, whole, mesh.pp, r, mesh.dp, microbatches=microbatches, schedule=mesh.schedule,
                         virtual=mesh.virtual, optimizer=optimizer, variant=variant, device="cuda")["peak"]
               for r in heaviest_candidates(cfg.layers, mesh))


def heaviest_candidates(layers: int, mesh: Mesh) -> list[int]:
    """The pipeline ranks one of which holds the heaviest rank's peak: the first (the embedding, and the most
    micro-batches in flight: torch's schedules warm up fewer on each later rank), the last (the head and the
    loss), and the first rank holding the most layers (an uneven split); the ranks between them hold the same
    model state per layer with no more in flight. A fixed handful, whatever pp: the plan's cost stays flat."""
    from llm_anatomy.mesh_rules import stage_sizes

    sizes = stage_sizes(layers, mesh.pp, mesh.virtual)
    per_rank = [sum(sizes[r + v * mesh.pp] for v in range(mesh.virtual)) for r in range(mesh.pp)]
    return sorted({0, mesh.pp - 1, per_rank.index(max(per_rank))})
