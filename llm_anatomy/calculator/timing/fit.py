"""Measured profiles: what `anatomy calibrate` wrote, fitted into the fields of a Profile (profile.py).

Pure Python: no torch. from_measured fits the GEMM rate and k_half to the measured grid (fit_matmul),
the misaligned-vocab and fp32-accumulate factors of the LM head's GEMMs, the attention rates per backend
and head dim, and the SDPA kernel's CTA schedule; it keeps the fused ops' rows and the host figures, each
with its source. profile.load calls it once per profile file.
"""
from __future__ import annotations

import math
import statistics
from functools import lru_cache

import llm_anatomy.calculator.timing.sdpa_schedule as sdpa_schedule
from llm_anatomy.calculator.timing.profile import SUSTAINED_RATES, Profile, datasheet
from llm_anatomy.calculator.timing.roofline import (alignment_class, attention_wave_efficiency, causal_attention_flops,
                                                    masked_attention_flops, matmul_efficiency)
from llm_anatomy.config import ConfigError


# which GEMM dimension is the vocab in each head GEMM calibrate times (llm_anatomy/measure/calibrate.py)
VOCAB_OP_DIM = {"forward": "n", "grad_input": "k", "grad_weight": "m"}


def misaligned_factors(rows: list[dict]) -> dict:
    """{alignment class: {GEMM dim: rate ratio}} from calibrate's head GEMMs: the rate at a misaligned
    vocab over the rate at the aligned one, same op and shape (geometric mean over the shapes)."""
    aligned = {(r["op"], r["rows"], r["hidden"]): r["tflops"] for r in rows if alignment_class(r["vocab"]) is None}
    ratios: dict = {}
    for r in rows:
        if r["op"] not in VOCAB_OP_DIM:
            continue
        a, ref = alignment_class(r["vocab"]), aligned.get((r["op"], r["rows"], r["hidden"]))
        if a is not None and ref:
            ratios.setdefault(str(a), {}).setdefault(VOCAB_OP_DIM[r["op"]], []).append(math.log(r["tflops"] / ref))
    return {a: {d: math.exp(sum(v) / len(v)) for d, v in dims.items()} for a, dims in ratios.items()}


def accumulate_factor(rows: list[dict]) -> float | None:
    """Liger's grad_weight under amp (addmm into fp32, out_dtype=fp32) over the bf16-out grad_weight of
    the same shape, at the aligned vocab: the geometric mean over calibrate's head shapes."""
    rate = {(r["op"], r["rows"], r["hidden"]): r["tflops"] for r in rows if alignment_class(r["vocab"]) is None}
    logs = [math.log(v / rate[("grad_weight", T, H)]) for (op, T, H), v in rate.items()
            if op == "grad_weight_acc" and ("grad_weight", T, H) in rate]
    return math.exp(sum(logs) / len(logs)) if logs else None


ACC_MAX_K = 512  # a chunk this short leaves the accumulate GEMM epilogue-bound (calibrate.ACC_CHUNKS)


def accumulate_bandwidth(rows: list[dict], hbm_Bps: float) -> float | None:
    """The fraction of the copy bandwidth an fp32-accumulating grad_weight GEMM's bytes move at (read
    and write of the (V, H) fp32 accumulator, plus both bf16 operands), at the aligned vocab: the
    highest over calibrate's rows, i.e. its few-row chunks (calibrate.ACC_CHUNKS), whose K is so short
    that the epilogue is nearly the whole kernel. Compute-bound rows give lower fractions and never
    the max; a profile without rows of K <= ACC_MAX_K gets None: no such term."""
    fr = [(2 * r["vocab"] * r["hidden"] * 4 + 2 * r["rows"] * (r["vocab"] + r["hidden"])) / hbm_Bps / (r["ms"] * 1e-3)
          for r in rows if r["op"] == "grad_weight_acc" and alignment_class(r["vocab"]) is None and r.get("ms")
          and r["rows"] <= ACC_MAX_K]
    return min(1.0, max(fr)) if fr else None


