"""Step time from first principles: every kernel a training step launches, timed on a roofline.

Pure Python over the config (no torch, no model). estimate_time(cfg, run, variant, gpu) lists, per
component and phase, the kernels the variant's code launches (read off anatomy/baseline and
anatomy/efficient, and Liger's fused linear CE for the efficient loss), each with its FLOPs and its
minimal HBM bytes, and predicts each one as

    t = max(FLOPs / rate, bytes / bandwidth) + launch        bound = whichever term is larger
    (launch: the profile's per-kernel cost on a full queue for a launch-bound kernel, and the
    calibrated gap between dependent kernels of real size for the others, where measured)

  matmul   rate = the profile's asymptotic GEMM rate x matmul_efficiency(m, n, k) (gpus.py:
           tile and wave quantization over the SMs, split-K for skinny weight gradients),
           x the measured slowdown of a bf16 GEMM with a dimension (the vocab) that is not a
           multiple of 8 elements (gpus.alignment_factor; 1 for a datasheet profile)
  sdpa     rate = the profile's measured rate for that backend and head dim, scaled by the
           wave quantization of (batch x heads x 128-row query blocks) against the measured shape
  memory   elementwise and fused kernels: FLOPs ignored (≤ ~10 per element, far under the ridge);
           our fused ops, the mixed-dtype residual add and Liger's CE kernel at the fraction of
           the copy bandwidth calibrate measured them reach at their width and row count
           (fused_efficiency; 1 without a calibration)

Assumptions (each is a source of error, listed in docs/timing.md):
  1. Kernels run back to back: the step's GPU time is their sum (no overlap between kernels).
  2. Memory-bound kernels move exactly their minimal bytes at the copy bandwidth: no L2 reuse,
     no re-reads inside a kernel (softmax rows, Liger's CE reading each logit twice is counted).
  3. Compute and memory overlap perfectly inside a kernel (the max, not the sum).
  4. The host issues work asynchronously: each kernel starts when the GPU is free and the host has
     issued it (pipeline.py), so the GPU idles where the host falls behind, after each host sync
     (Liger's .item() before the loss, torch.equal in its backward) above all. The host figure is
     per eager op, or per custom-op call, from the profile, times the variant's host_scale
     (measured in-step cost over the per-op figures, from a tiny calibrated step); Liger's call is
     measured as the model makes it, per call and per chunk of its loop, and is not scaled.
  5. The optimizer is its own phase, after backward (bench/step.py times forward + backward only).
"""
from __future__ import annotations

import math
from dataclasses import asdict
from types import SimpleNamespace

from anatomy.calculator import estimate, gpus, pipeline, sdpa_schedule
from anatomy.calculator.fused import dw_sum_bytes, fused_bytes, fused_launches, liger_ce_width
from anatomy.calculator.launches import (SDPA_BACKENDS, VARIANTS, Kernel, baseline_kernels,  # noqa: F401
                                         efficient_kernels, kernels, liger_chunk_rows, optimizer_kernels, param_sizes,
                                         standalone_kernels)
from anatomy.config import ConfigError, ModelConfig, Run

PHASES = ("forward", "backward", "optimizer")
CUSTOM_FALLBACK_OPS = 3  # a custom-op call with no measured host cost: as 3 eager ops (dispatch + autograd + launch)
IN_SITU = ("liger_ce",)  # host figures calibrate measures as the model makes the call (no host_scale)


# ---- the roofline ------------------------------------------------------------------------------
def _sdpa_rate(prof: dict, backend: str, head_dim: int, phase: str, seq: int | None = None) -> tuple[float, str]:
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
        f, fb = (_log_interp([(math.log(int(s_)), v[k]) for s_, v in by_seq.items()], math.log(seq))
                 for k in ("fwd", "fwd_bwd"))
    note = f"{backend} hd{key}" + ("" if key == str(head_dim) else f" (nearest measured to hd{head_dim})")
    if phase == "forward":
        return f, note
    return 2.5 / (3.5 / fb - 1 / f), note  # backward = the fwd+bwd time minus the forward time


def _launch_term(prof: dict) -> float:
    """The launch term of a kernel of real size: it waits for the one before to drain (the calibrated
    gap, where measured, else the queued launch cost)."""
    return max(prof["launch_s"], prof.get("kernel_gap_s", 0.0))


