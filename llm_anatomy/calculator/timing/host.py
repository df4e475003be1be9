"""The host's side: the CPU time to issue each kernel entry, and the in-step factor that scales it.

Per entry: an eager op costs Profile.host_op_s (calibrate_host:measure_host); a custom-op call costs its
measured Profile.host_custom_s figure, or `host_ops` eager ops where the profile has none
(CUSTOM_FALLBACK_OPS without even that). Inside a training step an op costs more than alone (module
calls, autocast, autograd nodes, views): host_scale measures that from a tiny host-bound step
(calibrate_host:measure_host_step) and multiplies every forward and backward op by it, except the calls
calibrate measured as the model makes them (IN_SITU).

The optimizer step: one eager op per launch, issued beside the GPU's work; the compiled AdEMAMix step, where
the profile measured its call (Profile.optimizer_host, calibrate_host:measure_optimizer_host), costs
call_s + tensor_s x its tensors before its first kernel: the step's Python per parameter, Dynamo's guards
on every tensor argument and the wrappers' per-input checks run before Inductor's code launches anything, so
a drained GPU waits for all of it (the pipeline adds it to the GPU's time). Calibrate measures just that part
(the step's wall time less its kernels'); the launches after the first run beside the kernels and cost none.
"""
from __future__ import annotations

from dataclasses import replace

from llm_anatomy.calculator.timing.kernels import kernels
from llm_anatomy.calculator.timing.ops import Kernel
from llm_anatomy.calculator.timing.profile import Profile
from llm_anatomy.config import ModelConfig, Run

CUSTOM_FALLBACK_OPS = 3  # a custom-op call with no measured host cost: as 3 eager ops (dispatch + autograd + launch)
# host figures calibrate measures as the model makes the call (Liger's fused linear CE, under autocast, per
# call and per chunk of its loop: calibrate_host:measure_host_step), so host_scale does not apply to them
IN_SITU = ("liger_ce",)


def host_seconds(kern: Kernel, prof: Profile) -> float:
    """CPU seconds to issue this entry's launches (all `count` of them, or its `calls` host calls)."""
    if kern.host is None:
        return 0.0
    return (kern.count if kern.calls is None else kern.calls) * host_call_s(kern, prof)


def host_call_s(kern: Kernel, prof: Profile) -> float:
    """CPU seconds of one host call of this entry (0.0 for an entry issued inside another's call)."""
    if kern.host is None:
        return 0.0
    if kern.host == "op":
        return prof["host_op_s"]
    op, phase = kern.host.split(".")
    if op in ("optimizer_call", "optimizer_launch"):  # phase: the implementation
        fitted = (prof.get("optimizer_host") or {}).get(phase)
        if op == "optimizer_launch":  # inside the measured call; without it, one eager op each
            return 0.0 if fitted else prof["host_op_s"]
        return optimizer_call_seconds(fitted, kern.shape[0]) if fitted else 0.0
    t = prof["host_custom_s"].get(op, {}).get(phase)
    return t if t is not None else (kern.host_ops or CUSTOM_FALLBACK_OPS) * prof["host_op_s"]


def optimizer_call_seconds(fitted: dict, tensors: int) -> float:
    """Host seconds before the first kernel of one optimizer step over `tensors` tensors: call_s + tensor_s x
    tensors (fit.optimizer_host_fit), at least 0 (a fitted intercept below 0 meets a list shorter than
    calibrate's)."""
    return max(0.0, fitted["call_s"] + fitted["tensor_s"] * tensors)


def in_situ(kern: Kernel, prof: Profile) -> bool:
    """Whether the profile measured this entry's host cost as the model incurs it (IN_SITU)."""
    if not kern.host or "." not in kern.host:
        return False
    op, phase = kern.host.split(".")
    return op in IN_SITU and prof["host_custom_s"].get(op, {}).get(phase) is not None


def host_scale(prof: Profile, variant: str, sdpa_backend: str | None = None) -> float:
    """The tiny step's measured forward + backward time over this model's host figure for the same step,
    both less what was measured in place (in_situ); 1.0 without a tiny step of this variant. One factor
    for forward and backward: per-phase factors predict worse (docs/history.md)."""
    hs = prof.get("host_step") or {}
    rec = hs.get(variant)
    if not rec:
        return 1.0
    memo = getattr(prof, "_host_memo", None)
    if memo is None:
        memo = {}
        if isinstance(prof, Profile):
            object.__setattr__(prof, "_host_memo", memo)
    key = (variant, sdpa_backend)
    if key not in memo:
        # the loss kernel the tiny step ran (a profile without the key was calibrated with Liger's)
        cfg, run = ModelConfig(**hs["cfg"]), Run(hs["batch"], hs["seq"], hs.get("dtype", "amp"),
                                                 loss_impl=hs.get("loss_impl", "liger"))
        ks = kernels(cfg, run, variant, sdpa_backend, None)
        fixed = sum(host_seconds(k, prof) for k in ks if in_situ(k, prof))
        modelled = sum(host_seconds(k, prof) for k in ks) - fixed
        measured = rec["forward_backward_ms"] * 1e-3 - fixed
        memo[key] = measured / modelled if measured > 0 and modelled > 0 else 1.0
    return memo[key]


def at_host_speed(prof: Profile, variant: str, step_ms: float) -> Profile:
    """The profile with every host figure (per op, per custom call, the tiny steps, the optimizer's call)
    scaled by step_ms over its own tiny host step of `variant`: the host as fast as it was when that step
    took step_ms (the probe times the tiny step beside each row: host_ref_ms). The host's speed moves
    between processes on one machine and within one, so a host-bound row's time follows the host then, not
    at calibration (reports/h200/timing-probe/*.json). GPU figures are left as they are."""
    base = ((prof.get("host_step") or {}).get(variant) or {}).get("forward_backward_ms")
    if not base or step_ms <= 0:
        raise ValueError(f"profile {prof.get('name')!r} has no tiny host step of {variant!r} to scale from")
    f = step_ms / base
    hs = {k: (dict(v, forward_backward_ms=v["forward_backward_ms"] * f) if isinstance(v, dict) and
              "forward_backward_ms" in v else v) for k, v in prof["host_step"].items()}
    custom = {op: {ph: t * f for ph, t in v.items()} for op, v in prof["host_custom_s"].items()}
    opt = {impl: dict(v, call_s=v["call_s"] * f, tensor_s=v["tensor_s"] * f)
           for impl, v in (prof.get("optimizer_host") or {}).items()}
    changes = dict(host_op_s=prof["host_op_s"] * f, host_step=hs, host_custom_s=custom, optimizer_host=opt)
    return replace(prof, **changes) if isinstance(prof, Profile) else dict(prof, **changes)
