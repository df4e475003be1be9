"""Per-rank figures of tensor parallel (+ sequence parallel) x FSDP2 on a (dp, tp) mesh. Pure Python: no torch.

The mesh and plan are llm_anatomy/distributed/tensor_parallel.py's (torchtitan's parallelize_llama).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from llm_anatomy.calculator.comm import _row, fsdp_collectives
from llm_anatomy.calculator.param_layout import Shape, fsdp_unit_shapes
from llm_anatomy.calculator.fsdp_shards import shard_numel
from llm_anatomy.calculator.sharding import DTYPE_BYTES, fsdp_dtypes, optimizer_bytes, param_dtype_name
from llm_anatomy.calculator.types import BYTES, ROPE_TABLES
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.kernel_shapes import LCE_ALIGN, lce_chunk_rows, lce_forward_bytes, lce_saved_bytes, lce_vocab
from llm_anatomy.mesh_rules import check_mesh, check_run

# how many times each optimizer's foreach step reads a gradient: each read of a Partial DTensor gradient
# redistributes it (an all-reduce) when no FSDP has made it Replicate first
OPTIMIZER_GRAD_READS = {"adamw": 3, "sgd": 1}


def check_optimizer(optimizer: str, tp: int, dp: int) -> None:
    """The optimizers whose redistributions of the norms' Partial gradients are known (they matter without FSDP)."""
    if tp > 1 and dp == 1 and optimizer not in OPTIMIZER_GRAD_READS:
        raise ConfigError(f"tp without dp predicts optimizers {', '.join(OPTIMIZER_GRAD_READS)}, not {optimizer!r}")
    if optimizer not in ("adamw", "ademamix", "sgd"):
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose from adamw, ademamix, sgd")


# ---- the tensors each rank holds ------------------------------------------------------------------------------
# ColwiseParallel shards a weight (and its bias) on dim 0, RowwiseParallel on dim 1 (the embedding on dim 0: the
# vocab), SequenceParallel replicates the norms' weights. DTensor's local tensor is the plain chunk.
def _fused(block: list[tuple[str, Shape]]) -> list[tuple[str, Shape]]:
    """The efficient Block's tensors from the baseline's: q, k, v weights one qkv weight (rows q, k, v), their
    biases one qkv bias, gate and up (the MLP's, or a mixture of experts' shared MLP's) one gate_up weight, in
    registration order."""
    rows = {n: s for n, s in block}  # names within the unit: "layers.0.attn.q.weight"
    out = []
    for n, s in block:
        pre = "layers.0." if n.startswith("layers.0.") else ""
        name = n[len(pre):]
        if name in ("attn.q.weight", "attn.q.bias"):
            kind = name.split(".")[-1]
            rows_qkv = sum(rows[f"{pre}attn.{p}.{kind}"][0] for p in "qkv")
            out.append((f"{pre}attn.qkv.{kind}", (rows_qkv, *s[1:])))
        elif name in ("mlp.gate.weight", "mlp.shared.gate.weight"):  # the shared experts' MLP is fused too
            out.append((f"{pre}{name.replace('gate', 'gate_up')}", (2 * s[0], s[1])))
        elif name not in ("attn.k.weight", "attn.v.weight", "attn.k.bias", "attn.v.bias", "mlp.up.weight",
                          "mlp.shared.up.weight"):
            out.append((n, s))
    return out


