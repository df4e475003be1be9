"""The memory phases of one rank under tensor parallel (x FSDP2) and pipeline parallel (x FSDP2). Pure Python: no torch.

The setups are llm_anatomy/distributed/tensor_parallel.py's (DTensor: column/row-wise linears, sequence parallel on
the norms, vocab-parallel embedding and loss_parallel; FSDP2 over dp on the TP-local tensors) and
llm_anatomy/distributed/pipeline_parallel.py's (torch.distributed.pipelining, FSDP2 per stage). The phases, as
memory.phases names them, on device "cpu" (exact storage bytes, what live storage counts) or "cuda" (every tensor
rounded to the allocator's 512-byte blocks):

  tensor parallel (tp_phases), after the first step (the optimizer state exists):
    forward end     parameters (the TP-local shards; under FSDP the padded dim-0 shards) + optimizer state + the
                    (B, S) ids and targets + every tensor the rank saves for backward (calculator/tensor_parallel.py
                    tp_saved's rule: the one-GPU model's saved tensors on the rank's heads, MLP columns and
                    vocabulary rows, the norms' and recompute's kept residual stream on seq / tp rows) + the loss
                    (an fp32 scalar)
                    + under FSDP the root's unsharded parameters (it does not reshard after forward), and every
                    Block's when reshard_after_forward is off
                    + the DeviceMesh's rank tensor, which its tp and dp sub-meshes share (int32, one element per
                    rank of the dp x tp world)
                    = forward_end_held, what the rank holds. `retained` prices, for the bound only, two
                    collectives' outputs as three tensors each: the embedding's reduce-scatter ((B, S / tp, H))
                    and the head's all-gather ((B, S, H)), in the compute dtype; the graph hands them on as
                    AsyncCollectiveTensor wrappers, which hold no storage of their own (live storage counts each
                    at its buffer: distributed/peak.py), so the measurement is forward_end_held.
    backward end    parameters + gradients (tensor_parallel.tp_rank_memory's rule) + optimizer state + inputs + mesh
    optimizer end   the gradients set to None: parameters + optimizer state + inputs + mesh
    peak            an upper bound, stated in tp_peak_bound (below)

  pipeline parallel (pp_phases), rank `rank` of the pipeline:
    step end        parameters + gradients + optimizer state of the rank's stages (pipeline_parallel.pp_rank_memory)
                    + the ids and targets + the receive buffers torch's PipelineStage keeps for every micro-batch:
                    a (micro-batch, S, H) activation for each stage with a previous stage, the same for its gradient
                    for each stage with a next one, in the stage dtype
    optimizer end   the gradients set to None
    peak            an upper bound: step end + the saved activations the schedule holds at most at once
                    (pipeline_schedule.saved_peak, exact on gloo) + the outputs in-flight micro-batches keep for
                    their backward + one micro-batch's transients (_pp_transients)
    with tp > 1     (TP inside the stages, either variant) step end and optimizer end on the TP-local state, the
                    receive buffers at seq / tp and the tp sub-mesh's rank tensor, exact; the peak is the
                    planner's figure on the TP-local model, not a measured bound
Measured: validations/test_tp_memory.py, test_pp_tp_efficient.py (PP x TP phase ends) (live storage on gloo ranks:
distributed/mesh_peak.py).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from llm_anatomy.calculator.sharding import DTYPE_BYTES, param_dtype_name
from llm_anatomy.calculator.types import BYTES, ROPE_TABLES
from llm_anatomy.config import ConfigError, ModelConfig, Run

MESH_RANK_BYTES = 4  # DeviceMesh keeps its ranks as an int32 tensor; a DTensor's mesh keeps it alive


def _rounder(device: str):
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, got {device!r}")
    from llm_anatomy.calculator.allocator import rounded

    return rounded if device == "cuda" else (lambda n: n)


def _compute_run(run: Run, dp: int) -> Run:
    """The run as the rank computes it: amp on a mesh is FSDP's policy, bf16 parameters without autocast (the bf16
    policy); the engine runs it with dp > 1 only, the planner prices it at any dp."""
    return replace(run, dtype="bf16") if run.dtype == "amp" else run


def _saved(cfg: ModelConfig, run: Run, tp: int, dp: int, rnd, variant: str = "baseline") -> int:
    """Bytes of the tensors the rank saves for backward, each rounded (tp_saved's rule, tensor by tensor: the norms'
    and recompute's kept residual stream at seq / tp, the efficient variant's fp32 RoPE tables a bf16 copy per
    Block under FSDP's amp)."""
    from llm_anatomy.calculator import estimate
    from llm_anatomy.calculator.backward import INPUTS
    from llm_anatomy.calculator.tensor_parallel import SEQ_SHARDED, tp_local_config

    crun = _compute_run(run, dp)
    local = tp_local_config(cfg, tp)
    full = estimate(local, crun, variant, device="cpu").components
    shard = estimate(local, replace(crun, seq=run.seq // tp), variant, device="cpu").components
    cast = run.dtype == "amp" and dp > 1
    total = 0
    for name, comp in full.items():
        on_shard = lambda s: name == "norm" or s.name in SEQ_SHARDED  # noqa: E731
        for s in [s for s in shard[name].saved if on_shard(s)] + [s for s in comp.saved if not on_shard(s)]:
            if s.name in INPUTS:
                continue
            if cast and s.name in ROPE_TABLES and s.dtype == "float32":
                total += rnd(prod(s.shape) * BYTES["bfloat16"]) * cfg.layers
            else:
                total += rnd(prod(s.shape) * BYTES[s.dtype]) * s.count
    return total


def _model_state(cfg: ModelConfig, run: Run, tp: int, dp: int, rank: int, optimizer: str, rnd,
                 variant: str = "baseline") -> dict:
    """Parameters, gradients (after backward) and optimizer state of the rank, each tensor rounded: without FSDP
    every tensor its own storage; under FSDP each parameter its padded shard, each unit's gradients one flat
    reduce-scatter output (calculator/sharding.py)."""
    from llm_anatomy.calculator.fsdp_shards import shard_numel
    from llm_anatomy.calculator.tensor_parallel import tp_unit_shapes

    pb, dr = BYTES[param_dtype_name(run)], rank // tp
    params = grads = opt = 0
    for unit, shapes in tp_unit_shapes(cfg, tp, variant):
        k = cfg.layers if unit == "block" else 1
        flat = 0
        for name, s in shapes:
            lo, pa = shard_numel(s, dp, dr) if dp > 1 else (prod(s), prod(s))
            params += k * rnd(pa * pb)
            flat += pa
            if dp == 1:  # an untied embedding's gradient is Replicate under TP: the whole table
                whole = tp > 1 and name == "embed.weight" and not cfg.tie_embeddings
                grads += k * rnd((cfg.vocab * cfg.hidden if whole else pa) * pb)
            opt += k * _state(optimizer, lo, pb, rnd)
        if dp > 1:
            grads += k * rnd(flat * pb)
    return dict(params=params, grads=grads, optimizer=opt)


def _state(optimizer: str, numel: int, pb: int, rnd) -> int:
    """One tensor's optimizer state: AdamW's two moments in the parameter dtype and its 4-byte step; SGD none;
    AdEMAMix's fp32 state (calculator/optimizer.py)."""
    from llm_anatomy.calculator.optimizer import state_breakdown

    if optimizer == "adamw":
        return 2 * rnd(numel * pb) + rnd(4)
    return sum(rnd(int(numel * b)) for b in state_breakdown(optimizer).values())


def _unsharded(cfg: ModelConfig, run: Run, tp: int, dp: int, rank: int, rnd, variant: str = "baseline") -> dict:
    """FSDP2's buffers per unit ("root", "block") of the TP-local tensors: G the unsharded parameters (padded rows x
    dp, in the all-gather dtype, each its own tensor), R the reduce-scatter input (the same elements in the reduce
    dtype, one flat tensor), U the unsharded gradients (the TP-local tensors, in the all-gather dtype)."""
    from llm_anatomy.calculator.fsdp_shards import shard_numel
    from llm_anatomy.calculator.sharding import fsdp_dtypes
    from llm_anatomy.calculator.tensor_parallel import tp_unit_shapes

    dts = fsdp_dtypes(run)
    ag, rs = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]]
    out = {}
    for unit, shapes in tp_unit_shapes(cfg, tp, variant):
        padded = [dp * shard_numel(s, dp, rank // tp)[1] for _, s in shapes]
        out[unit] = dict(G=sum(rnd(n * ag) for n in padded), R=rnd(sum(padded) * rs),
                         U=sum(rnd(prod(s) * ag) for _, s in shapes))
    return out


def tp_phases(cfg: ModelConfig, run: Run, tp: int, dp: int = 1, *, rank: int = 0, optimizer: str = "adamw",
              reshard_after_forward: bool = True, device: str = "cuda", variant: str = "baseline",
              plan: bool = False) -> dict:
    """Bytes rank `rank` of a (dp, tp) mesh holds at each phase boundary of a training step after the first, and
    the step's peak (an upper bound: tp_peak_bound). run is the rank's micro-batch.

    plan=True prices what the planner may propose beyond what the engine runs today (llm_anatomy.mesh_rules):
    the efficient variant on the same split (its one-GPU saved tensors and transients on the rank's shard), and
    amp without FSDP as FSDP's policy; widths and seq must still split over tp."""
    from llm_anatomy.calculator.tensor_parallel import check_optimizer
    from llm_anatomy.mesh_rules import check_mesh, check_run

    check_mesh(cfg, tp, dp, variant="baseline" if plan else variant)
    check_run(run if not plan else replace(run, dtype="bf16" if run.dtype == "amp" else run.dtype), tp, dp)
    if not plan:
        check_optimizer(optimizer, tp, dp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp * dp:
        raise ConfigError(f"rank must be in [0, {tp * dp}), got {rank!r}")
    rnd = _rounder(device)
    crun = _compute_run(run, dp)
    c = BYTES[param_dtype_name(crun)]  # the compute dtype: amp computes in bf16 on a mesh
    state = _model_state(cfg, run, tp, dp, rank, optimizer, rnd, variant)
    # the (dp, tp) DeviceMesh (distributed/tensor_parallel.py) keeps its ranks as one int32 tensor that its dp and
    # tp sub-meshes share (torch 2.13): one element per rank of the world
    mesh = rnd(MESH_RANK_BYTES * dp * tp) if dp * tp > 1 else 0
    inputs = 2 * rnd(8 * run.tokens)
    # the collectives whose buffers the graph may keep until backward (RETAINED): three tensors each
    rs, ag = (3 * rnd(run.tokens // tp * cfg.hidden * c), 3 * rnd(run.tokens * cfg.hidden * c)) if tp > 1 else (0, 0)
    gathered = 0
    if dp > 1:
        un = _unsharded(cfg, run, tp, dp, rank, rnd, variant)
        gathered = un["root"]["G"] + (0 if reshard_after_forward else cfg.layers * un["block"]["G"])
    base = state["params"] + state["optimizer"] + inputs + mesh
    saved = _saved(cfg, run, tp, dp, rnd, variant)
    fwd_exact = base + saved + rnd(4) + gathered
    bwd_end = base + state["grads"]
    out = dict(params=state["params"], grads=state["grads"], optimizer=state["optimizer"], inputs=inputs,
               mesh=mesh, saved=saved, gathered=gathered, reshard_after_forward=reshard_after_forward,
               forward_end_held=fwd_exact,
               retained=dict(embedding_reduce_scatter=rs, head_all_gather=ag), forward_end=fwd_exact + rs + ag,
               backward_end=bwd_end, optimizer_end=base)
    out.update(tp_peak_bound(cfg, run, tp, dp, out, device, variant))
    return out


def tp_peak_bound(cfg: ModelConfig, run: Run, tp: int, dp: int, ph: dict, device: str,
                  variant: str = "baseline") -> dict:
    """The step's peak on the rank, an upper bound: the largest of three candidates, each the exact phase bytes it
    starts from plus the transients of the one-GPU model on the rank's shard (memory.phases on tp_local_config,
    which prices the norms and the residual stream at full seq where sequence parallel holds seq / tp) and the
    collectives' buffers:
      forward   forward end, with both retained collectives, + the baseline loss's transients on V / tp (the final
                norm's output, the logits and their fp32 copy, the causal bias) + loss_parallel's log_softmax, which
                makes its shifted logits and their exp, two (T, V / tp) fp32 tensors, before its log-probs (the
                efficient variant's vocab-parallel head instead: _loss_transients);
      backward  the exact state (parameters, optimizer state, inputs, mesh), the unsharded parameters FSDP holds
                after forward, both retained collectives, + the walk's largest moment on the shard (its saved
                activations, at most what the rank's forward end holds beyond its state: backward makes no
                activation, so the walk's full-seq norms and residual stream are capped by the exact sequence-
                parallel figure; and its gradients made so far or all of the rank's gradients, the larger) + one
                backward all-gather's three (T, H) tensors and a reduce-scatter's (T, H) input, + the embedding's whole (V, H)
                gradient, which DTensor returns Replicate (a transient unless it is the untied table's own .grad
                without FSDP); under FSDP + two Blocks'
                gathered parameters (the Block in backward and the one prefetched; without resharding they are
                held from forward already), a unit's unsharded gradients and its reduce-scatter input (twice on
                CPU: gloo reduces a copy);
      optimizer backward end + the optimizer step's temporaries (calculator/sharding.py's rule: torch's per-tensor
                AdamW on CPU makes two of the largest local tensor) + without FSDP, a norm's Partial gradient
                all-reduced to Replicate (and its collective's output) at each read.
    Measured against live storage on gloo (validations/test_tp_memory.py): the bound holds and is stated there."""
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.calculator.tensor_parallel import tp_local_config

    rnd = _rounder(device)
    crun = _compute_run(run, dp)
    local = tp_local_config(cfg, tp)
    one = phases(local, crun, variant, optimizer=None, device=device, stages=False)
    T, c = run.tokens, BYTES[param_dtype_name(crun)]
    retained = sum(ph["retained"].values())
    head = _loss_transients(cfg, run, tp, c, variant, device, rnd) if tp > 1 else 0
    forward = ph["forward_end"] + ((one["forward_peak"] or one["forward_end"]) - one["forward_end"]) + head
    by = one["backward_peak_by_kind"]
    coll = 4 * rnd(T * cfg.hidden * c) if tp > 1 else 0
    fsdp = 0
    if dp > 1:
        un = _unsharded(cfg, run, tp, dp, 0, rnd, variant)
        copy = 2 if device == "cpu" else 1  # gloo's reduce_scatter_tensor works on a copy of its input
        # the root's parameters, and without resharding every Block's, are in `gathered` already
        regather = 2 * un["block"]["G"] if ph["reshard_after_forward"] else 0
        fsdp = regather + copy * max(un["root"]["R"], un["block"]["R"]) + max(un["root"]["U"], un["block"]["U"])
    state = ph["params"] + ph["optimizer"] + ph["inputs"] + ph["mesh"]
    grads = max(by["gradient / backward buffer"], ph["grads"])
    # DTensor's embedding backward returns the whole (V, H) table's gradient Replicate: the rank's gradient where the
    # embedding is untied and unsharded (counted in grads), else a transient before it is summed or reduced
    whole = tp > 1 and not (dp == 1 and not cfg.tie_embeddings)
    table = rnd(cfg.vocab * cfg.hidden * c) if whole else 0
    # the activations alive in backward are forward's, freed as backward goes: at most the forward end's, exactly
    held = ph["forward_end_held"] - state - ph["gathered"]
    backward = state + ph["gathered"] + retained + min(by["activation"], held) + grads + coll + fsdp + table
    # without FSDP each read of a norm's Partial gradient makes its all-reduced copy
    partial = 2 * rnd(cfg.hidden * BYTES[param_dtype_name(run)]) if tp > 1 and dp == 1 else 0
    optimizer = ph["backward_end"] + _optimizer_temporaries(cfg, run, tp, dp, device, rnd, variant) + partial
    cands = dict(forward=forward, backward=backward, optimizer=optimizer)
    at = max(cands, key=cands.get)
    return dict(peak=cands[at], peak_at=at, peak_candidates=cands)


def _loss_transients(cfg: ModelConfig, run: Run, tp: int, c: int, variant: str, device: str, rnd) -> int:
    """What the head's loss makes under TP beyond the one-GPU loss on the rank's V / tp: loss_parallel's shifted
    logits and their exp, two (T, V / tp) fp32 tensors (baseline); for the efficient variant's vocab-parallel fused
    linear cross-entropy the target columns, (T,) int64, and five (C,) fp32 vectors of a chunk
    (tensor_parallel.vocab_parallel_ce_bytes), and on CPU its plain-torch row passes' fp32 working copies of a
    chunk, two (C, V / tp) at most."""
    from llm_anatomy.calculator.tensor_parallel import head_chunks

    T, Vr = run.tokens, cfg.vocab // tp
    if variant != "efficient":
        return 2 * rnd(T * Vr * 4)
    C = max(head_chunks(cfg, run, tp, c), default=0)
    return rnd(8 * T) + 5 * rnd(4 * C) + (2 * rnd(4 * C * Vr) if device == "cpu" else 0)


def _optimizer_temporaries(cfg: ModelConfig, run: Run, tp: int, dp: int, device: str, rnd,
                           variant: str = "baseline") -> int:
    """torch's per-tensor AdamW on CPU: exp_avg_sq.sqrt() and its quotient, two of the largest local tensor at once
    (fused AdamW on CUDA makes none)."""
    from llm_anatomy.calculator.sharding import shard_numel
    from llm_anatomy.calculator.tensor_parallel import tp_unit_shapes

    if device != "cpu":
        return 0
    largest = max(shard_numel(s, dp, 0)[0] if dp > 1 else prod(s) for _, shapes in tp_unit_shapes(cfg, tp, variant)
                  for _, s in shapes)
    return 2 * rnd(largest * BYTES[param_dtype_name(run)])


# ---- pipeline parallel -----------------------------------------------------------------------------------------
def pp_phases(cfg: ModelConfig, run: Run, pp: int, rank: int, dp: int = 1, *, microbatches: int,
              schedule: str = "1f1b", virtual: int = 1, split=None, optimizer: str = "adamw",
              device: str = "cuda", variant: str = "baseline", tp: int = 1) -> dict:
    """Bytes pipeline rank `rank` (dp rank 0 of its row) holds at the end of a step's schedule and of its optimizer
    step, and the step's peak (an upper bound), run.batch split into `microbatches`. Exact on CPU: step_end and
    optimizer_end; the model state is pipeline_parallel.pp_rank_memory's (each tensor rounded on CUDA only in
    total, the state being few large tensors).

    tp > 1 (tensor parallel inside the stages): the TP-local model state (pp_rank_memory with tp), the receive
    buffers at the sequence shard (micro-batch, S / tp, H), and the tp sub-mesh's rank tensor; the peak is priced on the TP-local model (tensor_parallel.tp_local_config, as the planner
    prices it: calculator/mesh.py) and is not measured under tp."""
    from llm_anatomy.calculator.pipeline_parallel import pp_rank_memory
    from llm_anatomy.calculator.pipeline_schedule import in_flight, saved_peak
    from llm_anatomy.calculator.tensor_parallel import tp_local_config
    from llm_anatomy.mesh_rules import check_pipeline, rank_stages

    per_stage = check_pipeline(cfg, run, pp, dp, schedule, microbatches, virtual, split)
    rnd = _rounder(device)
    n, M = len(per_stage), microbatches
    mem = pp_rank_memory(cfg, run, pp, rank, dp, virtual=virtual, split=split, optimizer=optimizer, variant=variant,
                         tp=tp)
    mine = rank_stages(pp, rank, virtual)
    # one micro-batch's activation between stages (its sequence shard under tp)
    act = rnd((run.batch // M) * (run.seq // tp) * cfg.hidden * (4 if run.dtype == "fp32" else 2))
    # PipelineStage's receive buffers, one per micro-batch: activations into a stage with a previous one,
    # gradients into a stage with a next one
    buffers = M * act * sum((s > 0) + (s < n - 1) for s in mine) if pp > 1 else 0
    inputs = 2 * rnd(8 * run.tokens)
    # the tp sub-mesh the engine slices (distributed/pipeline_tp.tp_stages) keeps its layout's rank tensor: every
    # tp group's ranks, one int32 per rank of the (pp, dp, tp) world (the pp and dp sub-meshes exist before the
    # model: distributed/mesh_peak.pp_peaks)
    mesh = rnd(MESH_RANK_BYTES * pp * dp * tp) if tp > 1 else 0
    state = rnd(mem["params"]) + rnd(mem["optimizer"]) + inputs + buffers + mesh
    step_end = state + rnd(mem["grads"])
    saved = saved_peak(cfg, run, pp, rank, microbatches=M, schedule=schedule, virtual=virtual, split=split,
                       variant=variant, device=device, tp=tp)
    # a stage keeps each in-flight micro-batch's output for its backward (stage.fwd_cache) where a stage follows
    outputs = in_flight(schedule, pp, rank, M, virtual) * act if any(s < n - 1 for s in mine) else 0
    local = tp_local_config(cfg, tp) if tp > 1 else cfg
    trans = _pp_transients(local, run, M, max(per_stage[s] for s in mine), any(s == n - 1 for s in mine), dp,
                           device, variant)
    peak = step_end + saved + outputs + trans
    return dict(params=mem["params"], grads=mem["grads"], optimizer=mem["optimizer"], inputs=inputs,
                buffers=buffers, mesh=mesh, saved_peak=saved, outputs=outputs, transients=trans,
                step_end=step_end, optimizer_end=state, peak=peak)


def _pp_transients(cfg: ModelConfig, run: Run, microbatches: int, layers: int, last: bool, dp: int,
                   device: str, variant: str = "baseline") -> int:
    """What one micro-batch's forward or backward makes beyond the saved tensors, on the rank's largest stage
    (memory.phases of the one-GPU model of that many layers on a micro-batch): the loss's transients on the last
    stage (with each micro-batch's loss, which the schedule keeps, and its targets' chunk), the walk's gradient and
    backward buffers (which include its parameters' gradients, held whole here already: a stated over-count)."""
    from llm_anatomy.calculator.memory import phases

    mb = replace(_compute_run(run, dp), batch=run.batch // microbatches)
    one = phases(replace(cfg, layers=layers), mb, variant, optimizer=None, device=device, stages=False)
    fwd = (one["forward_peak"] or one["forward_end"]) - one["forward_end"] if last else 0
    rnd = _rounder(device)
    # the last stage: each micro-batch's loss, which the schedule keeps to the step's end, and its targets' chunk
    kept = microbatches * (rnd(4) + rnd(8 * mb.tokens)) if last else 0
    return max(fwd, one["backward_peak_by_kind"]["gradient / backward buffer"]) + kept
