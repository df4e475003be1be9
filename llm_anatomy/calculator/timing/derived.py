"""Derived profiles: a GPU without a calibration, timed by carrying the measured H200 profile's behaviour
over to that GPU's datasheet (docs/derived-gpus.md states every rule below with its source; docs/timing.md,
"Profiles", summarises them).

Each kernel class's measured fraction of its datasheet roof is kept, and the roof is the target's:

  GEMMs       rate = (measured asymptotic rate / base bf16 peak) x target bf16 peak; the fp32-accumulate,
              misaligned-vocab and k_half terms carry over unchanged (properties of cuBLAS's kernels'
              main loops and tiles, not of the clock)
  attention   every measured SDPA rate (causal and masked) x target peak / base peak; the CTA schedule's per-block costs
              (o, c) x the base's per-SM peak / the target's per-SM peak; its fixed term (a) unchanged
  memory      copy bandwidth = (measured copy / base datasheet bandwidth) x target bandwidth; each calibrated
              op keeps its fraction of the copy bandwidth (its busy time scales with the bandwidth ratio)
  launch/host the kernel launch cost, the gap between dependent kernels and every host figure are the
              host CPU's and the driver's, not the GPU's: carried over unchanged
  sustained   the share of the datasheet's boost-to-base clock gap a power-limited GEMM (or SDPA) loses,
              measured on the base, applied to the target's own published gap (clocks.py); the memory
              ratio and the clock's time constant carry over unchanged

Within one architecture generation (Hopper -> Hopper) the fractions carry over as the same kernels on the
same SM design; across generations (Ampere, Ada, Blackwell) carrying them over is a stated assumption.

A range (bound "low" / "high") widens the two carried-over quantities that are least certain:
  - the kernel-rate fractions, by SPREAD[same or other generation] each way (capped at the roof);
  - the sustained ratio, from the base clock held (low: the datasheet's guaranteed clock) to the boost
    clock held (high: no power-limit drop).
The point estimate lies inside the range by construction (validations/test_derived_gpus.py checks it).
"""
from __future__ import annotations

from llm_anatomy.calculator import clocks, gpus
from llm_anatomy.calculator.timing.profile import Profile, datasheet

BASE = "h200-measured"  # the packaged measured profile every derived profile carries over
BOUNDS = ("point", "low", "high")
# architecture generation of each table entry (NVIDIA's whitepapers, cited in gpus.py's sources)
GENERATION = {"a100-40gb-sxm": "ampere", "a100-80gb-sxm": "ampere", "rtx-3090": "ampere", "h100-sxm": "hopper",
              "h100-pcie": "hopper", "h200-sxm": "hopper", "b200": "blackwell", "l40s": "ada", "l4": "ada",
              "rtx-4090": "ada"}
# the fractions' relative spread each way: within the base's generation, the widest spread of the GEMM, copy and
# SDPA fractions between the four committed H200 calibrations (profiles/h200.json, reports/h200/timing-probe/
# profile.json, reports/h200/moe-live-profile.json, reports/h200/moe-gptoss-profile.json: 2.8%), rounded up;
# across generations, an assumption
SPREAD = dict(same=0.03, other=0.20)
SPREAD_SOURCE = dict(
    same="the widest spread of a carried fraction between the four committed H200 calibrations (2.8%, the copy "
         "rate; rounded up to 3%; validations/test_derived_gpus.py recomputes it)",
    other="assumption, not a measurement: another generation's cuBLAS, cuDNN and Triton kernels reach a fraction "
          "of their roof within 20% of Hopper's")


def spread(target: str, base: Profile) -> tuple[float, str]:
    """(relative spread each way of the carried fractions, its source) for a target table key."""
    same = GENERATION.get(target) == GENERATION.get(gpus.base_key(base.name) or "")
    return SPREAD["same" if same else "other"], SPREAD_SOURCE["same" if same else "other"]


def _clock_gap(name: str) -> float | None:
    """1 - base / boost clock of a table entry (clocks.py), or None where none is published."""
    c = clocks.clock(name)
    return None if c is None else 1.0 - c[1] / c[0]


