"""Per-rank figures of expert parallel over ep of `world` ranks, FSDP2 over every rank for every other tensor
(llm_anatomy/distributed/expert_parallel.py). Pure Python: no torch.

The mesh: world = efsdp x ep, ep innermost; global rank g is ep rank e = g % ep and efsdp rank f = g // ep. world = ep
(the default, world None) is the 1-D composition: efsdp = 1, the experts plain local parameters. world > ep: the
experts of ep rank e are an FSDP2 unit per block over its efsdp group (ranks e, e + ep, ...).

Notation: T = batch x seq tokens per rank, K = experts_per_token, N = T K routed rows a rank sends, E experts,
El = E / ep per rank, c = the compute dtype's bytes, R_d the rows rank d receives in one MoE layer:
R_d = sum over source ranks s of the rows s routes to d's experts [d El, (d + 1) El). Under the default balanced
histogram (calculator/moe.py balanced, the same on every rank) R_d = ep x the balanced rows of d's experts; under
skewed routing (every token to experts 0..K-1) rank 0 receives ep x N rows: the worst rank.

Model state per rank:
  experts     El of each stacked tensor (gate_up (El, 2I, H), down (El, H, I), their biases). efsdp = 1: plain
              local parameters, gradients of the same shape, AdamW's two moments and a step per tensor. efsdp > 1:
              FSDP2's padded dim-0 shards of those El rows over efsdp (fsdp_shards.shard_numel: chunk = ceil(El / efsdp)
              rows allocated on every rank, rank f holding rows [f chunk, min((f + 1) chunk, El)), possibly none),
              the gradients one flat reduce-scatter output per block (the padded shards), the optimizer state of
              the rows held
  the rest    FSDP2's padded dim-0 shards over world (calculator/sharding.py), the efficient model's fused layout
Collectives per step (NCCL-tests bytes: an all-to-all counts its input; each MoE layer; rows in c):
  forward     all-to-all int32 (E,): the row counts; all-to-all N x H x c: the routed rows out;
              all-to-all R_d x H x c: the expert outputs back
  backward    under recompute ("mlp" or "full") the checkpoint's re-run first: the block's forward again up to its
              early stop (the unpermute's, or the shared experts' down's, saves), past the combine, so all three
              forward all-to-alls run again with the same splits (the same input routes the same rows: a re-run
              whose counts differed would change a saved shape, which the checkpoint's check refuses); then
              the two in reverse: R_d x H x c (the outputs' gradient out), N x H x c (the rows' gradient back)
  FSDP2       comm.fsdp_collectives over world on the units without the experts (the re-run gathers nothing: the
              unit is gathered for its backward already)
  experts     efsdp > 1, each MoE layer over efsdp: an all-gather of the El rows' padded shards in forward, again in
              backward (resharded after forward; the checkpoint's re-run runs inside the gathered backward and
              gathers nothing more), a reduce-scatter of their gradients; FSDP2's dtypes (sharding.fsdp_dtypes:
              amp gathers bf16, reduces fp32); the division by world is FSDP2's, on the output: no collective
Saved per rank (component "moe"): the one-process efficient block's tensors (calculator/moe_efficient.py) on the
T local tokens, but the local experts' run on R_d rows: xs, gate_up and h with R_d rows, the weight casts and offs
of El experts; plus pos (R_d,) int64, the receive side's sort (kept by its permute and its unsort). The unpermute
still keeps y (N, H) and pos (N,): the rows are back before it. Every other component saves what the one-process
model saves on the rank's batch. Under recompute the block's checkpoint keeps only its inputs, as in one process:
every EP tensor lives inside it.

dtype amp: FSDP2's MixedPrecisionPolicy on the rest (bf16 gathers, fp32 reduce-scatters, no autocast), so a rank
computes as the bf16 policy does (c = bf16, the residual stream bf16) and each Block casts its floating inputs: the
fp32 RoPE tables are saved as a bf16 copy per Block (types.ROPE_TABLES). efsdp > 1: the experts are an FSDP2 unit
under the same policy, gathered in bf16, so their casts are no-ops and the block saves what the bf16 policy's does.
efsdp = 1: the experts, which FSDP2 ignores, stay fp32
parameters; Experts.forward casts each stacked tensor to bf16 for its GEMM, which keeps the cast: the block's
experts save what the one-process amp block's do (its weight casts, and on the grouped path a bias folded into the
casts), on R_d rows and El experts. Their gradients come back through the casts in fp32 and are never reduced
(the ep hook divides them); model state is the amp policy's (fp32 parameters, gradients and moments).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from llm_anatomy.calculator.comm import _row, collective_counts, fsdp_collectives
from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.moe import balanced, check_histogram
from llm_anatomy.calculator.fsdp_shards import shard_numel
from llm_anatomy.calculator.sharding import BYTES, fsdp_dtypes, optimizer_bytes, param_dtype_name
from llm_anatomy.calculator.tensor_parallel import tp_unit_shapes
from llm_anatomy.calculator.types import ROPE_TABLES, Saved
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.mesh_rules import check_ep

EXPERTS = ".mlp.experts."  # the stacked experts' tensors, in the unit names ("layers.0.mlp.experts.gate_up")


def check(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, world: int | None = None) -> None:
    """mesh_rules.check_ep (ep dividing the experts and the world), and the rank in [0, world)."""
    check_ep(cfg, run, ep, world=world)
    n = ep if world is None else world
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ConfigError(f"rank must be in [0, {n}), got {rank!r}")


def efsdp_of(ep: int, world: int | None) -> int:
    """The ranks one ep rank's experts are FSDP2-sharded over: world / ep (1 when world is None: ep = world)."""
    return 1 if world is None else world // ep


