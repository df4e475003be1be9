"""Pipeline parallel (x FSDP2 over dp), per rank: bytes held, activations in flight, sends/recvs, bubble.
Pure Python: no torch.

The setup is llm_anatomy.distributed.pipeline_parallel's on torch.distributed.pipelining (torch 2.13): stage s of
pp x virtual on pipeline rank s % pp (llm_anatomy/mesh_rules.py), the embedding on stage 0, final norm + head + loss on the
last; with dp > 1 every stage fully_shard'ed over its dp row, each Block a unit and the stage's embedding / norm /
head a root unit, without resharding after forward.

  parameters, gradients, optimizer  the rank's stages' tensors; under FSDP each tensor's padded dim-0 shard
                                    (calculator/sharding.py's rules: params and grads padded, optimizer state the
                                    rows this dp rank really holds, AdamW's 4-byte step per tensor)
  saved activations                 one micro-batch through a stage saves its layers' tensors, the RoPE tables its
                                    forward builds, the embedding's ids on stage 0, the final norm's and the loss's
                                    on the last (calculator.estimate for a micro-batch); a rank holds the chunks
                                    whose forward ran and backward has not, in the schedule's order (in_flight)
  sends / recvs                     per micro-batch and stage boundary, the (micro-batch, seq, hidden) activation
                                    forward and its gradient back, in the stage dtype; in the first step torch's
                                    warm-up vote adds one int32 send and recv per boundary each way
  FSDP                              per stage unit with parameters: one all-gather before its first micro-batch and
                                    one reduce-scatter after its last backward (gradient sync is off until then)
  bubble                            idle fraction of the step with equal chunk times: (pp - 1) / (v m + pp - 1)
  tensor parallel inside stages     tp > 1 (distributed/pipeline_tp.py, a (pp, dp, tp) mesh): the TP-local tensors
                                    (calculator/tensor_parallel.py's), the sequence shard (seq / tp) sent between
                                    stages, and TP alone's collectives per stage and micro-batch (tp_stage_rows)
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from llm_anatomy.calculator.comm import _row, collective_counts  # noqa: F401  (the row format planners compose)
from llm_anatomy.calculator.param_layout import units
from llm_anatomy.calculator.pipeline_schedule import bubble_fraction, in_flight, saved_peak  # noqa: F401
from llm_anatomy.mesh_rules import (SCHEDULES, check_mesh, check_pipeline, check_run, rank_stages,  # noqa: F401
                                   stage_sizes)
from llm_anatomy.calculator.fsdp_shards import shard_numel
from llm_anatomy.calculator.sharding import DTYPE_BYTES, fsdp_dtypes, optimizer_bytes, param_dtype_name
from llm_anatomy.calculator.tensor_parallel import (OPTIMIZER_GRAD_READS, check_optimizer, loss_all_reduces,
                                                    recompute_collectives, tp_unit_shapes)
from llm_anatomy.config import ConfigError, ModelConfig, Run


def _block_shapes(cfg: ModelConfig, variant: str) -> list[tuple[int, ...]]:
    block = [s for _, s in units(cfg)[1]]
    if variant != "efficient":
        return block
    H, I, q, kv = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim  # fused qkv and gate_up
    qkv = [(q + 2 * kv, H)] + ([(q + 2 * kv,)] if cfg.qkv_bias else [])
    qkn = [(cfg.head_dim,), (cfg.head_dim,)] if cfg.qk_norm else []
    return [(H,), *qkv, (H, q), *qkn, (H,), (2 * I, H), (H, I)]


def stage_units(cfg: ModelConfig, layers: int, first: bool, last: bool, variant: str = "baseline",
                tp: int = 1) -> list:
    """The stage's FSDP units, each (name, parameter shapes, how many): its `layers` Blocks (all the same
    shapes, counted rather than listed), then its root (embedding / norm / head), if it has parameters.
    tp > 1: each tensor's TP-local shape (calculator.tensor_parallel.tp_unit_shapes, the plan of TP alone; the
    efficient variant's fused qkv and gate_up column-parallel like the projections they fuse)."""
    V, H = cfg.vocab, cfg.hidden
    root = ([(V, H)] if first else []) + ([(H,), (V, H)] if last else [])
    block = _block_shapes(cfg, variant)
    if tp > 1:
        (_, local_root), (_, local_block) = tp_unit_shapes(cfg, tp, variant)
        shape = dict(local_root)
        block = [s for _, s in local_block]
        root = ([shape["embed.weight"]] if first else []) + (
            [shape["norm.weight"], shape["head.lm_head.weight"]] if last else [])
    return [("layers.*", block, layers)] + ([("root", root, 1)] if root else [])


