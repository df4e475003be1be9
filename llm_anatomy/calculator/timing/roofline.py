"""The time of one kernel on a profile: a roofline with the GEMM, attention and bandwidth efficiencies.

    t = max(FLOPs / rate, bytes / bandwidth) + launch        bound = whichever term is larger

  matmul   rate = the profile's asymptotic GEMM rate x matmul_efficiency(m, n, k) (tile and wave
           quantization over the SMs, split-K for skinny weight gradients), x the measured slowdown
           of a bf16 GEMM with a dimension (the vocab) that is not a multiple of 8 (alignment_factor;
           1 for a datasheet profile), x the fp32-accumulate ratio for Liger's grad_weight under amp
  sdpa     the kernel's CTA schedule where the profile fitted one (sdpa_schedule.py), else the
           profile's rate for that backend and head dim scaled by wave quantization; under an additive
           mask (backend MASKED) the masked kernel's own calibrated rate (masked_rate), scaled likewise
  memory   FLOPs ignored (at most ~10 per element, far under the ridge); bytes at the copy bandwidth
           times the op's calibrated efficiency (registry.efficiency; 1 without a calibration)
  launch   a kernel smaller than its launch cost is launch-bound (the queued launch cost); a kernel of
           real size waits for the one before to drain (the calibrated gap, where measured)

Sustained load (weight w in [0, 1], from the step's length: sustained_weight): a compute-bound term runs
at rate x (1 - w + w x sustained_ratio["matmul" | "attention"]), a memory term at bandwidth x (1 - w + w x
sustained_ratio["memory"]); the launch terms do not change. w = 0 is the burst regime calibrate's rates
are measured in.

Assumptions: compute and memory overlap perfectly inside a kernel (the max, not the sum); a memory-bound
kernel moves exactly its minimal bytes (no L2 reuse); the library picks the best tile and split.
"""
from __future__ import annotations

import math
from functools import lru_cache

import llm_anatomy.calculator.timing.registry as registry
import llm_anatomy.calculator.timing.sdpa_schedule as sdpa_schedule
from llm_anatomy.calculator.timing.ops import MASKED, Kernel, causal_attention_flops, masked_attention_flops  # noqa: F401
from llm_anatomy.calculator.timing.profile import Profile, from_dict
from llm_anatomy.config import ConfigError

# ---- the GEMM efficiency model -------------------------------------------------------------------
TILES = ((128, 128), (128, 256), (256, 128))  # CTA output tiles cuBLAS/CUTLASS pick among on Hopper
MAX_SPLIT_K = 16  # split-K the library considers for a weight gradient with fewer tiles than SMs