def units(cfg: ModelConfig) -> tuple:
    """FSDP2's units without the experts: ("root", [(name, shape)]), ("block", [(name, shape)])."""
    return tuple((u, [(n, s) for n, s in ps if EXPERTS not in n]) for u, ps in tp_unit_shapes(cfg, 1, "efficient"))


def local_experts(cfg: ModelConfig, ep: int) -> list[tuple[str, tuple[int, ...]]]:
    """One block's local expert tensors: El rows of each stacked tensor."""
    (_, block), El = tp_unit_shapes(cfg, 1, "efficient")[1], cfg.experts // ep
    return [(n, (El, *s[1:])) for n, s in block if EXPERTS in n]


def received_rows(cfg: ModelConfig, run: Run, ep: int, hist=None) -> list[int]:
    """R_d for every rank d in one MoE layer. hist: None (balanced on every rank), one histogram (E rows per
    expert, the same on every rank) or a list of ep histograms, one per source rank (calculator/moe.py's checks)."""
    if hist is None:
        sources = [balanced(cfg, run)] * ep
    elif hist and isinstance(hist[0], (tuple, list)):
        if len(hist) != ep:
            raise ConfigError(f"one routing histogram per source rank ({ep}), got {len(hist)}")
        sources = [check_histogram(cfg, run, h) for h in hist]
    else:
        sources = [check_histogram(cfg, run, hist)] * ep
    El = cfg.experts // ep
    return [sum(sum(h[d * El:(d + 1) * El]) for h in sources) for d in range(ep)]