def misaligned_accumulate(rows: list[dict], sms: int) -> dict:
    """{alignment class: {rate_flops, k_half}} of Liger's fp32-accumulating grad_weight at a misaligned
    vocab: cuBLAS runs it on a fallback kernel with a main loop of its own (its rate climbs with the
    chunk's K from ~150 TFLOP/s at K 512 to ~280 at 16,384 on the H200, class 4), so each class gets
    its own rate and k_half, fitted as fit_matmul fits the aligned GEMMs to calibrate's rows of that
    class (K from ACC_MISALIGNED's chunk to VOCAB_SHAPES' full steps), each row weighing the same."""
    out: dict = {}
    for r in rows:
        a = alignment_class(r["vocab"])
        if r["op"] == "grad_weight_acc" and a is not None:
            out.setdefault(str(a), []).append(dict(m=r["vocab"], n=r["hidden"], k=r["rows"], tflops=r["tflops"]))
    return {a: dict(zip(("rate_flops", "k_half"), fit_matmul(pts, sms, by_flops=False))) for a, pts in out.items()}


# ---- measured profiles ---------------------------------------------------------------------------
def fit_matmul(points: list[dict], sms: int, by_flops: bool = True) -> tuple[float, float]:
    """(asymptotic rate FLOP/s, k_half) fitted to measured GEMM points {m, n, k, tflops}.

    For each k_half on a grid, the rate is the weighted geometric mean of measured / efficiency, and
    k_half is the grid value with the least weighted squared log error. Each point weighs its FLOPs:
    a step's time is spent in its large GEMMs, and the microsecond-scale shapes are the noisiest to
    time (by_flops=False: each point weighs the same). One point fixes the rate only (k_half = 0)."""
    w = [2 * p["m"] * p["n"] * p["k"] * p.get("batch", 1) if by_flops else 1 for p in points]

    def rate_and_err(kh):
        logs = [math.log(p["tflops"] * 1e12 / matmul_efficiency(p["m"], p["n"], p["k"], sms, kh, p.get("batch", 1)))
                for p in points]
        mu = sum(wi * x for wi, x in zip(w, logs)) / sum(w)
        return math.exp(mu), sum(wi * (x - mu) ** 2 for wi, x in zip(w, logs)) / sum(w)

    if not points:
        raise ConfigError("no matmul measurements to fit")
    if len({p["k"] for p in points}) < 2:
        return rate_and_err(0.0)[0], 0.0
    best = min((rate_and_err(kh)[1], kh) for kh in range(0, 1025, 8))
    return rate_and_err(best[1])[0], float(best[1])