@lru_cache(maxsize=8192)  # a pure function of the shape, asked for the same shapes in every estimate
def matmul_efficiency(m: int, n: int, k: int, sms: int, k_half: float = 0.0, batch: int = 1) -> float:
    """Fraction of the asymptotic GEMM rate a (batch x) m x n x k matmul can reach.

    Tile and wave quantization: C is cut into tm x tn tiles, one CTA per tile, `sms` CTAs per wave;
    the last wave is partly idle and edge tiles are partly padding, so the useful fraction is
    m*n / (waves * sms * tm * tn). Split-K: when the tiles are fewer than the SMs (a weight
    gradient: m*n small, k = tokens large), K is split s ways so tiles * s fill the waves (the
    partial sums' reduction is small against the main loop and not counted). The library is
    assumed to pick the best tile and split. Then k / (k + k_half) charges each tile's prologue and
    epilogue against its main loop."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for s in range(1, MAX_SPLIT_K + 1):
            if s > 1 and (tiles >= sms or k // s < 256):
                break
            waves = math.ceil(tiles * s / sms)
            eff = batch * m * n * s / (waves * sms * tm * tn)
            kk = k / s
            best = max(best, eff * kk / (kk + k_half) if k_half else eff)
    return best


def alignment_class(d: int, elems: int = 8) -> int | None:
    """None when d is a multiple of `elems` (8 bf16 elements: 16 bytes, what the fastest GEMM kernels
    load); else the largest power of two dividing d (1, 2 or 4)."""
    return None if d % elems == 0 else d & -d


def alignment_factor(prof: dict, m: int, n: int, k: int) -> float:
    """The measured slowdown of a bf16 GEMM whose m, n or k is not a multiple of 8 (1.0 when the
    profile measured none: a datasheet profile does not model it)."""
    table, f = prof.get("matmul_misaligned") or {}, 1.0
    for dim, d in (("m", m), ("n", n), ("k", k)):
        a = alignment_class(d)
        if a is not None:
            f *= table.get(str(a), {}).get(dim, 1.0)
    return f


def attention_wave_efficiency(batch: int, heads: int, seq: int, sms: int, block_q: int = 128) -> float:
    """Flash-style SDPA runs one CTA per (batch, head, 128-query block): wave quantization only."""
    tiles = batch * heads * math.ceil(seq / block_q)
    return tiles / (math.ceil(tiles / sms) * sms)


# ---- the sustained-load regime -------------------------------------------------------------------
def sustained_weight(gpu_s: float, tau_s: float) -> float:
    """The sustained regime's weight in a step's mean rates: the step starts at burst rates and the clock
    relaxes toward the power-limited one with time constant tau, rate(t) = sustained + (burst - sustained)
    exp(-t / tau), so over a step of GPU time T the mean rate is burst x (1 - w + w x ratio) with
    w = 1 - (tau / T)(1 - exp(-T / tau)): ~T / (2 tau) for a short step, -> 1 for a step many tau long.
    0 where tau or T is not positive."""
    if tau_s <= 0 or gpu_s <= 0:
        return 0.0
    x = gpu_s / tau_s
    return 1.0 - (1.0 - math.exp(-x)) / x if x > 1e-6 else x / 2


def regime_speed(prof: Profile, weight: float, cls: str) -> float:
    """Rate factor of rate class `cls` (matmul, attention, memory) at sustained weight `weight`."""
    if not weight or not prof.sustained_ratio:
        return 1.0
    return 1.0 - weight + weight * prof.sustained_ratio.get(cls, 1.0)


# ---- one kernel --------------------------------------------------------------------------------
def sdpa_rate(prof: dict, backend: str, head_dim: int, phase: str, seq: int | None = None) -> tuple[float, str]:
    """FLOP/s at a full wave for one SDPA pass, and where it comes from. Where calibrate measured several
    sequence lengths, the rate is interpolated in log(S) between them (flat beyond): a shorter sequence
    gives each query block fewer key blocks to amortise its prologue and epilogue over."""
    table = prof["attention"]
    if not table:
        return prof["matmul_flops"]["bfloat16"], "roofline at the bf16 matmul rate (no attention measurement)"
    if backend not in table:
        raise ConfigError(f"gpu profile {prof['name']!r} has no {backend!r} attention measurement "
                          f"({', '.join(table)})")
    hds = table[backend]
    key = str(head_dim) if str(head_dim) in hds else min(hds, key=lambda h: abs(int(h) - head_dim))
    f, fb = hds[key]["fwd"], hds[key]["fwd_bwd"]
    by_seq = hds[key].get("seq") or {}
    if seq is not None and len(by_seq) > 1:
        f, fb = (registry.log_interp([(math.log(int(s_)), v[k]) for s_, v in by_seq.items()], math.log(seq))
                 for k in ("fwd", "fwd_bwd"))
    note = f"{backend} hd{key}" + ("" if key == str(head_dim) else f" (nearest measured to hd{head_dim})")
    if phase == "forward":
        return f, note
    return 2.5 / (3.5 / fb - 1 / f), note  # backward = the fwd+bwd time minus the forward time


def masked_rate(prof: dict, head_dim: int, phase: str, seq: int) -> tuple[float, str]:
    """FLOP/s at a full wave of cuDNN's SDPA under an additive mask at the head dim it is called with (sinks: hd +
    their pad), and where it comes from: the calibrated rate of the nearest head dim in the class cuDNN runs it
    in (sdpa_schedule.padded_head_dim), interpolated in log(S) as sdpa_rate. A profile with measured causal
    rates and no masked ones refuses: the masked kernel is another kernel, never priced at the causal rate."""
    table = prof.get("attention_masked") or {}
    if not table:
        if not prof["attention"]:  # a datasheet profile: the bf16 peak, as its causal SDPA (its sources say so)
            return prof["matmul_flops"]["bfloat16"], "roofline at the bf16 matmul rate (no attention measurement)"
        raise ConfigError(f"gpu profile {prof['name']!r} has no masked-attention calibration (measurements."
                          "attention_masked: `anatomy calibrate` measures it), so it cannot time SDPA under an "
                          "additive mask (attention sinks, sliding windows)")
    cls = sdpa_schedule.padded_head_dim(head_dim)
    key = min(table, key=lambda h: (sdpa_schedule.padded_head_dim(int(h)) != cls, abs(int(h) - head_dim)))
    f, fb = table[key]["fwd"], table[key]["fwd_bwd"]
    by_seq = table[key].get("seq") or {}
    if len(by_seq) > 1:
        f, fb = (registry.log_interp([(math.log(int(s_)), v[k]) for s_, v in by_seq.items()], math.log(seq))
                 for k in ("fwd", "fwd_bwd"))
    note = f"{MASKED} hd{key}" + ("" if key == str(head_dim) else f" (nearest measured to hd{head_dim})")
    return (f if phase == "forward" else 2.5 / (3.5 / fb - 1 / f)), note


def launch_term(prof: Profile) -> float:
    """The launch term of a kernel of real size: it waits for the one before to drain (the calibrated
    gap, where measured, else the queued launch cost)."""
    return max(prof.launch_s, prof.kernel_gap_s)


def kernel_terms(kern: Kernel, prof: Profile) -> tuple[float, float, str, float, str]:
    """One launch's burst-rate terms: (compute seconds, memory seconds, the compute's rate class, its rate,
    the rate's note). The sustained regime rescales them (finish), so a step's kernels are priced once."""
    if kern.kind == "memory" and not kern.accumulate:  # most entries: bytes at the copy bandwidth x the op's efficiency
        eff = registry.efficiency(prof, *kern.fused) if kern.fused else _plain(kern, prof)
        return 0.0, kern.bytes / (prof.hbm_Bps * eff), "matmul", 0.0, ""
    t_c, rate, note = 0.0, 0.0, ""
    if kern.kind == "matmul":
        b, m, n, k = kern.shape
        mis = prof.matmul_misaligned_accumulate.get(str(alignment_class(m))) if kern.accumulate else None
        if mis is not None and kern.dtype in ("bfloat16", "float16"):  # the fallback kernel's own fit
            rate = mis["rate_flops"] * matmul_efficiency(m, n, k, prof.sms, mis["k_half"], b)
        else:
            rate = prof.matmul_flops[kern.dtype] * matmul_efficiency(m, n, k, prof.sms, prof.matmul_k_half, b)
            if kern.dtype in ("bfloat16", "float16") and (m | n | k) & 7:  # else a factor of 1.0
                rate *= alignment_factor(prof, m, n, k)
            if kern.accumulate:
                rate *= prof.matmul_fp32_accumulate
            if kern.fused:  # ("grouped_mm", role): the grouped kernel's calibrated fraction of the dense rate
                rate *= prof.grouped_mm.get(kern.fused[1], 1.0)
    elif kern.kind == "sdpa" and kern.backend == MASKED:
        B, nh, S, hd = kern.shape
        rate, note = masked_rate(prof, hd, kern.op_phase or kern.phase, S)
        rate *= attention_wave_efficiency(B, nh, S, prof.sms) if prof.attention else 1.0
    elif kern.kind == "sdpa":
        B, nh, S, hd = kern.shape
        sched, note = sdpa_schedule.lookup(prof, kern.backend, hd)
        ph = kern.op_phase or kern.phase
        if sched:  # the kernel's whole duration, from its CTAs' makespan (sdpa_schedule); its launch is in it
            t_sched = sdpa_schedule.kernel_s(sched[ph], B, nh, S, prof.sms, ph)
            rate = kern.flops / max(t_sched - launch_term(prof), 1e-9)
        else:
            rate, note = sdpa_rate(prof, kern.backend, hd, ph, S)
            rate *= attention_wave_efficiency(B, nh, S, prof.sms) if prof.attention else 1.0
    if rate:
        t_c = kern.flops / rate
    eff = registry.efficiency(prof, *kern.fused) if kern.fused and kern.kind == "memory" else _plain(kern, prof)
    if kern.accumulate:  # its epilogue streams the fp32 accumulator below copy bandwidth (fit.accumulate_bandwidth)
        eff = prof.matmul_accumulate_bw
    t_m = kern.bytes / (prof.hbm_Bps * eff)
    return t_c, t_m, "attention" if kern.kind == "sdpa" else "matmul", rate, note


def _plain(kern: Kernel, prof: Profile) -> float:
    """A memory kernel's fraction of the copy bandwidth without a registry op: a widening cast (backend "upcast":
    torch's unrolled cast kernel, bf16 -> fp32) at the calibrated upcast_bw, every other copy at 1."""
    return prof.upcast_bw if kern.backend == "upcast" else 1.0


