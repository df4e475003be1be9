"""The pipeline schedules' order on one rank, and what it holds in flight. Pure Python: no torch.

The order is torch.distributed.pipelining's (torch 2.13), action for action:
  1f1b              Schedule1F1B: stage r runs w = min(m, pp - r) forwards, then backward-forward pairs while
                    forwards remain, then the remaining backwards (schedules.py Schedule1F1B._step_microbatches);
  interleaved-1f1b  ScheduleInterleaved1F1B: w = min((v - 1) * m_r + 2 (pp - 1 - r), v m) warm-up forwards, with
                    m_r = m / max(1, m // pp) micro-batches per round, then forward-backward pairs, then the
                    remaining backwards; the forward op k runs local stage (k // m_r) % v, the backward op k local
                    stage v - 1 - ((k - w) // m_r) % v, each stage's micro-batches in order
                    (_get_warmup_ops, _get_1f1b_rank_ops).
A chunk (stage, micro-batch) holds its saved activations from its forward to its backward; since a forward only
adds saved tensors and a backward only frees them, the most a rank holds is reached at the end of a forward.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from itertools import accumulate
from math import prod

from llm_anatomy.mesh_rules import check_microbatches, check_schedule, rank_stages, stage_sizes
from llm_anatomy.calculator.types import BYTES, ROPE_TABLES
from llm_anatomy.config import ModelConfig, Run


@lru_cache(maxsize=64)  # a plan asks for one rank's order at every micro-batch size and policy it tries
def order(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> tuple[tuple[str, int, int], ...]:
    """This rank's compute actions in execution order: ("F" | "B", stage, micro-batch)."""
    check_schedule(schedule, virtual)
    check_microbatches(schedule, pp, microbatches)
    M, stages = microbatches, rank_stages(pp, rank, virtual)
    if schedule == "1f1b":
        w = min(M, pp - rank)
        seq = ["F"] * w + ["B", "F"] * (M - w) + ["B"] * w
        f = b = 0
        out = []
        for kind in seq:
            out.append((kind, rank, f if kind == "F" else b))
            f, b = (f + 1, b) if kind == "F" else (f, b + 1)
        return tuple(out)
    per_round = M // max(1, M // pp)
    total = virtual * M
    w = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), total)
    nxt_f: dict[int, int] = {}
    nxt_b: dict[int, int] = {}

    def fwd(k):
        s = stages[(k // per_round) % virtual]
        nxt_f[s] = nxt_f.get(s, -1) + 1
        return ("F", s, nxt_f[s])

    def bwd(k):
        s = stages[virtual - 1 - ((k - w) // per_round) % virtual]
        nxt_b[s] = nxt_b.get(s, -1) + 1
        return ("B", s, nxt_b[s])

    out = []
    for k in range(total):
        if k < w:
            out.append(fwd(k))
        else:
            out += [fwd(k), bwd(k)]
    out += [bwd(k) for k in range(total, total + w)]
    return tuple(out)


@lru_cache(maxsize=64)
def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> int:
    """The most chunks (stage, micro-batch) whose activations this rank holds at once."""
    held = peak = 0
    for kind, _, _ in order(schedule, pp, rank, microbatches, virtual):
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a step when every chunk's forward and backward take the same time on every rank:
    (pp - 1) / (v m + pp - 1) (a 1F1B step lasts m + pp - 1 forward-backward slots, pp - 1 of them idle; the
    interleaved one's slots are v times shorter and it has v m of them)."""
    check_schedule(schedule, virtual)
    check_microbatches(schedule, pp, microbatches)
    return (pp - 1) / (virtual * microbatches + pp - 1)


# the saved tensors that are views of the step's batch: torch's schedule splits the batch into micro-batches with
# tensor_split, so a micro-batch's ids (saved by the embedding) and targets (saved by the loss) share the batch's
# storage, held once while any chunk of that stage is in flight
_BATCH_VIEWS = ("embedding.ids", "loss.targets")
# FSDP2's MixedPrecisionPolicy casts every floating-point forward input of a unit to its param_dtype
# (cast_forward_inputs): the efficient variant's fp32 RoPE tables (types.ROPE_TABLES) reach each Block as its own
# bf16 copy
MASK = "attention.sdpa.mask"  # the efficient attention's additive masks, one per kind a forward's layers use


def stage_saved_bytes(cfg: ModelConfig, mb_run: Run, layers: int, first: bool, last: bool,
                      variant: str = "baseline", device: str = "cpu", fsdp_cast: bool = False,
                      norm_run: Run | None = None, masks: int | None = None) -> tuple[int, dict]:
    """What one micro-batch (mb_run) saves in a stage of `layers` Blocks: (bytes of its own tensors, {name: elements}
    of its saved views of the batch). Its own: each per-layer saved tensor of the single-process model
    (calculator.estimate) per Block, the RoPE tables once (each stage's forward builds its own), the embedding's on
    the first stage, the final norm's and the loss's on the last. fsdp_cast: the Blocks are FSDP units under a bf16
    MixedPrecisionPolicy, so fp32 RoPE tables are saved as a bf16 copy per Block. norm_run: the run the norms, and
    recompute's kept residual stream and branch (tensor_parallel.SEQ_SHARDED), see when it is not mb_run (sequence
    parallel runs them on the rank's seq / tp rows). masks: the efficient attention's additive masks the stage's
    forward builds (one per kind among its layers: attention.mask_kinds), where not the whole model's."""
    from llm_anatomy.calculator import estimate
    from llm_anatomy.calculator.tensor_parallel import SEQ_SHARDED

    L, n, views = cfg.layers, 0, {}
    comps = estimate(cfg, mb_run, variant, device=device).components
    shard = estimate(cfg, norm_run, variant, device=device).components if norm_run is not None else comps
    for c in comps.values():
        on_shard = [s for s in shard[c.name].saved if c.name == "norm" or s.name in SEQ_SHARDED]
        for s in on_shard + [s for s in c.saved if not (c.name == "norm" or s.name in SEQ_SHARDED)]:
            b = prod(s.shape) * BYTES[s.dtype]
            if c.name in ("embedding", "loss"):
                if (first if c.name == "embedding" else last):
                    if s.name in _BATCH_VIEWS:
                        views[s.name] = BYTES[s.dtype]
                    else:
                        n += b * s.count
            elif fsdp_cast and s.name in ROPE_TABLES and s.dtype == "float32":
                n += b // 2 * layers
            elif s.name == MASK and masks is not None:
                n += b * masks
            else:
                per_layer, rest = divmod(s.count, L)
                n += b * per_layer * layers
                if rest:  # the final norm's (last stage), or what every forward makes once (the RoPE tables)
                    n += b * rest if (c.name != "norm" or last) else 0
    return n, views


def saved_peak(cfg: ModelConfig, run: Run, pp: int, rank: int, *, microbatches: int, schedule: str = "1f1b",
               virtual: int = 1, split=None, variant: str = "baseline", device: str = "cpu", tp: int = 1) -> int:
    """The most bytes of saved activations this rank holds at once over a step (run.batch split into
    `microbatches`). Under the amp policy the stages run FSDP's bf16 parameters, which is the bf16 policy's compute.
    tp > 1: a chunk saves what TP alone saves for its layers (calculator.tensor_parallel.tp_saved): the one-GPU
    tensors on the rank's share of heads, intermediate and vocab (tp_local_config), the norms' and recompute's
    kept residual stream at seq / tp. Each stage's forward builds the masks its own layers use (mask_kinds)."""
    from llm_anatomy.calculator.attention import mask_kinds
    from llm_anatomy.calculator.tensor_parallel import tp_local_config

    per_stage = stage_sizes(cfg.layers, pp, virtual, split)
    n = len(per_stage)
    mb = replace(run, batch=run.batch // microbatches, dtype="bf16" if run.dtype == "amp" else run.dtype)
    cast = run.dtype == "amp"  # amp runs as FSDP's MixedPrecisionPolicy (dp > 1)
    local, norm_run = (tp_local_config(cfg, tp), replace(mb, seq=mb.seq // tp)) if tp > 1 else (cfg, None)
    first = list(accumulate(per_stage, initial=0))  # each stage's first layer: a stage is a range of layers
    chunk = {s: stage_saved_bytes(local, mb, per_stage[s], s == 0, s == n - 1, variant, device, cast, norm_run,
                                  mask_kinds(cfg, range(first[s], first[s + 1])))
             for s in rank_stages(pp, rank, virtual)}
    batch_view = run.batch * run.seq  # elements of the batch's ids or targets
    views = {s: batch_view * sum(v.values()) for s, (_, v) in chunk.items()}  # held while a chunk of s is in flight
    if len(chunk) == 1:  # one stage on the rank: its most chunks in flight, and the batch's views
        (s,) = chunk
        return in_flight(schedule, pp, rank, microbatches, virtual) * chunk[s][0] + views[s]
    own = {s: c[0] for s, c in chunk.items()}
    held, shared, live, peak = 0, 0, {s: 0 for s in chunk}, 0
    for kind, s, _ in order(schedule, pp, rank, microbatches, virtual):
        if kind == "F":  # a forward only adds, a backward only frees: the peak is at a forward's end
            held += own[s]
            if not live[s]:
                shared += views[s]
            live[s] += 1
            if held + shared > peak:
                peak = held + shared
        else:
            held -= own[s]
            live[s] -= 1
            if not live[s]:
                shared -= views[s]
    return peak
