"""Step time from first principles: every kernel a training step launches, timed on a roofline, issued by
a host and run by a GPU as a pipeline. Pure Python over the config (no torch, no model).

estimate_time(cfg, run, variant, gpu) reads top to bottom:
  1. profile.get        the GPU's profile (profile.py: a dataclass; datasheet figures, or what
                        `anatomy calibrate` measured, fitted by fit.py)
  2. kernels.kernels    the kernels the variant's code launches, per component and phase, with their
                        FLOPs and minimal HBM bytes (kernels_baseline.py, kernels_efficient.py; counts per
                        step, so the list does not grow with the layers)
  3. host.host_scale    the host's in-step factor, from the profile's tiny host-bound step
     sustained          the step's sustained-load weight: its GPU time at burst rates against the
                        profile's clock time constant (roofline.sustained_weight); a long step runs
                        its compute at the power-limited clock (Profile.sustained_ratio)
  4. predict            each kernel on the roofline (roofline.time_kernel; calibrated ops through
                        registry.efficiency), its host cost (host.host_seconds), and the host/GPU pipeline
                        (pipeline.py: closed form over identical layers); the order, host figures and
                        pipeline blocks a model fixes are laid out once per model (layout.py)

Assumptions (docs/timing.md lists each with its error):
  1. Kernels on one stream run back to back: no overlap between kernels.
  2. A memory-bound kernel moves its minimal bytes at the copy bandwidth times its op's calibrated
     efficiency; no L2 reuse across kernels.
  3. Compute and memory overlap perfectly inside a kernel (the max, not the sum).
  4. The host issues work asynchronously: a kernel starts when the GPU is free and the host has issued it.
  5. The optimizer is its own phase, after backward (bench/step.py times forward + backward only).
"""
from __future__ import annotations

from llm_anatomy.calculator import Estimate, estimate
import llm_anatomy.calculator.timing.layout as layout
import llm_anatomy.calculator.timing.pipeline as pipeline
from llm_anatomy.calculator.moe import check_histogram
from llm_anatomy.calculator.timing.host import at_host_speed, host_scale, host_seconds, in_situ
from llm_anatomy.calculator.timing.kernels import (SDPA_BACKENDS, VARIANTS, kernels, optimizer_kernels,
                                               param_sizes, standalone_kernels)
from llm_anatomy.calculator.timing.kernels_baseline import baseline_kernels
from llm_anatomy.calculator.timing.kernels_efficient import efficient_kernels
from llm_anatomy.calculator.timing.ops import Kernel
from llm_anatomy.calculator.timing.lookup import get, names
from llm_anatomy.calculator.timing.profile import Profile, from_dict
from llm_anatomy.calculator.timing.registry import efficiency as fused_efficiency
from llm_anatomy.calculator.timing.roofline import row, step_terms, sustained_weight, time_kernel
from llm_anatomy.config import ModelConfig, Run

PHASES = ("forward", "backward", "optimizer")
__all__ = ["estimate_time", "breakdown_table", "predict", "get", "names", "Profile", "Kernel", "kernels",
           "baseline_kernels", "efficient_kernels", "optimizer_kernels", "standalone_kernels", "param_sizes",
           "time_kernel", "sustained_weight", "step_weight", "fused_efficiency", "host_seconds", "host_scale",
           "in_situ", "at_host_speed", "VARIANTS", "SDPA_BACKENDS", "PHASES"]


def step_weight(ks: list[Kernel], prof: Profile) -> tuple[float, float]:
    """(sustained weight, GPU seconds at burst rates) of a step of these kernels: the regime follows the
    length of the step's GPU work (roofline.sustained_weight), with no factor per shape."""
    _, burst = step_terms(ks, prof)
    return sustained_weight(burst, prof.sustained_tau_s) if prof.sustained_ratio else 0.0, burst