def _rank_units(cfg, pp, rank, virtual, split, variant, tp=1) -> list:
    per_stage = stage_sizes(cfg.layers, pp, virtual, split)
    n = len(per_stage)
    return [(s, u) for s in rank_stages(pp, rank, virtual)
            for u in stage_units(cfg, per_stage[s], s == 0, s == n - 1, variant, tp)]


def pp_rank_memory(cfg: ModelConfig, run: Run, pp: int, rank: int, dp: int = 1, *, virtual: int = 1, split=None,
                   optimizer: str = "adamw", dp_rank: int = 0, variant: str = "baseline",
                   microbatches: int | None = None, tp: int = 1) -> dict:
    """Bytes pipeline rank `rank` (dp rank `dp_rank` of its row, any rank of its tp group) holds between steps:
    params, grads, optimizer; with `microbatches` (run.batch split into them), also saved_activations, the most
    the rank holds at once in a step under the schedule `virtual` implies (1: 1f1b, more: interleaved-1f1b).

    tp > 1: the TP-local tensors (FSDP2 shards those over dp); without FSDP the untied embedding's gradient is
    the whole (V, H) table on stage 0's ranks, as under TP alone (calculator.tensor_parallel.tp_rank_memory)."""
    schedule = "1f1b" if virtual == 1 else "interleaved-1f1b"
    check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    out = _model_state(cfg, run, pp, rank, dp, virtual, split, optimizer, dp_rank, variant, tp)
    if microbatches is not None:
        out["saved_activations"] = saved_peak(cfg, run, pp, rank, microbatches=microbatches, schedule=schedule,
                                              virtual=virtual, split=split, variant=variant, tp=tp)
    return out


def _model_state(cfg, run, pp, rank, dp, virtual, split, optimizer, dp_rank, variant, tp=1) -> dict:
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp:
        raise ConfigError(f"dp_rank must be in [0, {dp}), got {dp_rank!r}")
    pb = DTYPE_BYTES[param_dtype_name(run)]
    local = padded = tensors = 0
    for _, (_, shapes, k) in _rank_units(cfg, pp, rank, virtual, split, variant, tp):
        tensors += k * len(shapes)
        for s in shapes:
            lo, pa = shard_numel(s, dp, dp_rank) if dp > 1 else (prod(s), prod(s))
            local, padded = local + k * lo, padded + k * pa
    grads = padded
    if tp > 1 and dp == 1 and rank == 0:  # DTensor's embedding backward leaves a Replicate gradient
        grads += (cfg.vocab - cfg.vocab // tp) * cfg.hidden
    return dict(params=padded * pb, grads=grads * pb, optimizer=optimizer_bytes(optimizer, local, tensors, pb))


def _stage_dtype(run: Run) -> str:
    """The dtype of the activations between stages: the compute dtype (amp runs as FSDP's bf16 parameters)."""
    return "float32" if run.dtype == "fp32" else "bfloat16"


def pp_collectives(cfg: ModelConfig, run: Run, pp: int, rank: int, dp: int = 1, *, microbatches: int,
                   schedule: str = "1f1b", virtual: int = 1, split=None, step: int | None = None,
                   variant: str = "baseline", tp: int = 1, optimizer: str = "adamw") -> list[dict]:
    """Every send, recv, FSDP and TP collective of one step on pipeline rank `rank`, in calculator/comm.py's rows
    plus `group`, the mesh dim it runs on ("pp", "dp", "tp"). step 1 adds torch's warm-up vote; None (or any
    later step) is the steady state. run.batch is the dp rank's batch, split into `microbatches`.
    tp > 1: each rank sends its sequence shard, (micro-batch, seq / tp, hidden); tp_stage_rows adds TP's own."""
    per_stage = check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise ConfigError(f"step must be a positive integer, got {step!r}")
    n, M, mine = len(per_stage), microbatches, rank_stages(pp, rank, virtual)
    sends_fwd = sum(1 for s in mine if s < n - 1)  # stages that pass activations on
    sends_bwd = sum(1 for s in mine if s > 0)  # stages that pass gradients back
    dt = _stage_dtype(run)
    act = (run.batch // M) * (run.seq // tp) * cfg.hidden * DTYPE_BYTES[dt]
    rows = []
    if pp == 1:  # every stage on this rank: each hands its output to the next in memory
        sends_fwd = sends_bwd = 0
    for op, k_act, k_grad in (("send", sends_fwd, sends_bwd), ("recv", sends_bwd, sends_fwd)):
        if k_act:
            rows.append(_row(op, "forward", "activations", k_act * M, act, dt))
        if k_grad:
            rows.append(_row(op, "backward", "activation gradients", k_grad * M, act, dt))
        if step == 1 and k_act + k_grad:
            rows.append(_row(op, "first step", "warm-up vote", k_act + k_grad, 4, "int32"))
    rows = [dict(r, group="pp") for r in rows]
    if dp > 1:
        dts = fsdp_dtypes(run)
        ag, rs = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]]
        for s, (name, shapes, k) in _rank_units(cfg, pp, rank, virtual, split, variant, tp):
            padded = sum(shard_numel(shape, dp, 0)[1] for shape in shapes)
            rows += [dict(_row("all_gather", "forward", f"stage {s} {name}", k, dp * padded * ag, dts["all_gather"]),
                          group="dp"),
                     dict(_row("reduce_scatter", "backward", f"stage {s} {name}", k, dp * padded * rs, dts["reduce"]),
                          group="dp")]
    if tp > 1:
        for s in mine:
            rows += tp_stage_rows(cfg, run, per_stage[s], s == 0, s == n - 1, tp, dp, M, optimizer, variant)
    return rows