def step_terms(ks: list[Kernel], prof: Profile) -> tuple[list[tuple], float]:
    """([kernel_terms of each kernel], the kernels' GPU seconds at burst rates: each max(compute, memory) plus
    its launch or the gap, x its count, summed in list order) in one pass; a plain memory-bound entry (most of
    a step's) priced as kernel_terms prices it, written out."""
    hbm, launch, gap = prof.hbm_Bps, prof.launch_s, launch_term(prof)
    efficiency, known = registry.efficiency, registry.known(prof)
    terms, burst = [], 0
    for k in ks:
        if k.kind == "memory" and not k.accumulate:
            f = k.fused
            if not f:
                eff = prof.upcast_bw if k.backend == "upcast" else 1.0
            elif len(f) != 3 or (eff := known.get(f)) is None:  # efficiency's own memo, read first
                eff = efficiency(prof, *f)
            t_m = k.bytes / (hbm * eff)
            terms.append((0.0, t_m, "matmul", 0.0, ""))
            t = t_m if t_m > 0.0 else 0.0  # max(0.0, t_m)
        else:
            tr = kernel_terms(k, prof)
            terms.append(tr)
            if k.kind == "host":  # host work alone: no GPU time, no launch
                continue
            t = tr[1] if tr[1] > tr[0] else tr[0]  # max(t_c, t_m)
        burst += (t + (launch if launch > t else gap)) * k.count
    return terms, burst


