"""Per-rank parameter, gradient and optimizer bytes under DDP and FSDP2. Pure Python: no torch.

The parameter tensors are the baseline module tree's (calculator/param_layout.py), read per distinct
shape with its count, never per layer: the cost of every figure here is the same at any depth.

FSDP2's shards (dim 0's padded rows, or dim 1 for stacked experts with fewer experts than ranks): calculator/
fsdp_shards.py.
DDP keeps a full replica: params, grads (.grad, plus DDP's bucket copy, see comm.py) and state.
"""
from __future__ import annotations

from collections.abc import Callable
from math import prod

from llm_anatomy.calculator.dtypes import dtypes as dtypes_of
from llm_anatomy.calculator.fsdp_shards import fsdp_shard_dim, shard_numel
from llm_anatomy.calculator.optimizer import OPTIMIZERS, state_bytes
from llm_anatomy.calculator.param_layout import (Shape, fsdp_unit_shapes, n_tensors, param_shapes,  # noqa: F401
                                                 shape_counts, units)
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import ConfigError, ModelConfig, Run

STRATEGIES = ("ddp", "fsdp")
DTYPE_BYTES = {**BYTES, "int32": 4}
FIRST_BUCKET_BYTES = 1024 * 1024  # dist._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_CAP_MB = 25  # DDP's bucket_cap_mb default; DDP's "MB" is MiB (_MB_TO_BYTES = 1024 * 1024)
REDUCE_DTYPES = ("float32", "bfloat16")


def param_dtype_name(run: Run) -> str:
    """Storage dtype of the parameters (master weights): bf16 only under the 'bf16' policy."""
    return "bfloat16" if run.dtype == "bf16" else "float32"


def optimizer_bytes(optimizer: str, numel: int, n_tensors: int, param_bytes: int) -> int:
    """Optimizer state bytes for `numel` elements in `n_tensors` tensors.

    torch's AdamW keeps exp_avg / exp_avg_sq in the parameter's dtype (2 x 2 B for bf16 params);
    AdEMAMix always keeps fp32 state (llm_anatomy/optim/common.py); see calculator/optimizer.py."""
    name = optimizer.lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if name == "adamw":
        return 2 * param_bytes * numel + 4 * n_tensors
    return state_bytes(numel, name, n_tensors=n_tensors)


# ---- the buffers the collectives use: their dtypes, DDP's buckets (calculator/comm.py times them) ----
def fsdp_dtypes(run: Run, param_dtype: str | None = None, reduce_dtype: str | None = None) -> dict:
    """dtypes FSDP2 moves. Defaults per policy: amp -> bf16 all-gather, fp32 reduce-scatter (the
    FSDP form of amp); bf16 -> bf16 both; fp32 -> fp32 both."""
    storage = param_dtype_name(run)
    if param_dtype is None and reduce_dtype is None:
        param_dtype, reduce_dtype = {"amp": ("bfloat16", "float32"), "bf16": (None, None), "fp32": (None, None)}[run.dtype]
    for name, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if v is not None and v not in REDUCE_DTYPES:
            raise ConfigError(f"{name} must be one of {', '.join(REDUCE_DTYPES)}, got {v!r}")
    ag = param_dtype or storage
    return dict(param=storage, all_gather=ag, reduce=reduce_dtype or ag)


def ddp_bucket_limits(bucket_cap_mb: float | None) -> list[int]:
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * 1024 * 1024]
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    cap = int(bucket_cap_mb * 1024 * 1024)
    return [cap, cap]


def _fill(sizes: list[int], st: list[int], limits: list[int], out: Callable[[int], object]) -> None:
    """Add gradients of `sizes` bytes to the open bucket st = [limit index, bytes]; out(bytes) for each it closes."""
    for n in sizes:
        st[1] += n
        if st[1] >= limits[st[0]]:
            out(st[1])
            st[0], st[1] = min(st[0] + 1, len(limits) - 1), 0