def time_kernel(kern: Kernel, prof: dict) -> dict:
    """One kernel (per launch and x count): its compute and memory terms, the bound, the time."""
    t_c, rate, note = 0.0, 0.0, ""
    if kern.kind == "matmul":
        b, m, n, k = kern.shape
        rate = prof["matmul_flops"][kern.dtype] * gpus.matmul_efficiency(m, n, k, prof["sms"], prof["matmul_k_half"], b)
        mis = (prof.get("matmul_misaligned_accumulate") or {}).get(str(gpus.alignment_class(m))) if kern.accumulate else None
        if kern.dtype in ("bfloat16", "float16"):
            rate *= mis if mis is not None else gpus.alignment_factor(prof, m, n, k)
        if kern.accumulate:
            rate *= prof.get("matmul_fp32_accumulate", 1.0)
    elif kern.kind == "sdpa":
        B, nh, S, hd = kern.shape
        sched, note = sdpa_schedule.lookup(prof, kern.backend, hd)
        if sched:  # the kernel's whole duration, from its CTAs' makespan (sdpa_schedule); its launch is in it
            t_sched = sdpa_schedule.kernel_s(sched[kern.phase], B, nh, S, prof["sms"], kern.phase)
            rate = kern.flops / max(t_sched - _launch_term(prof), 1e-9)
        else:
            rate, note = _sdpa_rate(prof, kern.backend, hd, kern.phase, S)
            rate *= gpus.attention_wave_efficiency(B, nh, S, prof["sms"]) if prof["attention"] else 1.0
    if rate:
        t_c = kern.flops / rate
    eff = fused_efficiency(prof, *kern.fused) if kern.fused else 1.0
    if kern.accumulate:  # its epilogue streams the fp32 accumulator below copy bandwidth (measured.accumulate_bandwidth)
        eff = prof.get("matmul_accumulate_bw", 1.0)
    t_m = kern.bytes / (prof["hbm_Bps"] * eff)
    launch = prof["launch_s"]
    bound = "compute" if t_c >= t_m else "memory"
    if launch > max(t_c, t_m):
        bound = "launch"
    else:  # a kernel of real size waits for the one before to drain: the calibrated gap, where measured
        launch = _launch_term(prof)
    per = max(t_c, t_m) + launch
    return dict(asdict(kern), shape=list(kern.shape), compute_s=t_c * kern.count, memory_s=t_m * kern.count,
                launch_s=launch * kern.count, time_s=per * kern.count, per_launch_s=per, bound=bound,
                rate_flops=rate, note=note)


def fused_efficiency(prof: dict, op: str, width: int, rows: int | None = None) -> float:
    """The fraction of the copy bandwidth an op reaches at this row width and row count, from the
    profile's calibrated timings (calibrate_kernels.measure_fused: GPU time per call at several widths,
    16,384 rows, and 65,536 for the narrow ones) over the op's minimal bytes (fused.fused_bytes):
    piecewise linear in log(width) at each measured row count, then in log(rows) between them; flat
    beyond the measured range. 1.0 (the copy roofline) without such rows.

    Liger's CE kernel is read in lanes, not vocab: its time follows liger_ce_width (the lanes of its
    passes, masked past V), and a vocab that is not a multiple of 16 loses Triton's aligned loads (its
    stride specialisation; 1.2-1.4x slower per lane on the H200, session8b-d), so it is interpolated
    over the calibrated vocabs of its own alignment, in log(lanes), as an efficiency per lane."""
    cal = [r for r in prof.get("fused_rows") or () if r["op"] == op and r.get("queued", True)]
    x, per_lane = (lambda w: w), (lambda w: 1.0)
    if op == "liger_ce":
        cal = [r for r in cal if (r["width"] % 16 == 0) == (width % 16 == 0)] or cal
        x, per_lane = liger_ce_width, (lambda w: liger_ce_width(w) / w)
    by_rows: dict[int, list] = {}
    for r in cal:
        nbytes = sum(fused_bytes(op, r["width"], r["tokens"]))
        if op == "rms_norm.backward":  # the op is two kernels: the row pass and the dw partial sum
            nbytes += sum(dw_sum_bytes(r["width"], r["tokens"]))
        busy = r["ms"] * 1e-3 - fused_launches(op, r["width"], r["tokens"]) * prof["launch_s"]
        if op == "embedding.backward":  # its (V, W) fp32 zero fill is the model's own kernel, at the copy rate
            busy -= r["vocab"] * r["width"] * 4 / prof["hbm_Bps"] + prof["launch_s"]
        if busy > 0:
            by_rows.setdefault(r["tokens"], []).append((math.log(x(r["width"])),
                                                        nbytes / prof["hbm_Bps"] / busy * per_lane(r["width"])))
    if not by_rows:
        return 1.0
    at = [(math.log(t), _log_interp(pts, math.log(x(width)))) for t, pts in by_rows.items()]
    return (_log_interp(at, math.log(rows)) if rows else max(at)[1]) / per_lane(width)


