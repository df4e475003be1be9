"""`anatomy plan`: the fastest run of a model that fits a GPU, found from the calculator alone.

For each data-parallel strategy (one GPU: none; several: ddp and fsdp) and each recompute policy (the
efficient variant: none, mlp, full; the baseline has none), the largest micro-batch whose predicted
per-rank peak fits the budget is found by bisection (peak grows with the micro-batch), and timed:
  budget       the GPU's allocatable memory (calculator/gpus.py capacity_bytes: what an idle device
               reports free) x (1 - margin);
  peak         one GPU: the largest memory phase (calculator/memory.py phases); N GPUs: the per-rank
               peak (calculator/sharding.py per_rank_peak) with sharded states, FSDP's gathered units
               and DDP's buckets;
  step         the timing model's steady step (back-to-back steps) for one rank's micro-batch, plus
               the communication compute does not hide (calculator/comm.py), with the optimizer
               over the rank's own shard under FSDP;
  tokens/s     gpus x micro-batch x seq / step;
  MFU          model FLOPs of the step / (step x the datasheet's dense peak), the usual convention.
With a global batch (sequences per optimizer step over all GPUs), each rank runs the largest micro-batch that
fits and divides its share, and accumulates gradients over share / micro-batch micro-steps: each micro-step is a
whole forward and backward with its collectives (DDP and FSDP2 synchronize every backward unless told not to), the
optimizer steps once. With a token budget, the time and GPU-hours to train it at the planned speed.
The fastest setting that fits is the plan. Pure Python: no torch, nothing is built or allocated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from llm_anatomy.calculator import gpus
from llm_anatomy.config import ConfigError, ModelConfig, Run

POLICIES = {"efficient": ("none", "mlp", "full"), "baseline": ("none",)}
DEFAULT_MARGIN = 0.05  # the memory model's error on real configs (within 1.2% on the H200) + allocator slack
MAX_MICRO_BATCH = 4096  # the bisection's ceiling: far past any batch a real GPU holds at seq >= 128


@dataclass(frozen=True)
class Candidate:
    strategy: str  # "single" on one GPU, else ddp / fsdp
    recompute: str
    lean: bool  # the efficient variant's lean block (Run.lean): without recompute, unless --no-lean
    micro_batch: int  # the largest that fits the budget (and divides a rank's share of a global batch), 0 if none
    peak_bytes: int  # per rank, at micro_batch (at 1 when none fits)
    fits: bool
    step_s: float | None  # None when nothing fits, or the profile cannot time it (plan()["untimed"] says why)
    comm_exposed_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    accum: int = 1  # micro-steps per optimizer step (a global batch's share / micro_batch)


def table_entry(gpu: str) -> dict:
    """The GPU table's entry a --gpu name, profile name or profile .json stands for (capacity and links come
    from it)."""
    from llm_anatomy.calculator.timing import lookup

    k = gpus.base_key(gpu)
    if k is not None:
        return gpus.entry(k)
    prof = lookup.get(gpu)
    e = gpus.for_device_name(prof.display) or gpus.for_device_name(prof.name)
    if e is None:
        raise ConfigError(f"profile {prof.name!r} names no GPU of the table ({', '.join(gpus.GPUS)}): its memory and "
                          "links are unknown")
    return e


def peak_bytes(cfg: ModelConfig, run: Run, variant: str, world: int, strategy: str, optimizer: str) -> int:
    """Predicted per-rank peak of allocated bytes on CUDA, in a step after the first."""
    if world == 1:
        from llm_anatomy.calculator.memory import phases

        ph = phases(cfg, run, variant, optimizer=optimizer, device="cuda")
        return max(ph["forward_peak"] or 0, ph["backward_peak"], ph["forward_end"])
    from llm_anatomy.calculator.sharding import per_rank_peak

    return per_rank_peak(cfg, run, variant, world, strategy, optimizer=optimizer, device="cuda")["peak"]


def largest_fitting(fits, ceiling: int = MAX_MICRO_BATCH) -> int:
    """The largest b in [1, ceiling] with fits(b), for a fits() that is true up to some b and false after;
    0 if fits(1) is false. Doubling, then bisection: O(log b) calls."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= ceiling and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, ceiling + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the ceiling)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def step_time(cfg: ModelConfig, run: Run, variant: str, gpu: str, world: int, strategy: str, optimizer: str,
              gpus_per_node: int) -> dict:
    """Seconds of one steady step of one rank: compute (timing model) + exposed communication."""
    from llm_anatomy.calculator.timing import estimate_time

    t = estimate_time(cfg, run, variant, gpu=gpu, optimizer=optimizer)
    fb, opt = t["steady"]["forward_backward_s"], t["optimizer_s"]
    exposed = 0.0
    if world > 1:
        from llm_anatomy.calculator.comm import estimate_distributed

        ph = t["phases"]
        compute = dict(forward=ph["forward"]["gpu_s"], backward=ph["backward"]["gpu_s"])  # what hides comm
        d = estimate_distributed(cfg, run, world, strategy, variant=variant, optimizer=optimizer, gpu=table_entry(gpu)["name"],
                                 gpus_per_node=gpus_per_node, compute_s=compute)
        exposed = d["comm"]["exposed_s"]
        if strategy == "fsdp":
            opt /= world  # each rank steps its own shard
    step = fb + opt + exposed
    model_flops = t["mfu"]["model"] * t["forward_backward_s"] * t["mfu"]["peak_flops"]  # 6N-style, per rank
    peak = table_entry(gpu)["bf16_tflops" if run.dtype != "fp32" else "fp32_tflops"] * 1e12
    return dict(step_s=step, comm_exposed_s=exposed, mfu=model_flops / step / peak, optimizer_s=opt,
                model_flops=model_flops, peak_flops=peak)