def ddp_bucket_runs(cfg: ModelConfig, run: Run, bucket_cap_mb: float | None = None) -> list[tuple[int, int]]:
    """The rebuilt DDP buckets in launch order (compute_bucket_assignment_by_size), as (bytes, how many in a
    row): walk the gradients in ready order (the reverse of registration), add each one's bytes, close the
    bucket once it reaches the limit. The walk through the Blocks is a function of (limit index, bytes so far)
    at each Block's start, so once that state repeats the buckets between repeat to the last Block; Blocks that
    cannot close a bucket are added whole. The work is bounded by the Block's tensors and the limit, not the
    depth."""
    gb = DTYPE_BYTES[param_dtype_name(run)]
    limits = ddp_bucket_limits(bucket_cap_mb)
    before, block, after = ([prod(s) * gb for _, s in reversed(part)] for part in units(cfg))
    runs: list[list[int]] = []
    st = [0, 0]  # limit index, bytes in the open bucket

    def emit(nbytes: int, count: int = 1) -> None:
        if runs and runs[-1][0] == nbytes:
            runs[-1][1] += count
        else:
            runs.append([nbytes, count])

    walk = lambda sizes, out: _fill(sizes, st, limits, out)  # noqa: E731
    walk(after, emit)
    B, done, seen, trail = sum(block), 0, {}, []  # trail: buckets closed in the Blocks since the first state
    while done < cfg.layers:
        key = tuple(st)
        if seen is not None and key in seen:  # a cycle: its buckets repeat while whole cycles fit
            d0, t0 = seen[key]
            period, cycle = done - d0, trail[t0:]
            reps = (cfg.layers - done) // period
            if len(set(cycle)) == 1:
                emit(cycle[0], len(cycle) * reps)
            else:
                for _ in range(reps):
                    for n in cycle:
                        emit(n)
            done, seen = done + reps * period, None
            continue
        if seen is not None:
            seen[key] = (done, len(trail))
        whole = min(cfg.layers - done, max(0, (limits[st[0]] - 1 - st[1]) // B))
        if whole:  # Blocks that end below the limit close nothing
            st[1] += whole * B
            done += whole
            continue
        walk(block, lambda n: (emit(n), trail.append(n)))
        done += 1
    walk(before, emit)
    if st[1]:
        emit(st[1])
    return [(n, k) for n, k in runs]


def check_world(cfg: ModelConfig, world_size, strategy: str) -> None:
    """ConfigError (one line) for a strategy or world size that cannot be run."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if strategy == "fsdp":
        largest = max(s[0] for s, _ in shape_counts(cfg))
        if world_size > largest:
            raise ConfigError(f"fsdp cannot shard {cfg.name} over {world_size} ranks: its largest parameter has "
                              f"{largest} rows on dim 0, so ranks >= {largest} would hold no shard of anything")


def per_rank_memory(cfg: ModelConfig, run: Run, world_size: int, strategy: str, *, rank: int = 0,
                    optimizer: str = "adamw") -> dict:
    """Bytes one rank holds between steps: params, grads (after backward) and optimizer state."""
    check_world(cfg, world_size, strategy)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
    pb, counts = BYTES[param_dtype_name(run)], shape_counts(cfg)
    if strategy == "ddp":
        n = sum(prod(s) * k for s, k in counts)
        return dict(params=n * pb, grads=n * pb, optimizer=optimizer_bytes(optimizer, n, n_tensors(cfg), pb),
                    params_numel=n, local_numel=n)
    local = padded = 0
    for s, k in counts:
        lo, pa = shard_numel(s, world_size, rank)
        local, padded = local + k * lo, padded + k * pa
    return dict(params=padded * pb, grads=padded * pb, optimizer=optimizer_bytes(optimizer, local, n_tensors(cfg), pb),
                params_numel=padded, local_numel=local)


# ---- the step's peak on one rank ------------------------------------------------------------------------
# FSDP2's buffers over a step (torch 2.13 _fsdp_param_group.py / _fsdp_collectives.py / _fsdp_state.py), with
# G_u the unsharded bytes of unit u (padded rows x W, in the all-gather dtype), R_u its reduce-scatter input
# (the same elements in the reduce dtype) and S_u its sharded gradient (padded shard, storage dtype):
#   forward   unit u's pre_forward all-gathers into one flat buffer (G_u) and copies it out into per-parameter
#             unsharded tensors (G_u again); the flat buffer is kept until the *next* unit's copy-out ends
#             ("implicit prefetch": the comm context's all_gather_state), and the last Block's until the root's
#             post_forward, after the loss. Blocks free their unsharded parameters after their forward (resized
#             to 0 bytes); the root (embedding, final norm, head) keeps them until its post_backward.
#   backward  the root's pre_backward prefetches the last Block's flat buffer; Block i's pre_backward copies
#             its flat buffer out (G_i), frees it, and prefetches Block i-1's; its post_backward frees G_i,
#             copies its unsharded gradients into R_i, frees them, and reduce-scatters into S_i. R_i is kept
#             until the next unit's post_backward; the root reduces last, after the embedding's backward.
# The activations and their gradients are the single-GPU model's at the FSDP compute dtype
# (llm_anatomy.calculator.memory.phases): under the amp policy FSDP's MixedPrecisionPolicy runs bf16 parameters
# with no autocast, which is the bf16 policy's compute. DDP (gradient_as_bucket_view=False, the default) is
# the single-GPU step plus its gradient buckets, one more copy of every gradient, alive from construction.
def _rounder(device: str):
    from llm_anatomy.calculator.memory import rounded

    return rounded if device == "cuda" else (lambda n: n)


def _fsdp_unit_bytes(cfg: ModelConfig, run: Run, world: int, rank: int, rnd) -> dict:
    """Per unit ("root", "block"): G (unsharded, per-parameter tensors), F (the flat all-gather buffer),
    R (reduce-scatter input), S (sharded gradient), P (sharded parameters), U (unsharded gradients);
    the dim-1 tensors' copies (fsdp_shards.py): T their copy-out temporaries, K the last one's original
    gradient, which the reduce-scatter's re-chunking keeps."""
    dts = fsdp_dtypes(run)
    ag, rs, pb = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]], BYTES[dts["param"]]
    out = {}
    for name, params in fsdp_unit_shapes(cfg):
        padded = [shard_numel(s, world, rank)[1] for _, s in params]
        dim1 = [rnd(prod(s) * ag) for _, s in params if fsdp_shard_dim(s, world)]
        out[name] = dict(
            G=sum(rnd(world * n * ag) for n in padded), F=rnd(world * sum(padded) * ag),
            R=rnd(world * sum(padded) * rs), S=rnd(sum(padded) * pb), P=sum(rnd(n * pb) for n in padded),
            U=sum(rnd(prod(s) * ag) for _, s in params), T=sum(dim1), K=dim1[-1] if dim1 else 0)
    return out