def _log_interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (x, y) points (x a log), flat beyond the first and last."""
    pts = sorted(pts)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, e0), (x1, e1) in zip(pts, pts[1:]):
        if x <= x1:
            return e0 + (e1 - e0) * (x - x0) / (x1 - x0) if x1 > x0 else e1
    return pts[-1][1]


def host_seconds(kern: Kernel, prof: dict) -> float:
    """The host's time to issue this entry's launches: eager ops at host_op_s each, custom calls at the
    profile's measured figure (or host_ops, else CUSTOM_FALLBACK_OPS, eager ops where it has none)."""
    if kern.host is None:
        return 0.0
    calls = kern.count if kern.calls is None else kern.calls
    if kern.host == "op":
        return calls * prof["host_op_s"]
    op, phase = kern.host.split(".")
    t = prof["host_custom_s"].get(op, {}).get(phase)
    return calls * (t if t is not None else (kern.host_ops or CUSTOM_FALLBACK_OPS) * prof["host_op_s"])


def in_situ(kern: Kernel, prof: dict) -> bool:
    """Whether the profile measured this entry's host cost as the model incurs it (Liger's fused linear
    CE, called through anatomy.efficient.loss under autocast): host_scale does not apply to it."""
    if not kern.host or "." not in kern.host:
        return False
    op, phase = kern.host.split(".")
    return op in IN_SITU and prof["host_custom_s"].get(op, {}).get(phase) is not None


def host_scale(prof: dict, variant: str, sdpa_backend: str | None = None) -> float:
    """How much more the host spends per op inside a training step than the per-op figures say.

    The per-op figures (host_op_s, host_custom_s) leave out what an op costs inside a model: module
    calls, autocast, autograd nodes with saved tensors, views, the engine's per-backward setup.
    `anatomy calibrate` times a tiny step of each variant, so small that the host bounds it
    (profile["host_step"]); the scale is its measured forward + backward time over this model's
    host figure for the same step, less on both sides what was measured in place (in_situ: Liger's
    call), and multiplies the host cost of every other forward and backward op of that variant (1.0
    without such a step). One factor, not one per phase (session5c: 4.0x forward, 1.9x backward,
    and worse predictions than one 2.8x)."""
    hs = prof.get("host_step") or {}
    rec = hs.get(variant)
    if not rec:
        return 1.0
    cfg, run = ModelConfig(**hs["cfg"]), Run(hs["batch"], hs["seq"], hs.get("dtype", "amp"))
    ks = kernels(cfg, run, variant, sdpa_backend, None)
    fixed = sum(host_seconds(k, prof) for k in ks if in_situ(k, prof))
    modelled = sum(host_seconds(k, prof) for k in ks) - fixed
    measured = rec["forward_backward_ms"] * 1e-3 - fixed
    return measured / modelled if measured > 0 and modelled > 0 else 1.0


def predict(ks: list[Kernel], prof: dict, scale: float = 1.0, layers: int = 1) -> tuple[list[dict], list[dict], dict]:
    """Rows (one per kernel entry, in phase order), host-sync segments of one step on an idle GPU, and
    the step run back to back (pipeline.steady: a training loop's steps). A segment runs from one
    host sync to the next (the optimizer is always its own); its time comes from the host/GPU
    pipeline (pipeline.simulate: each kernel starts when the GPU is free and the host has issued it,
    the kernels of the layers interleaved layer by layer). scale multiplies the host cost of forward
    and backward ops (host_scale)."""
    order = sorted(range(len(ks)), key=lambda i: (PHASES.index(ks[i].phase), ks[i].order))  # stable
    rows, entries = [], []
    for k in (ks[i] for i in order):
        row = time_kernel(k, prof)
        row["host_s"] = host_seconds(k, prof) * (scale if k.phase != "optimizer" and not in_situ(k, prof) else 1.0)
        rows.append(row)
        entries.append(SimpleNamespace(kernel=k, gpu_s=row["per_launch_s"], host_s=row["host_s"] / k.count))
    return rows, pipeline.simulate(entries, layers), pipeline.steady(entries, layers)