def grouped_rows(rows: list[int]) -> int:
    """The rows a grouped GEMM computes: each expert's rounded up to the kernel's tile height (kernels_moe.py)."""
    from llm_anatomy.calculator.timing.kernels_moe import GROUPED_TILE_M

    return sum(-(-r // GROUPED_TILE_M) * GROUPED_TILE_M for r in rows)


def grouped_efficiency(points: list[dict], rate: float, k_half: float, sms: int) -> dict:
    """{role: median over the queued rows of (the dense model's time for the role's GEMMs, as kernels_moe prices
    them) / measured time}: the grouped kernel's fraction of the dense rate. forward: (N', n, k) over the
    tile-rounded rows; backward: d(x) (N', k, n) and d(W), each expert's (n, k, n_e) (a batch per row count)."""
    out: dict[str, list[float]] = {}
    for p in points:
        if not p.get("queued", True):
            continue
        N, n, k = grouped_rows(p["rows"]), p["n"], p["k"]
        gemms = [(N, n, k, 1)] if p["role"] == "forward" else [(N, k, n, 1)] + [
            (n, k, r, p["rows"].count(r)) for r in sorted(set(p["rows"])) if r]
        dense_s = sum(2 * a * b * c * e / (rate * matmul_efficiency(a, b, c, sms, k_half, e)) for a, b, c, e in gemms)
        out.setdefault(p["role"], []).append(dense_s / (p["ms"] * 1e-3))
    return {role: statistics.median(v) for role, v in out.items()}


def from_measured(data: dict) -> Profile:
    """A measured profile: its base datasheet profile, with every measured figure replacing the
    datasheet one (and its source saying so). Figures the file does not measure stay datasheet
    figures or assumptions, and their sources say that too."""
    base = datasheet(data.get("base", "h200-sxm")).to_dict()
    m, prov = data["measurements"], data.get("provenance", {})
    where = f"measured ({prov.get('date', 'undated')}, {prov.get('gpu', '?')}, torch {prov.get('torch', '?')})"
    p = dict(base, name=data.get("name", base["name"] + "-measured"), kind="measured",
             display=f"{base['display']} (measured)", provenance=prov, sources=dict(base["sources"]))
    sms = p["sms"]
    if m.get("matmul_bf16"):
        # A step's GEMMs follow the kernel that wrote their operand (calibrate_kernels.py): the rate and
        # k_half come from the in-step timings when the profile has them, from the loop otherwise; the
        # loop's fit is kept beside it, and the MFU ceiling stays the loop's best (ANCHORS' convention).
        in_step = [x for x in m.get("matmul_bf16_in_step") or () if x.get("queued", True)]
        grid = in_step or m["matmul_bf16"]
        if in_step:
            p["matmul_loop_fit"] = dict(zip(("rate_flops", "k_half"), fit_matmul(m["matmul_bf16"], sms)))
        rate, kh = fit_matmul(grid, sms)
        p["matmul_flops"] = dict(p["matmul_flops"], bfloat16=rate)
        p["matmul_k_half"] = kh
        p["matmul_fit"] = tuple(dict(m=x["m"], n=x["n"], k=x["k"], measured_tflops=x["tflops"], model_tflops=rate / 1e12 *
                                matmul_efficiency(x["m"], x["n"], x["k"], sms, kh, x.get("batch", 1)))
                           for x in grid)
        best = max(x["tflops"] for x in m["matmul_bf16"]) * 1e12
        p["mfu_peak_flops"] = best
        shapes = ", ".join(f"{x['m']}x{x['n']}x{x['k']}: {x['tflops']:g}" for x in grid[:4])
        how = "in step (after a producer kernel)" if in_step else "in a loop"
        p["sources"].update(matmul_flops=f"{where}: bf16 GEMM TFLOP/s {how} {shapes}"
                                         + (" ..." if len(grid) > 4 else ""),
                            matmul_k_half=f"fitted to {len(grid)} measured GEMM shape(s), {how}",
                            mfu_peak_flops=f"{where}: the best measured bf16 GEMM (MFU against a measured ceiling)")
    if m.get("grouped_mm"):
        rate, kh = p["matmul_flops"]["bfloat16"], p.get("matmul_k_half", 0.0)
        p["grouped_mm"] = grouped_efficiency(m["grouped_mm"], rate, kh, sms)
        p["sources"]["grouped_mm"] = (f"{where}: torch._grouped_mm at {len(m['grouped_mm'])} expert shapes of real "
                                      "MoE families over the dense GEMM model's time for the same rows")
    if m.get("matmul_vocab"):
        p["matmul_misaligned"] = misaligned_factors(m["matmul_vocab"])
        acc = accumulate_factor(m["matmul_vocab"])
        if acc is not None:
            p["matmul_fp32_accumulate"] = acc
            p["sources"]["matmul_fp32_accumulate"] = f"{where}: addmm(out_dtype=fp32) over bf16-out, head shapes"
        mis = misaligned_accumulate(m["matmul_vocab"], sms)
        if mis:
            p["matmul_misaligned_accumulate"] = mis
            p["sources"]["matmul_misaligned_accumulate"] = (f"{where}: addmm(out_dtype=fp32) at vocab 32001/32002/"
                                                            "32004, rate and k_half per class over K 512-16384")
        bw = accumulate_bandwidth(m["matmul_vocab"], m["copy_tbps"] * 1e12) if m.get("copy_tbps") else None
        if bw is not None:
            p["matmul_accumulate_bw"] = bw
            p["sources"]["matmul_accumulate_bw"] = (f"{where}: addmm(out_dtype=fp32) into a (V, H) fp32 accumulator, "
                                                    "bytes over time at its few-row chunks, over the copy bandwidth")
        p["sources"]["matmul_misaligned"] = (f"{where}: the LM head's GEMMs at vocab 32001/32002/32004 against 32000 "
                                             f"({len(m['matmul_vocab'])} GEMMs)")
    if m.get("fused"):
        p["fused_rows"] = tuple(m["fused"])
        p["sources"]["fused_rows"] = (f"{where}: GPU time per call of our fused ops, the mixed-dtype residual add and "
                                      f"Liger's CE kernel ({len(m['fused'])} rows)")
    if m.get("copy_tbps"):
        p["hbm_Bps"] = m["copy_tbps"] * 1e12
        p["sources"]["hbm_Bps"] = f"{where}: device-to-device copy, bytes read + written"
    if m.get("upcast_tbps") and m.get("copy_tbps"):
        p["upcast_bw"] = m["upcast_tbps"] / m["copy_tbps"]
        p["sources"]["upcast_bw"] = f"{where}: a bf16 -> fp32 cast's bytes read + written over the copy's rate"
    if m.get("launch_us"):
        p["launch_s"] = m["launch_us"] * 1e-6
        p["sources"]["launch_s"] = f"{where}: tiny kernels on a full eager queue"
    if m.get("kernel_gap"):
        p["kernel_gap_s"] = m["kernel_gap"]["gap_us"] * 1e-6
        p["sources"]["kernel_gap_s"] = f"{where}: median idle time between dependent GEMM/copy kernels (profiled chain)"
    if m.get("host_op_us"):
        p["host_op_s"] = m["host_op_us"] * 1e-6
        p["sources"]["host_op_s"] = f"{where}: CPU time per eager op under autograd"
    if m.get("host_step"):
        p["host_step"] = m["host_step"]
        p["sources"]["host_step"] = f"{where}: a tiny training step of each variant, host-bound (timing.host_scale)"
    if m.get("host_custom_us"):
        p["host_custom_s"] = {k: {ph: us * 1e-6 for ph, us in v.items() if isinstance(us, (int, float))}
                              for k, v in m["host_custom_us"].items() if isinstance(v, dict)}
        p["sources"]["host_custom_s"] = m["host_custom_us"].get("source", where)
    for impl, rec in (m.get("optimizer_host") or {}).items():
        f = optimizer_host_fit(rec["rows"])
        if f["tensor_s"] > 0:  # a slope <= 0 says the host's time did not follow the list: today's model stays
            p["optimizer_host"] = dict(p["optimizer_host"], **{impl: f})
            p["sources"]["optimizer_host"] = (
                f"{where}: the host time the {impl} step exposes at "
                f"{', '.join(str(r['tensors']) for r in rec['rows'])} tensors of {rec['rows'][0].get('numel', 1):,} "
                f"element(s), fitted as {f['call_s'] * 1e6:.1f} us + {f['tensor_s'] * 1e6:.2f} us per tensor "
                f"(worst row {f['max_error']:.0%})")
    if m.get("sustained"):
        p.update(sustained_fields(m["sustained"], where))
        p["sources"].update(sustained_ratio=f"{where}: the same GEMM, SDPA and copy in a burst and after a "
                                            f"{m['sustained']['warmup_s']:g} s warm-up of large GEMMs (rate ratios)",
                            sustained_tau_s=f"{where}: the GEMM rate's fall during the warm-up (fit.fit_tau)",
                            clocks=f"{where}: SM clock and board power read during each regime (NVML)")
    if m.get("attention"):
        p["attention"] = attention_table(m["attention"], sms)
        p["sources"]["attention"] = f"{where}: causal SDPA per backend, " + "; ".join(
            f"{a['backend']} hd{a['hd']} fwd {a['fwd_ms']} ms, fwd+bwd {a['fwd_bwd_ms']} ms" for a in m["attention"])
    if m.get("attention_masked"):
        p["attention_masked"] = masked_table(m["attention_masked"], sms)
        p["sources"]["attention_masked"] = f"{where}: cuDNN SDPA under an additive mask, " + "; ".join(
            f"hd{a['hd']}+{a['pad']} S{a['S']} fwd {a['fwd_ms']} ms, fwd+bwd {a['fwd_bwd_ms']} ms"
            for a in m["attention_masked"])
    if m.get("attention_kernels"):
        p["sdpa_schedule"] = schedule_table(m["attention_kernels"], sms)
        p["sources"]["sdpa_schedule"] = (f"{where}: the main SDPA kernel's duration (profiler) at "
                                         f"{len(m['attention_kernels'])} grids from under one wave to many, "
                                         "fitted per backend, head dim and phase (sdpa_schedule.fit)")
    return Profile(**p)


def attention_table(rows: list[dict], sms: int) -> dict:
    """{backend: {head_dim: {fwd, fwd_bwd}}}: FLOP/s at a full wave, causal convention (fwd+bwd counts
    3.5x the forward, as ANCHORS.md does), from measured {backend, B, heads, S, hd, fwd_ms, fwd_bwd_ms}."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["S"]):
        f = causal_attention_flops(r["B"], r["heads"], r["S"], r["hd"])
        eff = attention_wave_efficiency(r["B"], r["heads"], r["S"], sms)
        rates = dict(fwd=f / (r["fwd_ms"] * 1e-3) / eff, fwd_bwd=3.5 * f / (r["fwd_bwd_ms"] * 1e-3) / eff)
        e = out.setdefault(r["backend"], {}).setdefault(str(r["hd"]), {})
        e.update(rates)  # the longest sequence measured: a full wave's rate
        e.setdefault("seq", {})[str(r["S"])] = rates  # and every length, when calibrate measured several
    return out


def masked_table(rows: list[dict], sms: int) -> dict:
    """{called head dim: {fwd, fwd_bwd, seq: {S: {fwd, fwd_bwd}}}}: FLOP/s at a full wave of the masked SDPA, in
    the FLOPs FlopCounterMode counts for the call (masked_attention_flops; fwd+bwd 3.5x the forward), from
    calibrate's {B, heads, S, keys, hd, pad, fwd_ms, fwd_bwd_ms} rows; the longest S is the full-wave rate."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["S"]):
        f = masked_attention_flops(r["B"], r["heads"], r["S"], r["keys"], r["hd"] + r["pad"])
        eff = attention_wave_efficiency(r["B"], r["heads"], r["S"], sms)
        rates = dict(fwd=f / (r["fwd_ms"] * 1e-3) / eff, fwd_bwd=3.5 * f / (r["fwd_bwd_ms"] * 1e-3) / eff)
        e = out.setdefault(str(r["hd"] + r["pad"]), {})
        e.update(rates)
        e.setdefault("seq", {})[str(r["S"])] = rates
    return out


def schedule_table(rows: list[dict], sms: int) -> dict:
    """{backend: {head_dim: {"forward": {a, o, c}, "backward": {a, o, c}, "shapes": n, "max_error": e}}}
    from calibrate's {backend, B, heads, S, hd, fwd_kernel_ms, bwd_kernel_ms} rows (main kernel per call),
    for each backend and head dim timed at three or more grids."""
    out: dict = {}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["backend"], r["hd"]), []).append(r)
    for (backend, hd), rs in sorted(groups.items()):
        if len(rs) < 3:
            continue
        e = out.setdefault(backend, {}).setdefault(str(hd), dict(shapes=len(rs)))
        worst = 0.0
        for phase, key in (("forward", "fwd_kernel_ms"), ("backward", "bwd_kernel_ms")):
            pts = tuple((r["B"], r["heads"], r["S"], r[key] * 1e-3) for r in rs)
            e[phase] = _fit_schedule(pts, sms, phase)
            worst = max([worst, *(abs(x) for x in sdpa_schedule.errors(e[phase], list(pts), sms, phase))])
        e["max_error"] = worst
    return out


