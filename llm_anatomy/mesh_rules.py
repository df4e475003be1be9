"""What a mesh can run and how it is cut: the refusals the engine side (llm_anatomy.distributed.tensor_parallel,
pipeline_parallel, expert_parallel) and the calculator (llm_anatomy.calculator.tensor_parallel, pipeline_parallel,
expert_parallel) both apply, each in one line naming the field, and the pipeline's stage split both build. Pure
Python.

The pipeline's stage split: which decoder layers each stage holds. Pure Python: no torch.

A split is part of the mesh description that the calculator, the planner and the training harness share, the way
a DeviceMesh shape is: the training side (llm_anatomy/distributed/pipeline_parallel.py) reads it from here, so both
sides build the same stages. It is a choice, not a prediction.

Stages: pp x virtual of them, stage s on pipeline rank s % pp (torch.distributed.pipelining's placement for
Schedule1F1B, one stage per rank, and ScheduleInterleaved1F1B, `virtual` stages per rank, looped). The embedding
is on stage 0, the final norm, head and loss on the last stage.

The default (balanced) split gives every stage layers // stages layers; the remainder goes one each to the stages
that hold neither the embedding nor the head, in order, then to stage 0 (an embedding is a lookup), and last to
the final stage (the head's matmul and the loss are the heaviest non-layer work).
"""
from __future__ import annotations

from llm_anatomy.config import ConfigError, ModelConfig, Run