def tp_unit_shapes(cfg: ModelConfig, tp: int, variant: str = "baseline") -> tuple:
    """fsdp_unit_shapes on the TP-local tensors: ("root", [(name, shape)]), ("block", [(name, shape)]). The
    efficient variant's fused qkv and gate_up are column-parallel like the projections they fuse (their rows in
    rank order: distributed/tp_layout.py), so each rank holds 1/tp of their rows."""
    def local(name: str, shape: Shape) -> Shape:
        if name.endswith(("norm.weight", "attn.o.bias")) or tp == 1:  # replicated (o's bias: RowwiseParallel's)
            return shape
        if name.endswith(("attn.o.weight", "mlp.down.weight")):
            return (shape[0], shape[1] // tp)
        return (shape[0] // tp, *shape[1:])  # q/k/v/qkv/gate/up/gate_up weights and biases, sinks, embed, head

    units = fsdp_unit_shapes(cfg)
    if variant == "efficient":
        units = tuple((unit, ps if unit == "root" else _fused(ps)) for unit, ps in units)
    return tuple((unit, [(n, local(n, s)) for n, s in ps]) for unit, ps in units)


def _local_counts(cfg: ModelConfig, tp: int, variant: str) -> list[tuple[str, Shape, int]]:
    (_, root), (_, block) = tp_unit_shapes(cfg, tp, variant)
    return [(n, s, 1) for n, s in root] + [(n, s, cfg.layers) for n, s in block]


def tp_rank_memory(cfg: ModelConfig, run: Run, tp: int, dp: int = 1, *, rank: int = 0,
                   optimizer: str = "adamw", variant: str = "baseline") -> dict:
    """Bytes one rank holds after the optimizer step: {params, grads, optimizer}. rank is the global rank of the
    (dp, tp) mesh (tp innermost); FSDP2 shards each TP-local tensor on dim 0 over dp (sharding.py's rules).

    Gradients: under FSDP the reduce-scatter's padded shards, like the parameters. Without it, each .grad as
    DTensor leaves it: the TP-local shape, except an untied embedding's, which DTensor's embedding backward returns
    Replicate, the full (V, H) table on every rank (tied, the head's Shard(0) gradient comes first and the sum
    keeps its placement)."""
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    check_optimizer(optimizer, tp, dp)
    if not 0 <= rank < tp * dp:
        raise ConfigError(f"rank must be in [0, {tp * dp}), got {rank!r}")
    pb, dr = BYTES[param_dtype_name(run)], rank // tp
    params = grads = local = tensors = 0
    for name, s, k in _local_counts(cfg, tp, variant):
        lo, pa = shard_numel(s, dp, dr)
        tensors += k
        local += k * lo
        params += k * pa * pb
        untied_embedding = name == "embed.weight" and not cfg.tie_embeddings
        grad = cfg.vocab * cfg.hidden if tp > 1 and dp == 1 and untied_embedding else pa
        grads += k * grad * pb
    return dict(params=params, grads=grads, optimizer=optimizer_bytes(optimizer, local, tensors, pb))


# ---- the collectives of one step -------------------------------------------------------------------------------
def tp_collectives(cfg: ModelConfig, run: Run, tp: int, dp: int = 1, *, optimizer: str = "adamw",
                   param_dtype: str | None = None, reduce_dtype: str | None = None,
                   reshard_after_forward: bool = True, variant: str = "baseline") -> list[dict]:
    """Every collective of one training step on one rank, in comm.py's row format plus `group` ("tp" or "dp").
    The efficient variant's are the baseline's but for the loss's all-reduces (loss_all_reduces): its fused
    projections are gathered and reduced where the ones they fuse are, its head's input is all-gathered and its
    gradient reduce-scattered as the baseline head's; FSDP's units differ (tp_unit_shapes).

    tp (torch 2.13 DTensor, the plan of distributed/tensor_parallel.py), with A = batch x seq x hidden elements
    in the compute dtype:
      all-gather, A            before attention and before the MLP of every Block (PrepareModuleInput), before the
                               head (its input layout Shard(1)); in backward, once for each forward reduce-scatter
      reduce-scatter, A        the embedding's and every o's and down's partial output (RowwiseParallel, output
                               Shard(1)); in backward, once for each forward all-gather
      all-reduce, fp32         the loss's per-row max, sum of exp and target logit (loss_all_reduces): three of
                               B x S elements (the baseline's loss_parallel), three per chunk of the efficient
                               variant's vocab-parallel fused linear cross-entropy
      all-reduce, hidden       each norm's weight gradient is Partial over tp (it sums the rank's rows); FSDP
                               redistributes it to Replicate once in backward; without FSDP the optimizer's foreach
                               ops redistribute it at each read of the gradient (AdamW: 3, SGD: 1); with
                               qk_norm the same for each q_norm and k_norm weight (head_dim elements)
    dp: FSDP2's rows (comm.fsdp_collectives) on the TP-local units."""
    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    check_optimizer(optimizer, tp, dp)
    dts = fsdp_dtypes(run, param_dtype, reduce_dtype) if dp > 1 else None
    compute = dts["all_gather"] if dts else param_dtype_name(run)
    rows = []
    if tp > 1:
        L, cb = cfg.layers, DTYPE_BYTES[compute]
        act = run.batch * run.seq * cfg.hidden * cb
        rows += [_row("all_gather", "forward", "attn, mlp, head inputs", 2 * L + 1, act, compute),
                 _row("reduce_scatter", "forward", "embed, o, down outputs", 2 * L + 1, act, compute),
                 _row("all_gather", "backward", "embed, o, down output grads", 2 * L + 1, act, compute),
                 _row("reduce_scatter", "backward", "attn, mlp, head input grads", 2 * L + 1, act, compute),
                 *loss_all_reduces(cfg, run, tp, cb, variant), *recompute_collectives(run, L, act, compute)]
        reads = 1 if dp > 1 else OPTIMIZER_GRAD_READS[optimizer]
        phase = "backward" if dp > 1 else "optimizer"
        rows.append(_row("all_reduce", phase, "norm weight grads", (2 * L + 1) * reads, cfg.hidden * cb, compute))
        if cfg.qk_norm:  # the per-head q/k norms run on the rank's heads: their weight gradients are Partial too
            rows.append(_row("all_reduce", phase, "q/k norm weight grads", 2 * L * reads, cfg.head_dim * cb, compute))
        for r in rows:
            r["group"] = "tp"
    if dp > 1:
        fs = fsdp_collectives(cfg, run, dp, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              reshard_after_forward=reshard_after_forward,
                              unit_shapes=tp_unit_shapes(cfg, tp, variant))
        rows += [dict(r, group="dp") for r in fs]
    return rows


def recompute_collectives(run: Run, layers: int, act: int, compute: str) -> list[dict]:
    """The collectives backward's re-runs issue again (the checkpoints of efficient/attention.py, mlp.py and
    transformer.py's BlockCheckpoint hold the plan's redistributions; the early stop ends each re-run once down's
    input is saved again, before down's matmul and its reduce-scatter):
      mlp    qkv's and gate_up's input all-gathers, in the norm -> qkv and the sum -> ... -> down checkpoints
      full   the block's two all-gathers and o's reduce-scatter"""
    if run.recompute == "none":
        return []
    rows = [_row("all_gather", "backward", "recompute: attn, mlp inputs again", 2 * layers, act, compute)]
    if run.recompute == "full":
        rows.append(_row("reduce_scatter", "backward", "recompute: o output again", layers, act, compute))
    return rows


def head_chunks(cfg: ModelConfig, run: Run, tp: int, c: int) -> list[int]:
    """The rows of each chunk of the efficient variant's vocab-parallel fused linear cross-entropy on one rank
    (kernels/linear_ce_tp.py): kernel_shapes.lce_chunk_rows on the rank's V / tp columns (padded to LCE_ALIGN) and
    B x S rows, c the compute dtype's bytes."""
    T = run.batch * run.seq
    C = lce_chunk_rows(T, cfg.hidden, lce_vocab(cfg.vocab // tp, LCE_ALIGN), c)
    return [C] * (T // C) + ([T % C] if T % C else [])


def loss_all_reduces(cfg: ModelConfig, run: Run, tp: int, c: int, variant: str = "baseline") -> list[dict]:
    """The loss's fp32 all-reduces over tp (each row's max, sum of exp and target logit): loss_parallel's three of
    B x S elements for the baseline; for the efficient variant three per chunk of its vocab-parallel fused linear
    cross-entropy, each of the chunk's rows (one chunk, and so the baseline's three, while B x S fits one)."""
    if variant != "efficient":
        return [_row("all_reduce", "forward", "loss parallel", 3, run.batch * run.seq * 4, "float32")]
    counts: dict[int, int] = {}
    for rows in head_chunks(cfg, run, tp, c):
        counts[rows] = counts.get(rows, 0) + 3
    return [_row("all_reduce", "forward", "vocab-parallel linear CE", k, rows * 4, "float32")
            for rows, k in counts.items()]


def vocab_parallel_ce_bytes(tokens: int, hidden: int, vocab_rank: int, c: int, p: int, *, chunk: int = 0,
                            smoothing: bool = False, align: int = LCE_ALIGN) -> dict[str, int]:
    """Bytes one rank's vocab-parallel fused linear cross-entropy (kernels/linear_ce_tp.py) allocates in a training
    call on its (vocab_rank, H) rows, on the Triton path (CUDA): {saved, peak, transient}. c, p: the compute dtype's
    and the weight's bytes; chunk: the op's override, 0 for the rule.

    The one-GPU op's table (kernel_shapes.lce_forward_bytes on the rank's rows: n, scale, the weight cast, the row
    losses, grad_x, grad_w, one logits chunk, the loss and its fp64 sum), with the (T,) bool mask of valid targets
    held for the whole call, and each target's column on the rank, (T,) int64; inside a chunk of R rows, the stats
    kernel's per-row max, sum of exp and target logit (and Σz with smoothing) and two all-reduce outputs (the
    global max and the sum of exp: lse) alive at once, each (R,) fp32. saved: grad_x and grad_w; transient: the
    peak beyond them and the fp32 loss."""
    table = lce_forward_bytes(tokens, hidden, vocab_rank, c, p, chunk, align)
    held = sum(table.values()) - table["loss_sum"] - table["loss"] + 8 * tokens
    rows = min(chunk or lce_chunk_rows(tokens, hidden, lce_vocab(vocab_rank, align), c), tokens)
    peak = held + max(4 * rows * (5 + smoothing), table["loss_sum"] + table["loss"])
    saved = lce_saved_bytes(tokens, hidden, vocab_rank, c, p, align)
    return dict(saved=saved, peak=peak, transient=peak - saved - 4)


def grouped_counts(rows: list[dict]) -> dict[tuple[str, str, str, int], int]:
    """{(group, op, dtype, bytes_each): count}: the form the measured side (mesh_step) is compared in."""
    out: dict[tuple[str, str, str, int], int] = {}
    for r in rows:
        key = (r["group"], r["op"], r["dtype"], r["bytes_each"])
        out[key] = out.get(key, 0) + r["count"]
    return out


# ---- what each rank saves for backward ------------------------------------------------------------------------
def tp_local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one TP rank computes between its collectives: heads, kv_heads, intermediate and vocab over tp, the
    head width kept (so q_dim is the rank's share); hidden stays whole."""
    return replace(cfg, heads=cfg.heads // tp, kv_heads=cfg.kv_heads // tp, head_dim=cfg.head_dim,
                   intermediate=cfg.intermediate // tp, vocab=cfg.vocab // tp, name=f"{cfg.name} / tp{tp}")


# what recompute's checkpoints keep of the residual stream (the block input, the attention branch): plain (B, S / tp, H)
# tensors on the rank, as the norms' inputs are
SEQ_SHARDED = ("attention.x", "mlp.branch")


def _bytes(saved, names) -> int:
    return sum(t.bytes for t in saved if t.name in names)


def tp_saved(cfg: ModelConfig, run: Run, variant: str, tp: int, dp: int = 1, *, device: str = "cpu") -> dict:
    """Bytes one rank saves for backward per component: {"layer": {component: bytes of one Block}, "root":
    {component: bytes outside the Blocks}, "total": {component: bytes}}.

    Under the plan every saved tensor is the one-GPU model's (calculator.estimate) on the rank's share
    (tp_local_config): the projections save their all-gathered (B x S, H) input whole, attention its heads / tp,
    the MLP its intermediate / tp, the baseline's loss its (B x S, V / tp) log-probs, the efficient variant's
    vocab-parallel fused linear cross-entropy the one-GPU op's grad_x (B x S, H) and grad_w (V / tp, H); the norms
    run on the sequence shard, so they save the one-GPU norm's tensors at seq / tp, and recompute's checkpoints keep
    the residual stream and the branch at seq / tp (SEQ_SHARDED). Under FSDP (dp > 1) amp computes
    in bf16 (its MixedPrecisionPolicy casts the parameters; no autocast), as in sharding.per_rank_peak, and casts
    every Block's floating inputs: the efficient variant's fp32 RoPE tables are saved as a bf16 copy per Block."""
    from llm_anatomy.calculator import estimate

    check_mesh(cfg, tp, dp, variant=variant)
    check_run(run, tp, dp, variant)
    dtype = "bf16" if run.dtype == "amp" and dp > 1 else run.dtype
    local = tp_local_config(cfg, tp)

    def by_component(layers: int) -> dict:
        c, r = replace(local, layers=layers), replace(run, dtype=dtype)
        full = estimate(c, r, variant, device=device).components
        seq_shard = estimate(c, replace(r, seq=run.seq // tp), variant, device=device).components
        out = {name: comp.saved_bytes for name, comp in full.items()}
        out["norm"] = seq_shard["norm"].saved_bytes
        if run.dtype == "amp" and dp > 1:  # FSDP casts each Block's fp32 RoPE tables to a bf16 copy of its own
            rope = sum(prod(t.shape) * BYTES[t.dtype] * t.count for t in full["attention"].saved
                       if t.name in ROPE_TABLES and t.dtype == "float32")
            out["attention"] += rope // 2 * layers - rope
        for name, comp in full.items():  # the checkpoints' kept residual stream and branch: the rank's seq / tp rows
            out[name] += _bytes(seq_shard[name].saved, SEQ_SHARDED) - _bytes(comp.saved, SEQ_SHARDED)
        return out

    one, two = by_component(1), by_component(2)
    layer = {k: two[k] - one[k] for k in one}
    root = {k: one[k] - layer[k] for k in one}
    return dict(layer=layer, root=root, total={k: root[k] + cfg.layers * layer[k] for k in one})