def expert_shards(cfg: ModelConfig, ep: int, world: int | None, rank: int) -> list[tuple[int, int]]:
    """(local, padded) elements of each of one block's local expert tensors on `rank`: the El rows whole when
    efsdp = 1, else FSDP2's dim-0 shard of them on efsdp rank rank // ep."""
    f = efsdp_of(ep, world)
    return [shard_numel(s, f, rank // ep) if f > 1 else (prod(s), prod(s)) for _, s in local_experts(cfg, ep)]


def rank_memory(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, optimizer: str = "adamw",
                world: int | None = None) -> dict:
    """{params, grads, optimizer} bytes one rank holds after the optimizer step."""
    check(cfg, run, ep, rank, world)
    pb = BYTES[param_dtype_name(run)]
    (_, root), (_, block) = units(cfg)
    padded = local = tensors = 0
    for ps, k in ((root, 1), (block, cfg.layers)):
        for _, s in ps:
            lo, pa = shard_numel(s, ep if world is None else world, rank)
            padded, local, tensors = padded + k * pa, local + k * lo, tensors + k
    own = expert_shards(cfg, ep, world, rank)
    mine, held = cfg.layers * sum(pa for _, pa in own), cfg.layers * sum(lo for lo, _ in own)
    tensors += cfg.layers * len(own)
    return dict(params=(padded + mine) * pb, grads=(padded + mine) * pb,
                optimizer=optimizer_bytes(optimizer, local + held, tensors, pb))


def expert_collectives(cfg: ModelConfig, run: Run, ep: int, world: int | None) -> list[dict]:
    """The experts' FSDP2 collectives of one step over efsdp (module docstring); none when efsdp = 1."""
    f = efsdp_of(ep, world)
    if f == 1:
        return []
    dts = fsdp_dtypes(run)
    numel = sum(shard_numel(s, f, 0)[1] for _, s in local_experts(cfg, ep))  # padded, the same on every rank
    ag, rs, L = f * numel * BYTES[dts["all_gather"]], f * numel * BYTES[dts["reduce"]], cfg.layers
    return [_row("all_gather", "forward", "experts", L, ag, dts["all_gather"]),
            _row("all_gather", "backward", "experts", L, ag, dts["all_gather"]),
            _row("reduce_scatter", "backward", "experts", L, rs, dts["reduce"])]


def collectives(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, hist=None, world: int | None = None) -> list[dict]:
    """Every collective of one training step on `rank`, in comm.py's row format."""
    check(cfg, run, ep, rank, world)  # one rank runs the all-to-alls too (on itself); FSDP2 then runs none
    dt = dtypes(run).compute  # amp: FSDP2's bf16 parameters make the routed rows bf16
    c, L, H = BYTES[dt], cfg.layers, cfg.hidden
    sent = run.tokens * cfg.experts_per_token * H * c
    back = received_rows(cfg, run, ep, hist)[rank % ep] * H * c
    fwd = [("row counts", cfg.experts * 4, "int32"), ("routed rows", sent, dt), ("expert outputs", back, dt)]
    rows = [_row("all_to_all", "forward", what, L, n, d) for what, n, d in fwd]
    if run.recompute != "none":  # the checkpoint's re-run, past the combine (module docstring)
        rows += [_row("all_to_all", "backward", f"{what} (re-run)", L, n, d) for what, n, d in fwd]
    rows += [_row("all_to_all", "backward", "expert output grads", L, back, dt),
             _row("all_to_all", "backward", "routed row grads", L, sent, dt)]
    return (rows + fsdp_collectives(cfg, run, ep if world is None else world, unit_shapes=units(cfg))
            + expert_collectives(cfg, run, ep, world))


def counts(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, hist=None,
           world: int | None = None) -> dict[tuple[str, str, int], int]:
    """{(op, dtype, bytes): calls} of one step on `rank`, the form distributed/counting.py measures."""
    return collective_counts(collectives(cfg, run, ep, rank, hist, world))


def compute_run(run: Run) -> Run:
    """The run as a rank computes it: amp is FSDP2's policy, bf16 parameters without autocast (module docstring)."""
    return replace(run, dtype="bf16") if run.dtype == "amp" else run


def moe_saved(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, hist=None, device: str = "cpu",
              world: int | None = None) -> list[Saved]:
    """What one rank's MoE blocks keep for backward (module docstring)."""
    from llm_anatomy.calculator.moe_efficient import saved_list

    check(cfg, run, ep, rank, world)
    block = saved_list(cfg, compute_run(run), device)
    if run.recompute != "none":  # the checkpoint keeps the block's inputs; the exchange runs inside it
        return block
    if run.dtype == "amp" and efsdp_of(ep, world) == 1:  # the experts' GEMMs on their own bf16 casts, as autocast
        block = [s for s in block if not s.name.startswith("moe.experts.")]
        block += [s for s in saved_list(cfg, run, device) if s.name.startswith("moe.experts.")]
    R, El = received_rows(cfg, run, ep, hist)[rank % ep], cfg.experts // ep
    on_rows = ("moe.experts.xs", "moe.activation.gate_up", "moe.experts.h")
    per_expert = ("moe.experts.gate_up.weight_cast", "moe.experts.down.weight_cast", "moe.experts.offs")
    out = []
    for s in block:
        if s.name in on_rows:
            s = replace(s, shape=(R, *s.shape[1:]))
        elif s.name in per_expert:
            s = replace(s, shape=(El, *s.shape[1:]))
        out.append(s)
    return out + [Saved("moe.ep.pos", (R,), "int64", cfg.layers,
                        "the received rows' sort: its permute and the unsort keep it")]


def saved(cfg: ModelConfig, run: Run, ep: int, rank: int = 0, hist=None, device: str = "cpu",
          world: int | None = None) -> dict[str, int]:
    """{component: bytes} one rank saves for backward: the one-process efficient model's on the rank's batch (as the
    rank computes it: compute_run), "moe" from moe_saved; under amp each Block's bf16 copy of the RoPE tables."""
    from llm_anatomy.calculator import estimate

    out = {}
    for name, comp in estimate(cfg, compute_run(run), "efficient", device=device).components.items():
        out[name] = sum(prod(s.shape) * BYTES["bfloat16"] * cfg.layers
                        if run.dtype == "amp" and s.name in ROPE_TABLES and s.dtype == "float32" else s.bytes
                        for s in comp.saved)
    out["moe"] = sum(s.bytes for s in moe_saved(cfg, run, ep, rank, hist, device, world))
    return out