def sustained(target: str, base: Profile, bound: str) -> tuple[dict, str]:
    """(the target's sustained_ratio, its source): the base's measured loss as a share of its own
    boost-to-base gap, applied to the target's gap; low: the base clock held; high: the boost clock held."""
    gt, gb = _clock_gap(target), _clock_gap(gpus.base_key(base.name) or "")
    if gt is None or gb is None or not base.sustained_ratio:
        return {}, "no published clocks for this part: no sustained term"
    mem = base.sustained_ratio.get("memory", 1.0)
    if bound == "low":
        r = {c: 1.0 - gt for c in ("matmul", "attention")}
        src = "low bound: the base clock held under load (the datasheet's guaranteed clock, clocks.py)"
    elif bound == "high":
        r = {c: 1.0 for c in ("matmul", "attention")}
        src = "high bound: the boost clock held under load (no power-limit drop)"
    else:
        r = {c: 1.0 - (1.0 - base.sustained_ratio.get(c, 1.0)) / gb * gt for c in ("matmul", "attention")}
        src = (f"{base.name}'s measured loss under its power limit as a share of its boost-to-base clock gap "
               f"({gb:.3f}), applied to this part's gap ({gt:.3f}, clocks.py)")
    return dict(r, memory=mem), src + f"; memory: {base.name}'s measured ratio carried over unchanged"


def _fused_rows(rows: tuple, base: Profile, bw_ratio: float) -> tuple:
    """The base's calibrated op timings with their busy time x bw_ratio (target time per byte / base's), so
    each op keeps its fraction of the copy bandwidth (registry.efficiency) and its launches stay the same."""
    from llm_anatomy.calculator.timing.registry import OPS

    by_rows = {o.rows: o for o in OPS.values()}
    out = []
    for r in rows:
        op = by_rows.get(r["op"])
        fixed = 0.0
        if op is not None:
            fixed = (op.launches(r["width"], r["tokens"]) + (1 if op.own_fill else 0)) * base.launch_s * 1e3
        out.append(dict(r, ms=fixed + (r["ms"] - fixed) * bw_ratio))
    return tuple(out)


def _attention(table: dict, f: float) -> dict:
    """Every FLOP/s figure of a Profile.attention table x f."""
    return {k: _attention(v, f) if isinstance(v, dict) else v * f for k, v in table.items()}


_DERIVED: dict[tuple, tuple[Profile, Profile]] = {}  # (key, bound, id(base)) -> (base, derived): built once