def _opt_state(cfg: ModelConfig, run: Run, world: int, strategy: str, rank: int, optimizer: str, rnd) -> int:
    """Optimizer state on this rank, each tensor rounded: AdamW's two moments in the parameter dtype and a
    4-byte step per tensor; AdEMAMix's fp32 state (calculator/optimizer.py)."""
    from llm_anatomy.calculator.optimizer import state_breakdown

    pb = BYTES[param_dtype_name(run)]
    local = [(prod(s) if strategy == "ddp" else shard_numel(s, world, rank)[0], k) for s, k in shape_counts(cfg)]
    if optimizer == "adamw":
        return sum(k * (2 * rnd(n * pb) + rnd(4)) for n, k in local)
    per = state_breakdown(optimizer)
    return sum(k * rnd(int(n * b)) for n, k in local for b in per.values())


def per_rank_peak(cfg: ModelConfig, run: Run, variant: str, world_size: int, strategy: str, *,
                  optimizer: str = "adamw", rank: int = 0, device: str = "cuda") -> dict:
    """The largest bytes one rank holds in a training step after the first, under DDP or FSDP2 as
    llm_anatomy.distributed.wrap() sets them up (FSDP: each Block, then the root; reshard_after_forward), and
    where. run is this rank's micro-batch. device "cuda" rounds every tensor to the allocator's 512-byte
    blocks (torch.cuda.max_memory_allocated); "cpu" sums exact storage bytes (live storage on CPU).

    Returns bytes: by_kind at the peak (parameters; gradients: parameter gradients and the backward's
    transients; optimizer state; activations: the saved set and the forward's transients; inputs;
    fsdp_unsharded: all-gathered parameters and the prefetched buffer; fsdp_reduce_scatter: its inputs;
    ddp_buckets), peak, peak_at, and every candidate moment."""
    from llm_anatomy.calculator.memory import phases

    check_world(cfg, world_size, strategy)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, got {device!r}")
    rnd = _rounder(device)
    if strategy == "ddp":
        return _ddp_peak(cfg, run, variant, world_size, rank, optimizer, device, rnd)
    # FSDP computes at its all-gather dtype: amp's bf16 parameters without autocast are the bf16 policy
    crun = Run(batch=run.batch, seq=run.seq, dtype="bf16" if run.dtype in ("amp", "bf16") else "fp32",
               recompute=run.recompute, loss_impl=run.loss_impl, lean=run.lean)
    ph = phases(cfg, crun, variant, optimizer=None, device=device)
    u = _fsdp_unit_bytes(cfg, run, world_size, rank, rnd)
    root, blk, L, W = u["root"], u["block"], cfg.layers, world_size
    if W == 1:  # FSDP2 on one rank gathers nothing (no flat buffer) but still copies into unsharded parameters
        root["F"] = blk["F"] = 0
    base = dict(parameters=root["P"] + L * blk["P"], optimizer=_opt_state(cfg, run, W, "fsdp", rank, optimizer, rnd),
                inputs=ph["inputs"])
    layer_saved = _layer_saved(cfg, crun, variant, device, rnd)
    cands = []

    def add(at, activations=0, unsharded=0, gradients=0, rs=0):
        by = dict(base, activations=activations, gradients=gradients, fsdp_unsharded=unsharded,
                  fsdp_reduce_scatter=rs)
        cands.append(dict(at=at, bytes=sum(by.values()), by_kind=by))

    # forward: Block 0's copy-out holds the root's flat buffer, the root's and Block 0's unsharded parameters and
    # Block 0's flat buffer; the last Block's, Block L-2's flat buffer and its own two
    # (a Block's dim-1 experts add their copy-out temporaries T to each of its copy-outs)
    add("forward: block 0 all-gather", 0, root["F"] + root["G"] + blk["F"] + blk["G"] + blk["T"])
    if L > 1:
        add(f"forward: block {L - 1} all-gather", (L - 1) * layer_saved,
            root["G"] + 2 * blk["F"] + blk["G"] + blk["T"])
    fpeak = (ph["forward_peak"] or ph["forward_end"]) - ph["params"] - ph["inputs"]
    add("forward: loss", fpeak, root["G"] + blk["F"])
    # backward: the walk's stages, with FSDP's buffers around them; a Block's parameter gradients become its
    # sharded gradient at its post_backward
    top = None
    for st in ph["backward_stages"]:
        by = st["by_kind"]
        act, grad = by["activation"], by["gradient / backward buffer"]
        i = _stage_layer(st["name"])
        if i is None and not st["name"].startswith("embedding"):  # loss, final norm: the last Block prefetched
            add("backward: " + st["name"], act, root["G"] + blk["F"], grad)
            top = (act, grad)  # the last one's: what the last Block's backward copy-out starts from
            continue
        if i == L - 1 and blk["T"] and top is not None:  # that copy-out, with its dim-1 temporaries (a bound:
            add(f"backward: block {i} all-gather copy-out", top[0],  # the stage's own transients are counted)
                root["G"] + blk["F"] + blk["G"] + blk["T"], top[1])
            top = None
        done = L - 1 - i if i is not None else L  # Blocks whose post_backward has run
        grad += done * (blk["S"] - blk["U"])
        if i is None:  # the embedding: every Block reduced, Block 0's reduce-scatter input kept
            add("backward: " + st["name"], act, root["G"], grad, rs=blk["R"])
            continue
        add("backward: " + st["name"], act, root["G"] + blk["G"] + (blk["F"] if i > 0 else 0), grad,
            rs=blk["R"] if i < L - 1 else 0)
    # post_backward of the last and the first Block (the moments between are linear in the layer): the Block's
    # parameters resharded, its gradients copied into R_i, then the collective into S_i. Still alive: the
    # saved tensors of the Blocks below, the residual stream's gradient, the root's gradients made so far.
    # gloo's reduce_scatter_tensor works on a copy of its input (live storage on CPU); one rank runs no collective
    copy = 2 if device == "cpu" and W > 1 else 1
    dt = dtypes_of(crun)
    resid = rnd(run.tokens * cfg.hidden * BYTES[dt.residual])
    head = root["U"] - (rnd(cfg.vocab * cfg.hidden * BYTES[dt.param]) if not cfg.tie_embeddings else 0)
    for i in sorted({L - 1, 0}):
        done = (L - 1 - i) * blk["S"]
        unsh = root["G"] + (blk["F"] if i > 0 else 0)
        act = i * layer_saved + resid
        # K: the last dim-1 gradient's original, kept by the re-chunking through the reduce-scatter
        add(f"backward: block {i} reduce-scatter copy-in", act, unsh, head + done + blk["U"] + blk["K"],
            rs=blk["R"])
        add(f"backward: block {i} reduce-scatter", act, unsh, head + done + blk["S"] + blk["K"],
            rs=copy * blk["R"])
    # the root's post_backward, after the embedding's: its parameters resharded, its gradients copied into its
    # reduce-scatter input, then the collective
    add("backward: root reduce-scatter copy-in", 0, 0, L * blk["S"] + root["U"], rs=root["R"])
    # the embedding's unsharded gradient, the backward's last output, stays referenced until backward returns,
    # past the copy-in (live storage on CPU: validations/test_distributed.py)
    emb = rnd(cfg.vocab * cfg.hidden * BYTES[dt.param])
    add("backward: root reduce-scatter", 0, 0, L * blk["S"] + root["S"] + emb, rs=copy * root["R"])
    end = dict(base, gradients=root["S"] + L * blk["S"])
    _optimizer_candidate(cands, end, cfg, run, W, "fsdp", rank, optimizer, device, rnd)
    return _result(cfg, run, variant, W, "fsdp", rank, optimizer, device, cands)