def accumulated(t: dict, accum: int) -> dict:
    """One optimizer step of `accum` micro-steps, from step_time()'s one: every micro-step's forward, backward and
    exposed communication, one optimizer step."""
    step = accum * (t["step_s"] - t["optimizer_s"]) + t["optimizer_s"]
    return dict(t, step_s=step, comm_exposed_s=accum * t["comm_exposed_s"],
                mfu=accum * t["model_flops"] / step / t["peak_flops"])


def split_global_batch(global_batch: int | None, dp: int, fitting: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for a rank's share of a global batch: the largest divisor of the share
    that is at most the largest micro-batch that fits. Without a global batch: (fitting, 1)."""
    if global_batch is None or fitting == 0:
        return fitting, 1
    share = global_batch // dp
    m = max(d for d in range(1, min(share, fitting) + 1) if share % d == 0)
    return m, share // m


def check_global_batch(global_batch: int | None, dp: int) -> None:
    if global_batch is None:
        return
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"--global-batch must be a positive whole number of sequences, got {global_batch!r}")
    if global_batch % dp:
        raise ConfigError(f"--global-batch {global_batch:,} does not split evenly over {dp:,} data-parallel ranks "
                          f"(take a multiple of {dp:,})")


def token_budget(tokens: float | None, tokens_per_s: float, gpus_n: int) -> dict | None:
    """Wall time and GPU-hours to train `tokens` tokens at `tokens_per_s`."""
    if tokens is None:
        return None
    seconds = tokens / tokens_per_s
    return dict(tokens=tokens, seconds=seconds, days=seconds / 86400, gpu_hours=seconds / 3600 * gpus_n)


def _check(gpus_n: int, gpus_per_node: int, margin: float, seq: int) -> None:
    for name, v in (("--gpus", gpus_n), ("--gpus-per-node", gpus_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**20:
            raise ConfigError(f"{name} must be a whole number from 1 to {2**20:,}, got {v!r}")
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin must be a fraction in [0, 1), got {margin!r}")
    Run(batch=1, seq=seq)  # the sequence's own checks


def plan(cfg: ModelConfig, *, gpu: str, seq: int, gpus_n: int = 1, gpus_per_node: int = 8, optimizer: str = "adamw",
         margin: float = DEFAULT_MARGIN, variant: str = "efficient", dtype: str = "amp",
         strategies: tuple[str, ...] | None = None, recomputes: tuple[str, ...] | None = None,
         lean: bool = True, global_batch: int | None = None, tokens: float | None = None,
         meshes: bool = True) -> dict:
    """Every (strategy, recompute) candidate at its largest fitting micro-batch, and the fastest. JSON-able.
    lean: the efficient variant runs its lean block where it applies (no recompute). global_batch: sequences
    per optimizer step over all GPUs (gradient accumulation follows); tokens: a budget to price. meshes: on
    several GPUs, unless strategies narrows the plan to data parallelism, also the tensor- and pipeline-parallel
    meshes (plan_mesh.py), for a mixture of experts the expert-parallel ones (why none ran: `ep_skipped`);
    `mesh_winner` is the fastest mesh where it beats data parallelism."""
    _check(gpus_n, gpus_per_node, margin, seq)
    check_global_batch(global_batch, gpus_n)
    if tokens is not None and not (isinstance(tokens, (int, float)) and not isinstance(tokens, bool)
                                   and 0 < tokens < float("inf")):
        raise ConfigError(f"--tokens must be a positive number of tokens, got {tokens!r}")
    if variant not in POLICIES:
        raise ConfigError(f"unknown variant {variant!r}; choose baseline or efficient")
    entry = table_entry(gpu)
    narrowed = strategies is not None  # --strategy: data parallelism only
    capacity, capacity_source = gpus.capacity_bytes(entry["name"])
    budget = int(capacity * (1 - margin))
    if strategies is None:
        strategies = ("single",) if gpus_n == 1 else ("ddp", "fsdp")
    elif gpus_n == 1:
        raise ConfigError("--strategy needs --gpus 2 or more")
    recomputes = recomputes or modelled_policies(cfg, variant, seq, dtype, lean)
    if bad := [r for r in recomputes if r not in POLICIES[variant]]:
        raise ConfigError(f"recompute {bad[0]!r} is not a policy of the {variant} variant "
                          f"({', '.join(POLICIES[variant])})")
    if cfg.moe:  # a policy the memory phases do not model for experts: one line (calculator/moe.py)
        from llm_anatomy.calculator.moe import refuse_phases

        for rc in recomputes:
            refuse_phases(cfg, Run(1, seq, dtype, rc, lean=lean and rc == "none"), variant, what="anatomy plan")
    rows, skipped = [], []  # skipped: "strategy, recompute: why", settings whose memory phases are not modelled
    untimed = []  # why a setting that fits has no time on this profile
    for strategy in strategies:
        for rc in recomputes:
            lb = lean and variant == "efficient" and rc == "none"
            if why := strategy_unmodelled(cfg, Run(1, seq, dtype, rc, lean=lb), variant, strategy):
                skipped.append(f"{strategy}, recompute {rc}: {why}")
                continue
            mk = lambda b: Run(batch=b, seq=seq, dtype=dtype, recompute=rc, lean=lb)  # noqa: E731
            need = lambda b: peak_bytes(cfg, mk(b), variant, gpus_n, strategy, optimizer)  # noqa: E731
            b = largest_fitting(lambda b: need(b) <= budget, max_batch(seq))
            if b == 0:
                rows.append(Candidate(strategy, rc, lb, 0, need(1), False, None, None, None, None))
                continue
            b, accum = split_global_batch(global_batch, gpus_n, b)
            try:
                t = accumulated(step_time(cfg, mk(b), variant, gpu, gpus_n, strategy, optimizer, gpus_per_node),
                                accum)
            except ConfigError as e:  # it fits; the profile cannot time it (e.g. no masked-attention rows)
                untimed.append(str(e))
                rows.append(Candidate(strategy, rc, lb, b, need(b), True, None, None, None, None, accum))
                continue
            rows.append(Candidate(strategy, rc, lb, b, need(b), True, t["step_s"], t["comm_exposed_s"],
                                  gpus_n * accum * b * seq / t["step_s"], t["mfu"], accum))
    if not rows:  # every data-parallel setting runs a path the phases do not model (strategy_unmodelled)
        raise ConfigError(f"{skipped[0]} not modelled yet (config {cfg.name})")
    fitting = [r for r in rows if r.fits and r.step_s is not None]
    best = max(fitting, key=lambda r: r.tokens_per_s) if fitting else None
    spread = None  # a derived profile's plausible range of the best setting (timing/derived.py)
    if best is not None and (bounds := derived_bounds(gpu)) is not None:
        spread = dict(source=bounds.pop("source"))
        for b, name in bounds.items():
            t = accumulated(step_time(cfg, mk_run(best, seq, dtype), variant, name, gpus_n, best.strategy, optimizer,
                                      gpus_per_node), best.accum)
            tps = gpus_n * best.accum * best.micro_batch * seq / t["step_s"]
            spread[b] = dict(gpu=name, step_s=t["step_s"], tokens_per_s=tps, mfu=t["mfu"],
                             budget=token_budget(tokens, tps, gpus_n))
    mesh_rows = []
    ep_skipped = []  # a mixture of experts: why expert parallel was not searched (mesh_rules.check_ep's words)
    if meshes and gpus_n > 1 and not narrowed:
        from llm_anatomy.plan_mesh import ep_refusals, search

        ep_skipped = ep_refusals(cfg, gpus_n, seq, dtype, variant, recomputes, lean)

        peak_flops = entry["bf16_tflops" if dtype != "fp32" else "fp32_tflops"] * 1e12
        mesh_rows = search(cfg, gpu=gpu, seq=seq, gpus_n=gpus_n, gpus_per_node=gpus_per_node, budget=budget,
                           variant=variant, dtype=dtype, optimizer=optimizer, recomputes=recomputes, lean=lean,
                           global_batch=global_batch, peak_flops=peak_flops,
                           largest=lambda fits: largest_fitting(fits, max_batch(seq)), untimed=untimed)
    winner = None
    if mesh_rows and (best is None or mesh_rows[0]["tokens_per_s"] > best.tokens_per_s):
        winner = dict(mesh_rows[0], budget=token_budget(tokens, mesh_rows[0]["tokens_per_s"], gpus_n))
    return dict(config=cfg.to_dict(), variant=variant, lean=lean and variant == "efficient", gpu=gpu, gpu_entry=entry["name"], gpus=gpus_n,
                meshes=mesh_rows, mesh_winner=winner, ep_skipped=ep_skipped, skipped=skipped,
                untimed=list(dict.fromkeys(untimed)),
                profile_kind=profile_kind(gpu), range=spread, global_batch=global_batch,
                budget=token_budget(tokens, best.tokens_per_s, gpus_n) if best else None,
                gpu_rule=gpus.rule(gpu), gpus_per_node=gpus_per_node, seq=seq, dtype=dtype, optimizer=optimizer, margin=margin,
                capacity_bytes=capacity, capacity_source=capacity_source, budget_bytes=budget,
                candidates=[asdict(r) for r in rows], best=asdict(best) if best else None)


def strategy_unmodelled(cfg: ModelConfig, run: Run, variant: str, strategy: str) -> str | None:
    """What the memory phases do not model for this data-parallel strategy, in words, or None. FSDP2 computes at
    its all-gather dtype, amp's bf16 parameters without autocast (calculator/sharding.py), so for a mixture of
    experts the rule is calculator/moe.py's at that dtype (a path DDP and one GPU, under autocast, may not take)."""
    if not cfg.moe or strategy != "fsdp":
        return None
    from llm_anatomy.calculator.moe import phases_unmodelled

    crun = Run(run.batch, run.seq, "bf16" if run.dtype in ("amp", "bf16") else "fp32", run.recompute, lean=run.lean)
    return phases_unmodelled(cfg, crun, variant)


def modelled_policies(cfg: ModelConfig, variant: str, seq: int, dtype: str, lean: bool) -> tuple[str, ...]:
    """The variant's recompute policies the memory phases model for this config: all of them, but for a mixture of
    experts only those calculator/moe.py's phases_unmodelled passes (the first policy when none does, for
    plan() to refuse in its words)."""
    if not cfg.moe:
        return POLICIES[variant]
    from llm_anatomy.calculator.moe import phases_unmodelled

    ok = tuple(rc for rc in POLICIES[variant]
               if phases_unmodelled(cfg, Run(1, seq, dtype, rc, lean=lean and rc == "none"), variant) is None)
    return ok or POLICIES[variant][:1]


def from_datasheet(gpu: str) -> bool:
    """Whether --gpu names the datasheet figures (a roofline without calibration) rather than a measured profile."""
    return profile_kind(gpu) == "datasheet"


def profile_kind(gpu: str) -> str:
    """The kind of profile --gpu times with: datasheet, derived (timing/derived.py) or measured."""
    from llm_anatomy.calculator.timing import lookup

    return lookup.get(gpu)["kind"]


def derived_bounds(gpu: str) -> dict | None:
    """{low, high: profile name, source: what the range spans} where --gpu times with a derived profile."""
    from llm_anatomy.calculator.timing import lookup

    names = lookup.bound_names(gpu)
    return None if names is None else dict(names, source=lookup.range_source(gpu))


def mk_run(c: Candidate, seq: int, dtype: str) -> Run:
    """The run a candidate stands for."""
    return Run(batch=c.micro_batch, seq=seq, dtype=dtype, recompute=c.recompute, lean=c.lean)


def max_batch(seq: int) -> int:
    """The bisection's ceiling for a sequence length: Run's own token limit, and MAX_MICRO_BATCH."""
    from llm_anatomy.config import MAX_TOKENS

    return max(1, min(MAX_MICRO_BATCH, MAX_TOKENS // seq))