def derive(target: str, bound: str, base: Profile) -> Profile:
    """The derived profile of a GPU table entry (a name as users type it) from a measured base profile
    (lookup.get(BASE): lookup.py resolves the names, `<gpu>-derived[-low|-high]`). One object per (GPU, bound,
    base), so the timing model's per-profile caches (registry, layout) serve every estimate on it."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, not {bound!r}")
    k = gpus.entry(target)["name"]
    hit = _DERIVED.get((k, bound, id(base)))
    if hit is None or hit[0] is not base:
        hit = _DERIVED[(k, bound, id(base))] = (base, _derive(k, bound, base))
    return hit[1]


def _derive(k: str, bound: str, base: Profile) -> Profile:
    ds, bds = datasheet(k), datasheet(gpus.base_key(base.name) or "h200-sxm")
    u, usrc = spread(k, base)
    band = {"point": 1.0, "low": 1.0 - u, "high": 1.0 + u}[bound]
    flops = lambda frac: min(frac * band, 1.0)  # noqa: E731 (a fraction of the roof, never above it)
    peak_ratio = ds.peak_flops["bfloat16"] / bds.peak_flops["bfloat16"]
    gemm = {d: flops(base.matmul_flops[d] / bds.peak_flops[d]) * ds.peak_flops[d] for d in ds.peak_flops}
    copy = flops(base.hbm_Bps / bds.hbm_Bps) * ds.hbm_Bps
    att = min(band, bds.peak_flops["bfloat16"] / max(_peak_att(base), 1.0)) * peak_ratio  # an SDPA rate stays under the roof
    per_sm = (bds.peak_flops["bfloat16"] / bds.sms) / (ds.peak_flops["bfloat16"] / ds.sms) / (att / peak_ratio)
    sched = {be: {hd: {ph: (dict(v, o=v["o"] * per_sm, c=v["c"] * per_sm) if ph in ("forward", "backward") else v)
                       for ph, v in t.items()} for hd, t in hds.items()} for be, hds in base.sdpa_schedule.items()}
    mis_acc = {a: dict(v, rate_flops=v["rate_flops"] * peak_ratio * band) for a, v in
               base.matmul_misaligned_accumulate.items()}
    ratio, ssrc = sustained(k, base, bound)
    ck = {}
    if (c := clocks.clock(k)) is not None:
        ck = dict(boost_MHz=c[0], base_MHz=c[1], tdp_W=c[2])
    b = f"{base.name} ({base.provenance.get('date', 'undated')})"
    kept = f"carried over unchanged from {b}: the host CPU's and the driver's cost, not the GPU's"
    same_kernels = f"carried over unchanged from {b}: a ratio of cuBLAS's kernels, not of the clock"
    sources = dict(
        ds.sources,
        matmul_flops=f"{b}'s GEMM rate as a fraction of its bf16 peak x this part's peak ({ds.sources['peak_flops']})",
        mfu_peak_flops=f"{b}'s best GEMM as a fraction of its peak x this part's peak",
        matmul_k_half=same_kernels, matmul_misaligned=same_kernels, matmul_fp32_accumulate=same_kernels,
        matmul_accumulate_bw=same_kernels, grouped_mm=same_kernels, upcast_bw=same_kernels,
        matmul_misaligned_accumulate=f"{b}'s fallback-kernel rates x the bf16 peak ratio",
        matmul_loop_fit=f"{b}'s back-to-back GEMM fit x the bf16 peak ratio (reports only)",
        hbm_Bps=f"{b}'s copy as a fraction of its datasheet bandwidth x this part's ({ds.sources['hbm_Bps']})",
        attention=f"{b}'s SDPA rates x the bf16 peak ratio ({peak_ratio:.3f})",
        attention_masked=(f"{b}'s masked-SDPA rates x the bf16 peak ratio ({peak_ratio:.3f}), as the causal ones"
                          if base.attention_masked else f"none: {b} has no masked-attention calibration"),
        sdpa_schedule=f"{b}'s CTA costs x the per-SM bf16 peak ratio; the fixed term unchanged",
        fused_rows=f"{b}'s calibrated ops at the same fraction of the copy bandwidth (busy time x bandwidth ratio)",
        launch_s=kept, kernel_gap_s=kept, host_op_s=kept, host_custom_s=kept, optimizer_host=kept, host_step=kept,
        sustained_ratio=ssrc, sustained_tau_s=f"carried over unchanged from {b} (the power controller's response)",
        clocks=clocks.clock(k)[3] if ck else "none published",
        range=f"bound {bound}: kernel-rate fractions x {band:g} ({usrc}); {ssrc}",
        generation=f"{GENERATION.get(k, '?')} from {GENERATION.get(gpus.base_key(base.name) or '', '?')}: "
                   + ("the same SM design, the fractions carry over" if u == SPREAD["same"] else
                      "another generation: carrying the fractions over is a stated assumption"))
    return base.replace(
        name=f"{k}-derived" + ("" if bound == "point" else f"-{bound}"), kind="derived",
        display=f"{ds.display} (derived from {base.name})", sms=ds.sms, memory_GB=ds.memory_GB,
        peak_flops=dict(ds.peak_flops), matmul_flops=gemm,
        mfu_peak_flops=base.mfu_peak_flops / bds.peak_flops["bfloat16"] * ds.peak_flops["bfloat16"],
        hbm_Bps=copy, attention=_attention(base.attention, att), sdpa_schedule=sched,
        attention_masked=_attention(base.attention_masked, att),
        fused_rows=_fused_rows(base.fused_rows, base, (base.hbm_Bps / copy)),
        matmul_misaligned_accumulate=mis_acc, matmul_fit=(),
        matmul_loop_fit=({} if not base.matmul_loop_fit else dict(
            base.matmul_loop_fit, rate_flops=base.matmul_loop_fit["rate_flops"] * peak_ratio)),
        sustained_ratio=ratio, clocks=ck, sources=sources,
        provenance=dict(derived_from=base.name, base_date=base.provenance.get("date"), bound=bound,
                        spread=u if bound != "point" else 0.0))


def _peak_att(base: Profile) -> float:
    """The base's highest SDPA rate at a full wave (FLOP/s): the band never lifts an SDPA rate past the roof."""
    best = 0.0
    for hds in (*base.attention.values(), base.attention_masked):
        for t in hds.values():
            best = max(best, t.get("fwd", 0.0), t.get("fwd_bwd", 0.0))
    return best


def has_derived(name: str) -> bool:
    """Whether a plain table name times with a derived profile: every part but the measured base's own."""
    k = gpus.key(name)
    return k is not None and k != gpus.base_key(BASE)