def _ddp_peak(cfg, run, variant, world, rank, optimizer, device, rnd) -> dict:
    from llm_anatomy.calculator.memory import phases

    ph = phases(cfg, run, variant, optimizer=optimizer, device=device)
    buckets = sum(rnd(b) * k for b, k in ddp_bucket_runs(cfg, run))
    base = dict(parameters=ph["params"], optimizer=ph["optimizer"], inputs=ph["inputs"], ddp_buckets=buckets)
    cands = []

    def add(at, activations, gradients=0):
        by = dict(base, activations=activations, gradients=gradients)
        cands.append(dict(at=at, bytes=sum(by.values()), by_kind=by))

    fixed = ph["params"] + ph["optimizer"] + ph["inputs"]
    add("forward: loss" if ph["forward_peak"] else "forward: end", (ph["forward_peak"] or ph["forward_end"]) - fixed)
    for st in ph["backward_stages"]:
        by = st["by_kind"]
        add("backward: " + st["name"], by["activation"], by["gradient / backward buffer"])
    end = dict(base, gradients=ph["backward_end"] - fixed)
    _optimizer_candidate(cands, end, cfg, run, 1, "ddp", 0, optimizer, device, rnd)
    return _result(cfg, run, variant, world, "ddp", rank, optimizer, device, cands)


