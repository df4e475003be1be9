"""What the two AdEMAMix implementations share: hyperparameter checks and the state layout.

State per parameter (same keys in both, so a state_dict moves between them):
    step           Python int, this parameter's update count t. A host int, not a tensor: it costs
                   no device memory, and the per-step scalars derived from it (schedules, bias
                   corrections) are computed on the host in float64 anyway.
    exp_avg_fast   m1, EMA of g with beta1        (state dtype, shape of p)
    exp_avg_slow   m2, EMA of g with beta3(t)     (state dtype, shape of p)
    exp_avg_sq     nu, EMA of g*g with beta2      (state dtype, shape of p)
State dtype = promote(param dtype, fp32): fp32 for bf16/fp16/fp32 params, fp64 for fp64 params.
bf16 params get fp32 state because m2 with beta3 = 0.9999 adds (1 - beta3) * g = 1e-4 * g per
step, which is below bf16's 2**-8 relative resolution: a bf16 m2 would never move.
"""
from __future__ import annotations

import torch

STATE_KEYS = ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq")


def make_defaults(lr, betas, alpha, eps, weight_decay, T_alpha_beta3) -> dict:
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate: {lr}")
    if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas (need 3 values in [0, 1)): {betas}")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps: {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"invalid weight_decay: {weight_decay}")
    if not alpha >= 0.0:
        raise ValueError(f"invalid alpha: {alpha}")
    if T_alpha_beta3 is not None and (isinstance(T_alpha_beta3, bool) or int(T_alpha_beta3) != T_alpha_beta3
                                      or T_alpha_beta3 <= 0):
        raise ValueError(f"invalid T_alpha_beta3 (a positive int or None): {T_alpha_beta3}")
    return dict(lr=lr, betas=tuple(betas), alpha=alpha, eps=eps, weight_decay=weight_decay,
                T_alpha_beta3=T_alpha_beta3)


def state_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.promote_types(param.dtype, torch.float32)


def init_state(state: dict, p: torch.Tensor) -> None:
    state["step"] = 0
    for key in STATE_KEYS:
        state[key] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