def tp_stage_rows(cfg: ModelConfig, run: Run, layers: int, first: bool, last: bool, tp: int, dp: int,
                  microbatches: int, optimizer: str = "adamw", variant: str = "baseline") -> list[dict]:
    """TP's collectives of one stage in one step, group "tp": TP alone's (calculator.tensor_parallel.
    tp_collectives) for the stage's share of the model, run once per micro-batch on its (mb, seq, hidden)
    activations: per Block an all-gather before attention and before the MLP and a reduce-scatter after o and
    after down, in backward the reverse of each, and recompute's re-run collectives (the efficient variant); the
    embedding's reduce-scatter on the first stage, the head's all-gather and the loss's fp32 all-reduces on the
    last (loss_parallel's three, or three per chunk of the efficient variant's vocab-parallel fused linear
    cross-entropy on the micro-batch's rows: tensor_parallel.loss_all_reduces). The norms' Partial weight
    gradients accumulate over the micro-batches with no communication and are all-reduced as under TP alone: once
    by FSDP (dp > 1), on its unsharded gradient in its reduce dtype, else at each read of the optimizer's step."""
    check_optimizer(optimizer, tp, dp)
    dts = fsdp_dtypes(run) if dp > 1 else None
    compute = dts["all_gather"] if dts else param_dtype_name(run)
    M, cb = microbatches, DTYPE_BYTES[compute]
    mb = replace(run, batch=run.batch // microbatches)
    act = mb.batch * run.seq * cfg.hidden * cb
    gathers, scatters = 2 * layers + last, 2 * layers + first  # forward's, per micro-batch
    rows = [_row("all_gather", "forward", "attn, mlp, head inputs", gathers, act, compute),
            _row("reduce_scatter", "forward", "embed, o, down outputs", scatters, act, compute),
            _row("all_gather", "backward", "embed, o, down output grads", scatters, act, compute),
            _row("reduce_scatter", "backward", "attn, mlp, head input grads", gathers, act, compute),
            *recompute_collectives(mb, layers, act, compute)]
    if last:
        rows += loss_all_reduces(cfg, mb, tp, cb, variant)
    rows = [dict(r, count=r["count"] * M) for r in rows]  # each micro-batch's
    reads = 1 if dp > 1 else OPTIMIZER_GRAD_READS[optimizer]
    phase = "backward" if dp > 1 else "optimizer"
    # under FSDP the Partial gradients are redistributed on FSDP's unsharded gradient, in its reduce dtype
    gd = dts["reduce"] if dts else compute
    gb = DTYPE_BYTES[gd]
    rows.append(_row("all_reduce", phase, "norm weight grads", (2 * layers + last) * reads, cfg.hidden * gb, gd))
    if cfg.qk_norm:
        rows.append(_row("all_reduce", phase, "q/k norm weight grads", 2 * layers * reads, cfg.head_dim * gb, gd))
    return [dict(r, group="tp") for r in rows if r["count"]]
