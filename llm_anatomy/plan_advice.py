"""What to change when `anatomy plan` finds nothing that fits, each change checked by the planner's own search.

The floor first: weights, gradients and optimizer state, which no micro-batch, recompute policy or sequence
length shrinks (per rank: divided by the ranks under FSDP, whole under DDP or on one GPU). Then the changes,
each one plan() run again with it and kept only where something fits:
  gpus       the fewest GPUs that fit (FSDP shards the floor): doubling, then bisection, over --gpus;
  dtype      bf16 weights (--dtype bf16: parameters, gradients and AdamW's moments in bf16);
  recompute  every policy of the variant, where --recompute narrowed them;
  seq        the longest --seq, halving, where the floor itself fits;
  gpu        the smallest GPU of the table with more memory that fits.
Pure Python: no torch, nothing is built or allocated.
"""
from __future__ import annotations

from llm_anatomy.calculator import gpus as gpu_table
from llm_anatomy.config import ConfigError, ModelConfig
from llm_anatomy.plan import POLICIES, plan

MAX_GPUS = 2**14  # the fewest-GPUs search stops here: beyond it, a model needs more than data parallelism
MIN_SEQ = 16  # the shortest sequence offered


def floor_bytes(cfg: ModelConfig, kw: dict) -> tuple[int, str]:
    """(per-rank bytes of weights, gradients and optimizer state, which strategy that is) for the plan kw."""
    from llm_anatomy.calculator.dtypes import dtypes
    from llm_anatomy.calculator.memory import model_state_bytes
    from llm_anatomy.config import Run

    param = dtypes(Run(batch=1, seq=kw["seq"], dtype=kw["dtype"])).param
    params, opt = model_state_bytes(cfg, kw["variant"], param, kw["optimizer"], True)
    whole = 2 * params + opt  # the gradients are the parameters' size and dtype
    n = kw["gpus_n"]
    if n > 1 and "fsdp" in (kw.get("strategies") or ("ddp", "fsdp")):
        return -(-whole // n), f"sharded over {n} GPUs (fsdp)"
    return whole, "on one GPU" if n == 1 else "on each GPU (ddp keeps them whole)"


def _fits(cfg: ModelConfig, kw: dict) -> dict | None:
    """The planner's verdict for kw: its best candidate, or None when nothing fits."""
    return plan(cfg, **kw)["best"]


def _fits_modelled(cfg: ModelConfig, kw: dict) -> dict | None:
    """_fits, or None where kw asks for what the memory phases do not model (a one-line ConfigError): fp32
    weights run a mixture of experts on the loop-of-mm fallback (calculator/moe.py)."""
    try:
        return _fits(cfg, kw)
    except ConfigError:
        return None


def fewest_gpus(cfg: ModelConfig, kw: dict) -> tuple[int, dict] | None:
    """(the fewest GPUs on which the plan fits, its best candidate), or None up to MAX_GPUS. The per-rank
    peak falls as FSDP shards over more ranks, so the first fitting count is found by doubling, then bisection."""
    at = lambda n: _fits(cfg, dict(kw, gpus_n=n, strategies=None))  # noqa: E731
    lo, hi = kw["gpus_n"], max(2, 2 * kw["gpus_n"])
    if kw.get("strategies") and (best := at(lo)) is not None:  # --strategy narrowed the search: both strategies
        return lo, best
    try:
        while hi <= MAX_GPUS and (best := at(hi)) is None:
            lo, hi = hi, 2 * hi
    except ConfigError:  # more ranks than the model has rows to shard: no count past here plans at all
        return None
    if hi > MAX_GPUS:
        return None
    while hi - lo > 1:  # nothing fits at lo, something at hi
        mid = (lo + hi) // 2
        if (b := at(mid)) is None:
            lo = mid
        else:
            hi, best = mid, b
    return hi, best


def longest_seq(cfg: ModelConfig, kw: dict) -> tuple[int, dict] | None:
    """(the longest sequence, halving from --seq, at which the plan fits, its best candidate), or None."""
    seq = kw["seq"] // 2
    while seq >= MIN_SEQ:
        if (best := _fits(cfg, dict(kw, seq=seq))) is not None:
            return seq, best
        seq //= 2
    return None


def larger_gpu(cfg: ModelConfig, kw: dict, capacity: int) -> tuple[str, dict] | None:
    """(the table's GPU with the least memory above `capacity` on which the plan fits, its best), or None."""
    for cap, name in sorted((gpu_table.capacity_bytes(k)[0], k) for k in gpu_table.GPUS):
        if cap > capacity and (best := _fits(cfg, dict(kw, gpu=name))) is not None:
            return name, best
    return None


def advise(cfg: ModelConfig, out: dict, kw: dict) -> dict:
    """For a plan where nothing fits (out, made from plan(cfg, **kw)): the floor and the changes that fit.
    Each suggestion: what (words), changes (plan() keywords), best (the planner's verdict with them)."""
    floor, where = floor_bytes(cfg, kw)
    found = []
    if (g := fewest_gpus(cfg, kw)) is not None:
        found.append(dict(what=f"the fewest GPUs that fit, {g[0]:,}", changes=dict(gpus_n=g[0], strategies=None), best=g[1]))
    if kw["dtype"] != "bf16" and (b := _fits_modelled(cfg, dict(kw, dtype="bf16"))) is not None:
        found.append(dict(what="bf16 weights (parameters, gradients and optimizer state in bf16)",
                          changes=dict(dtype="bf16"), best=b))
    narrowed = kw.get("recomputes") and set(kw["recomputes"]) != set(POLICIES[kw["variant"]])
    if narrowed and (b := _fits(cfg, dict(kw, recomputes=None))) is not None:
        found.append(dict(what="every recompute policy", changes=dict(recomputes=None), best=b))
    if floor <= out["budget_bytes"] and (s := longest_seq(cfg, kw)) is not None:
        found.append(dict(what=f"a shorter sequence, {s[0]:,}", changes=dict(seq=s[0]), best=s[1]))
    if (g := larger_gpu(cfg, kw, out["capacity_bytes"])) is not None:
        found.append(dict(what=f"a larger GPU, {gpu_table.GPUS[g[0]]['display']}", changes=dict(gpu=g[0]), best=g[1]))
    return dict(floor_bytes=floor, floor_where=where, floor_fits=floor <= out["budget_bytes"], suggestions=found)