def regime_speeds(prof: Profile, weight: float) -> dict[str, float]:
    """regime_speed of each rate class at sustained weight `weight`: one step's factors, computed once."""
    return {cls: regime_speed(prof, weight, cls) for cls in ("matmul", "attention", "memory")}


def timed(kern: Kernel, prof: Profile, sustained: float = 0.0, terms: tuple | None = None,
          speeds: dict[str, float] | None = None) -> tuple:
    """One launch at the step's regime: (compute s, memory s, launch s, seconds, bound, rate, note).
    sustained: the sustained-load weight of the step it runs in (sustained_weight; 0: burst rates);
    terms: its kernel_terms, and speeds: regime_speeds(prof, sustained), where the caller has them."""
    if kern.kind == "host":  # host work alone (an optimizer call's Python): no GPU time, no launch
        return 0.0, 0.0, 0.0, 0.0, "host", 0.0, ""
    t_c, t_m, cls, rate, note = terms or kernel_terms(kern, prof)
    if sustained:
        speeds = speeds or regime_speeds(prof, sustained)
        speed = speeds[cls]
        t_c, rate = t_c / speed, rate * speed
        t_m /= speeds["memory"]
    launch = prof.launch_s
    bound = "compute" if t_c >= t_m else "memory"
    if launch > max(t_c, t_m):
        bound = "launch"
    else:  # a kernel of real size waits for the one before to drain: the calibrated gap, where measured
        launch = launch_term(prof)
    return t_c, t_m, launch, max(t_c, t_m) + launch, bound, rate, note


def time_kernel(kern: Kernel, prof: Profile, sustained: float = 0.0, terms: tuple | None = None) -> dict:
    """One kernel (per launch and x count): its compute and memory terms, the bound, the time (timed's
    figures as a row). sustained, terms: as timed."""
    if not isinstance(prof, Profile):
        prof = from_dict(prof)
    return row(kern, timed(kern, prof, sustained, terms))


def row(kern: Kernel, t: tuple) -> dict:
    """A kernel's row from its timed() figures: every Kernel field, and the times x count."""
    t_c, t_m, launch, per, bound, rate, note = t
    n = kern.count
    return dict(kern._asdict(), shape=list(kern.shape), fused=list(kern.fused), compute_s=t_c * n, memory_s=t_m * n,
                launch_s=launch * n, time_s=per * n, per_launch_s=per, bound=bound, rate_flops=rate, note=note)
