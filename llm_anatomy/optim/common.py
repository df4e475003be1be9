"""What the two AdEMAMix implementations share: hyperparameter checks, the state layout, the
per-step scalars and the step's bookkeeping (AdEMAMixBase). Each subclass writes the update once,
in its own form: a per-parameter loop (baseline.py) or foreach ops over a bucket (efficient.py).

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

import math
from typing import NamedTuple

import torch

from llm_anatomy.optim.schedules import alpha_at, beta3_at

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


class StepScalars(NamedTuple):
    """The scalars of one step t, in float64 on the host; each implementation rounds them to the
    state dtype once. In this order they fill efficient.py's (7,) buffer."""
    lr: float
    alpha: float  # alpha(t), schedules.alpha_at
    beta3: float  # beta3(t), schedules.beta3_at
    one_minus_beta3: float  # in float64: fp32(0.9999) is 1.7e-8 off, 1.7e-4 of 1 - beta3
    bias_correction1: float  # 1 - beta1^t
    sqrt_bias_correction2: float  # sqrt(1 - beta2^t)
    weight_decay: float


def step_scalars(group: dict, t: int) -> StepScalars:
    beta1, beta2, beta3_final = group["betas"]
    T = group["T_alpha_beta3"]
    beta3 = beta3_at(t, beta3_final, beta1, T)
    return StepScalars(group["lr"], alpha_at(t, group["alpha"], T), beta3, 1 - beta3, 1 - beta1 ** t,
                       math.sqrt(1 - beta2 ** t), group["weight_decay"])


class AdEMAMixBase(torch.optim.Optimizer):
    """AdEMAMix (Pagliardini, Ablin, Grangier, 2024): the step's bookkeeping. A subclass's
    _update(group, params) applies one step to the group's params that have a gradient, each with
    its state initialised and its step count already advanced.

    T_alpha_beta3: warm-up length of both alpha (linear from 0) and beta3 (linear in half-life
    from beta1); None means no warm-up. Weight decay is decoupled (AdamW-style, scaled by lr).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 eps: float = 1e-8, weight_decay: float = 0.0, T_alpha_beta3: int | None = None):
        super().__init__(params, make_defaults(lr, betas, alpha, eps, weight_decay, T_alpha_beta3))

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    init_state(state, p)
                state["step"] += 1
            self._update(group, params)
        return loss