def estimate_time(cfg: ModelConfig, run: Run, variant: str = "efficient", gpu: str | dict = "h200-measured",
                  sdpa_backend: str | None = None, optimizer: str | None = "ademamix",
                  with_kernels: bool = True) -> dict:
    """Predicted time of one training step, per kernel, component and phase, with MFU.

    gpu: a profile name (gpus.names(), case-insensitive), a profile .json path, or a profile dict.
    forward_backward_s is what bench/step.py measures (max of GPU and host time per host-sync
    segment); step_s adds the optimizer. Per component and phase the figures are GPU time."""
    prof = gpus.get(gpu)
    scale = host_scale(prof, variant, sdpa_backend)
    rows, segs, steady = predict(kernels(cfg, run, variant, sdpa_backend, optimizer), prof, scale, cfg.layers)
    comps: dict[str, dict] = {}
    phases = {ph: dict(gpu_s=0.0, host_s=0.0, kernels=0) for ph in PHASES}
    for row in rows:
        c = comps.setdefault(row["component"], dict({f"{ph}_s": 0.0 for ph in PHASES}, kernels=0,
                                                    bound_s=dict(compute=0.0, memory=0.0, launch=0.0)))
        c[f"{row['phase']}_s"] += row["time_s"]
        c["kernels"] += row["count"]
        c["bound_s"][row["bound"]] += row["time_s"]
        ph = phases[row["phase"]]
        ph["gpu_s"] += row["time_s"]
        ph["host_s"] += row["host_s"]
        ph["kernels"] += row["count"]
    for c in comps.values():
        c["total_s"] = sum(c[f"{ph}_s"] for ph in PHASES)
    fb = sum(sg["time_s"] for sg in segs if sg["phase"] != "optimizer")
    opt = sum(sg["time_s"] for sg in segs if sg["phase"] == "optimizer")
    fl = estimate(cfg, run, variant, "cuda").to_dict()["flops"]
    model, counter = (fl[k]["forward"] + fl[k]["backward"] for k in ("model", "counter"))
    peak = prof["mfu_peak_flops"]
    out = dict(
        gpu=prof["name"], profile_kind=prof["kind"], variant=variant, config=cfg.to_dict(),
        run=run.to_dict(), optimizer=optimizer,
        sdpa_backend=(sdpa_backend or "cudnn") if variant == "efficient" else "math (explicit QKᵀ, softmax, PV)",
        host_scale=scale, forward_backward_s=fb, optimizer_s=opt, step_s=fb + opt, steady=steady,
        host_bound=any(s["bound"] == "host" for s in segs if s["phase"] != "optimizer"), gpu_s=sum(p["gpu_s"] for p in phases.values()),
        tokens_per_s=run.tokens / fb, phases=phases, segments=segs, components=comps,
        mfu=dict(model=model / fb / peak, counter=counter / fb / peak, peak_flops=peak,
                 peak_source=prof["sources"].get("mfu_peak_flops", prof["sources"]["peak_flops"]),
                 flops=dict(model=model, counter=counter), over="forward + backward time (as bench/step.py)"),
        sources=prof["sources"])
    if with_kernels:
        out["kernels"] = rows
    return out


def breakdown_table(res: dict) -> str:
    """Per component: GPU ms by phase, launches, and the share of its time each bound holds."""
    lines = ["| component | forward ms | backward ms | optimizer ms | kernels | compute / memory / launch |",
             "|---|---:|---:|---:|---:|---|"]
    for name, c in res["components"].items():
        share = " / ".join(f"{c['bound_s'][b] / c['total_s']:.0%}" for b in ("compute", "memory", "launch"))
        lines.append(f"| {name} | {c['forward_s'] * 1e3:.2f} | {c['backward_s'] * 1e3:.2f} | "
                     f"{c['optimizer_s'] * 1e3:.2f} | {c['kernels']} | {share} |")
    segs = ", ".join(f"{s['starts_at']}: GPU {s['gpu_s'] * 1e3:.1f} / host {s['host_s'] * 1e3:.1f} ms"
                     for s in res["segments"])
    return "\n".join(lines) + (f"\n\nHost-sync segments: {segs}. Forward + backward "
                               f"{res['forward_backward_s'] * 1e3:.1f} ms, MFU {res['mfu']['model']:.1%} (model FLOPs) / {res['mfu']['counter']:.1%} (counter), "
                               f"against {res['mfu']['peak_flops'] / 1e12:.0f} TFLOP/s.")