@lru_cache(maxsize=64)
def _fit_schedule(pts: tuple, sms: int, phase: str) -> dict:
    return sdpa_schedule.fit(list(pts), sms, phase)  # a profile is built on every load: fit once


def optimizer_host_fit(rows: list[dict]) -> dict:
    """{call_s, tensor_s, tensors, max_error}: the least-squares line host_s = call_s + tensor_s x tensors through
    calibrate's optimizer step times {tensors, us} (calibrate_host:measure_optimizer_host), the counts it was
    fitted at, and its worst relative error on them. Nothing is clamped: the caller keeps a slope > 0 only."""
    xs, ys = [r["tensors"] for r in rows], [r["us"] * 1e-6 for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return dict(call_s=a, tensor_s=b, tensors=sorted(set(xs)),
                max_error=max(abs(a + b * x - y) / y for x, y in zip(xs, ys)))


# ---- the sustained-load regime ------------------------------------------------------------------------
def fit_tau(trace: list[dict]) -> float:
    """Seconds: the time constant of the GEMM rate's fall from burst to sustained during the warm-up.

    trace: [{t_s, tflops}] of back-to-back GEMM chunks under continuous load. The settled rate is the
    median of the last quarter; the burst rate the best of the first three chunks; tau is the first time
    the excess over the settled rate falls to 1/e of its start (linear between chunks). A trace with no
    fall (under 1%) has no time constant to fit: its first chunk's time stands in (the term is then ~0)."""
    pts = sorted((r["t_s"], r["tflops"]) for r in trace)
    tail = sorted(v for _, v in pts[-max(1, len(pts) // 4):])
    settled = tail[len(tail) // 2]
    t0, burst = max(pts[:3], key=lambda p: p[1])
    if burst - settled <= 0.01 * burst:
        return max(pts[0][0], 1e-3)
    target = settled + (burst - settled) / math.e
    prev = (t0, burst)
    for t, v in pts:
        if t <= t0:
            continue
        if v <= target:
            (ta, va), (tb, vb) = prev, (t, v)
            tx = ta + (tb - ta) * (va - target) / (va - vb) if va > vb else tb
            return max(tx - t0, 1e-3)
        prev = (t, v)
    return max(pts[-1][0] - t0, 1e-3)  # still falling at the end: at least the warm-up's length


def sustained_fields(s: dict, where: str = "measured") -> dict:
    """Profile fields sustained_ratio, sustained_tau_s and clocks from calibrate's measurements.sustained."""
    b, st = s["burst"], s["sustained"]
    ratio = {cls: st[k] / b[k] for cls, k in SUSTAINED_RATES.items()}
    ck = dict(burst_MHz=b.get("clock_MHz"), sustained_MHz=st.get("clock_MHz"), burst_W=b.get("power_W"),
              sustained_W=st.get("power_W"))
    ck.update({k: v for k, v in (s.get("limits") or {}).items() if isinstance(v, (int, float))})
    return dict(sustained_ratio=ratio, sustained_tau_s=fit_tau(s["trace"]), clocks=ck)