def _pos(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def check_mesh(cfg: ModelConfig, tp: int, dp: int = 1, *, variant: str = "baseline", cp: int = 1,
               device: str = "cpu") -> None:
    """ConfigError (one line, naming the field) for a (dp, tp) mesh the plan cannot shard this model over."""
    for name, v in (("tp", tp), ("dp", dp), ("cp", cp)):
        _pos(name, v)
    if cp > 1 and device == "cpu":
        raise ConfigError("cp > 1 needs CUDA: torch's context_parallel shards SDPA's flash/efficient/cuDNN "
                          "kernels; CPU's SDPA (_scaled_dot_product_flash_attention_for_cpu) has no sharding rule")
    if cp > 1:
        raise ConfigError("cp > 1 is not built yet (see docs/parallelism.md)")
    if tp == 1:
        return
    if variant not in ("baseline", "efficient"):
        raise ConfigError(f"tp > 1 runs the baseline and efficient variants, not {variant!r}")
    if cfg.moe:
        raise ConfigError("tp > 1 does not shard mixture-of-experts layers (experts > 0)")
    if cfg.qk_norm_whole:  # sinks (per head), windows (one replicated mask) and o's bias shard: tensor_parallel.py
        raise ConfigError("tp > 1 does not shard OLMoE's whole q/k norm (qk_norm_whole): its mean spans every "
                          "head, and tp splits the heads")
    for field in ("heads", "kv_heads", "intermediate", "vocab"):
        if getattr(cfg, field) % tp:
            raise ConfigError(f"{field}={getattr(cfg, field)} is not divisible by tp={tp}")


def check_efficient_tp(tp: int, lean_block: bool) -> None:
    """ConfigError (one line) for the efficient model's options tp > 1 does not shard: the lean block hands a
    pending branch across Blocks and runs its own matmuls. Every recompute policy runs (the plan of
    distributed/tensor_parallel.py's efficient_block_plan puts the all-gathers inside the checkpoints)."""
    if tp > 1 and lean_block:
        raise ConfigError("tp > 1 runs the efficient variant without its lean block (--no-lean)")


def check_run(run: Run, tp: int, dp: int = 1, variant: str = "baseline") -> None:
    """ConfigError (one line) for a run the mesh cannot take: sequence parallel splits seq over tp evenly, amp
    needs FSDP's mixed-precision policy (dp > 1), and the efficient variant runs under tp > 1 without its lean
    block (check_efficient_tp) and with its own fused loss, not Liger's."""
    if tp > 1 and run.seq % tp:
        raise ConfigError(f"seq={run.seq} is not divisible by tp={tp} (sequence parallel splits it evenly)")
    if variant == "efficient":
        check_efficient_tp(tp, run.lean_block)
        if tp > 1 and run.loss_impl != "anatomy":  # distributed/tp_head.py: ours is the one vocab-parallel form
            raise ConfigError(f"tp > 1 runs the efficient variant's own fused loss (loss_impl anatomy), "
                              f"not {run.loss_impl!r}")
    if run.dtype == "amp" and dp == 1:
        raise ConfigError("dtype amp on a mesh needs dp > 1 (its policy is FSDP's mixed precision); use fp32 or bf16")


# ---- the pipeline's stage split ---------------------------------------------------------------------
SCHEDULES = ("1f1b", "interleaved-1f1b")


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return v


def check_schedule(schedule: str, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    _positive("virtual", virtual)
    if schedule == "1f1b" and virtual != 1:
        raise ConfigError(f"virtual must be 1 for schedule 1f1b (one stage per rank), got {virtual}")
    if schedule == "interleaved-1f1b" and virtual < 2:
        raise ConfigError(f"virtual must be >= 2 for schedule interleaved-1f1b (stages per rank), got {virtual}")


def stage_sizes(layers: int, pp: int, virtual: int = 1, split=None) -> list[int]:
    """Layers per stage, in stage order (pp x virtual stages)."""
    _positive("layers", layers)
    _positive("pp", pp)
    _positive("virtual", virtual)
    n = pp * virtual
    if split is not None:
        split = list(split) if isinstance(split, (list, tuple)) else split
        if not isinstance(split, list) or len(split) != n or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in split):
            raise ConfigError(f"split must list {n} positive layer counts (pp x virtual stages), got {split!r}")
        if sum(split) != layers:
            raise ConfigError(f"split must add up to the model's {layers} layers, got {sum(split)} ({split})")
        return split
    if layers < n:
        raise ConfigError(f"layers ({layers}) must be at least the number of pipeline stages, pp x virtual = {n}")
    sizes = [layers // n] * n
    order = list(range(1, n - 1)) + [0] + ([n - 1] if n > 1 else [])
    for s in order[: layers % n]:
        sizes[s] += 1
    return sizes


def stage_layers(layers: int, pp: int, virtual: int = 1, split=None) -> list[list[int]]:
    """The layer indices of each stage, in stage order; stage s runs on rank s % pp, so with virtual=1 this is
    one list per rank. split: a user-given layer count per stage (uneven splits), else the balanced default."""
    out, first = [], 0
    for k in stage_sizes(layers, pp, virtual, split):
        out.append(list(range(first, first + k)))
        first += k
    return out


def rank_stages(pp: int, rank: int, virtual: int = 1) -> list[int]:
    """The stage indices pipeline rank `rank` holds, in order."""
    _positive("pp", pp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise ConfigError(f"rank must be in [0, {pp}), got {rank!r}")
    return [rank + v * pp for v in range(virtual)]


def check_microbatches(schedule: str, pp: int, microbatches: int, batch: int | None = None) -> None:
    """ConfigError for a micro-batch count the schedule cannot run. 1F1B needs one per stage at least; interleaved 1F1B (torch's flexible form)
    needs microbatches to be a multiple of its rounds, max(1, microbatches // pp); a batch splits into equal
    micro-batches only when microbatches divides it."""
    _positive("microbatches", microbatches)
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"microbatches ({microbatches}) must be at least pp ({pp}) for schedule 1f1b")
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(f"microbatches ({microbatches}) must be a multiple of interleaved-1f1b's rounds, "
                              f"max(1, microbatches // pp) = {rounds}")
    if batch is not None and batch % microbatches:
        raise ConfigError(f"batch ({batch}) must be a multiple of microbatches ({microbatches}): "
                          f"every micro-batch has the same rows")


def check_pipeline(cfg: ModelConfig, run: Run, pp: int, dp: int, schedule: str, microbatches: int | None,
                   virtual: int, split) -> list[int]:
    """ConfigError (one line, naming the field) for a pipeline that cannot be run; else each stage's layer count
    (stage_sizes: its cost follows the stages, never the layers).
    microbatches None: the layout only (what a rank holds between steps does not depend on them)."""
    for name, v in (("pp", pp), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    check_schedule(schedule, virtual)
    if microbatches is not None:
        check_microbatches(schedule, pp, microbatches, run.batch)
    if pp > 1 and cfg.tie_embeddings:
        raise ConfigError(f"tie_embeddings: {cfg.name} ties its embedding and head, which stages 0 and "
                          f"{pp * virtual - 1} would both hold; pipeline parallel runs untied models")
    if run.dtype == "amp" and dp == 1:
        raise ConfigError("dtype amp under pipeline parallel runs as FSDP's MixedPrecisionPolicy: give dp >= 2, "
                          "or dtype fp32 or bf16")
    return stage_sizes(cfg.layers, pp, virtual, split)


def check_ep(cfg: ModelConfig, run: Run, ep: int, variant: str = "efficient", world: int | None = None) -> None:
    """ConfigError (one line, naming the field) for expert parallel over ep of `world` ranks (world None: ep = world)
    that is not run or modelled (llm_anatomy.distributed.expert_parallel, llm_anatomy.calculator.expert_parallel):
    ep divides the experts and the world; ep < world is the (efsdp, ep) mesh, efsdp = world / ep."""
    if variant != "efficient":
        raise ConfigError(f"expert parallel runs the efficient variant's MoE block, not {variant!r}")
    if not cfg.moe:
        raise ConfigError(f"expert parallel needs a mixture-of-experts config ({cfg.name} has experts=0)")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or cfg.experts % ep:
        raise ConfigError(f"ep must be a positive divisor of experts={cfg.experts}, got {ep!r}")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < ep or world % ep):
        raise ConfigError(f"ep={ep} must divide the world size (the ranks FSDP2 shards over), got world={world!r}")