def _optimizer_candidate(cands, end: dict, cfg, run, world, strategy, rank, optimizer, device, rnd) -> None:
    """The optimizer step: everything the backward left, plus the step's temporaries. Fused AdamW on CUDA
    makes none; torch's per-tensor AdamW on CPU makes exp_avg_sq.sqrt() and its quotient by the bias
    correction, two of the largest local tensor at once. AdEMAMix's temporaries are not modelled."""
    pb = BYTES[param_dtype_name(run)]
    local = [prod(s) if strategy == "ddp" else shard_numel(s, world, rank)[0] for s, _ in shape_counts(cfg)]
    tmp = 2 * rnd(max(local) * pb) if device == "cpu" and optimizer == "adamw" else 0
    by = dict(end, activations=0)
    by["gradients"] = by.get("gradients", 0) + tmp  # transients of the step, counted with the gradients
    cands.append(dict(at="optimizer step", bytes=sum(by.values()), by_kind=by))


def _result(cfg, run, variant, world, strategy, rank, optimizer, device, cands) -> dict:
    kinds = ("parameters", "gradients", "optimizer", "activations", "inputs", "fsdp_unsharded",
             "fsdp_reduce_scatter", "ddp_buckets")
    for c in cands:
        c["by_kind"] = {k: c["by_kind"].get(k, 0) for k in kinds}
    top = max(cands, key=lambda c: c["bytes"])
    return dict(config=cfg.name, variant=variant, world_size=world, strategy=strategy, rank=rank,
                optimizer=optimizer, device=device, run=dict(batch=run.batch, seq=run.seq, dtype=run.dtype),
                peak=top["bytes"], peak_at=top["at"], by_kind=top["by_kind"], candidates=cands)


def _stage_layer(name: str) -> int | None:
    """The layer of a backward stage named "layer 3 mlp.down", else None."""
    parts = name.split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layer" and parts[1].isdigit() else None


def _layer_saved(cfg: ModelConfig, run: Run, variant: str, device: str, rnd) -> int:
    """Bytes one Block saves in forward: every saved tensor with an instance per layer (norms: two)."""
    from llm_anatomy.calculator import estimate

    L, n = cfg.layers, 0
    for c in estimate(cfg, run, variant, device=device).components.values():
        for s in c.saved:
            if s.count >= L and c.name != "loss":
                n += rnd(prod(s.shape) * BYTES[s.dtype]) * (s.count // L)
    return n