def predict(ks: list[Kernel], prof: Profile, scale: float = 1.0, layers: int = 1,
            clock: pipeline.Clock | None = None, sustained: float = 0.0,
            terms: list[tuple] | None = None) -> tuple[list[dict], list[dict], dict]:
    """Rows (one per kernel entry, in phase order), host-sync segments of one step on an idle GPU, and
    the step run back to back (pipeline.steady: a training loop's steps), for a kernel list as it is: the
    route estimate_time takes (layout.timed, pipeline.compose), from the list rather than from a config. A
    segment runs from one host sync to the next (the optimizer is always its own); its time comes from the
    host/GPU pipeline (pipeline.simulate: each kernel starts when the GPU is free and the host has issued it,
    the kernels of the layers interleaved layer by layer). scale multiplies the host cost of forward and
    backward ops (host_scale); sustained is the step's sustained-load weight (step_weight); terms are the
    kernels' roofline.kernel_terms, where the caller has them."""
    if not isinstance(prof, Profile):
        prof = from_dict(prof)
    terms = terms if terms is not None else step_terms(ks, prof)[0]
    lay = layout.build(ks, prof, scale)
    timed_ks, gpu_s, blocks, _, _ = layout.timed(ks, lay, prof, sustained, terms, layers)
    steps = pipeline.compose(blocks, lay.kernels, gpu_s)
    rows = [dict(row(k, t), host_s=host) for k, t, host in timed_ks]
    return rows, pipeline.simulate(None, layers, clock, steps), pipeline.steady(None, layers, steps)


def estimate_time(cfg: ModelConfig, run: Run, variant: str = "efficient", gpu: str | dict = "h200-measured",
                  sdpa_backend: str | None = None, optimizer: str | None = "adamw",
                  with_kernels: bool = True, est: Estimate | None = None, hist=None) -> dict:
    """Predicted time of one training step, per kernel, component and phase, with MFU.

    gpu: a profile name (profile.names(), case-insensitive), a profile .json path, or a Profile / dict.
    forward_backward_s is what bench/step.py measures (the host/GPU pipeline from one host sync to the
    next, on an idle GPU); steady is a training loop's back-to-back steps; step_s adds the optimizer.
    Per component and phase the figures are GPU time. cost counts what the model walked: kernel entries
    and pipeline blocks, neither of which grows with the layer count. est: the calculator's estimate of
    this run on CUDA, where the caller has it (its FLOPs give MFU). hist: a mixture of experts' rows per expert,
    the same in every layer (calculator/moe.py: balanced by default, skewed, or any histogram)."""
    prof = get(gpu)  # 1. the GPU: a datasheet or a calibrated profile (profile.py)
    hist = None if hist is None else tuple(check_histogram(cfg, run, hist))
    ks = kernels(cfg, run, variant, sdpa_backend, optimizer, hist)  # 2. every kernel the step launches (kernels*.py)
    scale = host_scale(prof, variant, sdpa_backend)  # 3. the host's in-step factor (host.py)
    terms, burst_s = step_terms(ks, prof)  # 4. each kernel on the roofline at burst rates (roofline.py)
    # 5. the sustained-load regime, from the step's length (step_weight)
    weight = sustained_weight(burst_s, prof.sustained_tau_s) if prof.sustained_ratio else 0.0
    # 6. the kernels at the step's regime and the host/GPU pipeline over the step (pipeline.py), in the order,
    # host seconds and blocks the model fixes (layout.py: prepared once per model, not per micro-batch)
    lay = layout.of(ks, prof, scale, layout.key(cfg, run, variant, sdpa_backend, optimizer) + (hist,))
    timed_ks, gpu_s, blocks, comps, phases = layout.timed(ks, lay, prof, weight, terms, cfg.layers, with_kernels)
    steps = pipeline.compose(blocks, lay.kernels, gpu_s)
    clock = pipeline.Clock()
    segs, steady = pipeline.simulate(None, cfg.layers, clock, steps), pipeline.steady(None, cfg.layers, steps)
    fb = sum(sg["time_s"] for sg in segs if sg["phase"] != "optimizer")
    opt = sum(sg["time_s"] for sg in segs if sg["phase"] == "optimizer")
    est = est or estimate(cfg, run, variant, "cuda")  # FLOPs under both conventions, for MFU
    model, counter = (est.total(f"flops_{k}_fwd") + est.total(f"flops_{k}_bwd") for k in ("model", "counter"))
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
        sustained=dict(weight=weight, burst_gpu_s=burst_s, tau_s=prof.sustained_tau_s, ratio=prof.sustained_ratio,
                       clocks=prof.clocks),
        sources=prof["sources"], cost=dict(kernel_entries=len(ks), pipeline_blocks=clock.walked))
    if with_kernels:
        out["kernels"] = [dict(row(k, t), host_s=host) for k, t, host in timed_ks]
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
