"""AdEMAMix, baseline: a per-parameter Python loop that reads like Algorithm 1 of the paper.

    m1 <- beta1 m1 + (1 - beta1) g                       fast EMA, bias-corrected
    m2 <- beta3(t) m2 + (1 - beta3(t)) g                 slow EMA, NOT bias-corrected
    nu <- beta2 nu + (1 - beta2) g^2                     second moment, bias-corrected
    p  <- p - lr ((m1 / (1 - beta1^t) + alpha(t) m2) / (sqrt(nu / (1 - beta2^t)) + eps) + wd p)

Each tensor op runs over one parameter at a time: about 15 kernels per parameter per step, each
reading and writing whole tensors, plus transients (denominator, numerator, update) of the
parameter's size. The efficient version (efficient.py) does the same math in one pass.
"""
from __future__ import annotations

import math

import torch

from anatomy.optim.common import init_state, make_defaults, state_dtype
from anatomy.optim.schedules import alpha_at, beta3_at


class AdEMAMix(torch.optim.Optimizer):
    """AdEMAMix (Pagliardini, Ablin, Grangier, 2024). State: see anatomy/optim/common.py.

    T_alpha_beta3: warm-up length of both alpha (linear from 0) and beta3 (linear in half-life
    from beta1); None means no warm-up. Weight decay is decoupled (AdamW-style, scaled by lr).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 eps: float = 1e-8, weight_decay: float = 0.0, T_alpha_beta3: int | None = None):
        super().__init__(params, make_defaults(lr, betas, alpha, eps, weight_decay, T_alpha_beta3))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd, T = group["lr"], group["eps"], group["weight_decay"], group["T_alpha_beta3"]
            beta1, beta2, beta3_final = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdEMAMix does not support sparse gradients")
                state = self.state[p]
                if not state:
                    init_state(state, p)
                state["step"] += 1
                t = state["step"]
                alpha = alpha_at(t, group["alpha"], T)
                beta3 = beta3_at(t, beta3_final, beta1, T)
                m1, m2, nu = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]

                # bf16 params: the math runs in fp32 on an fp32 copy, rounded back once at the end
                dt = state_dtype(p)
                g = p.grad.to(dt)
                w = p if p.dtype == dt else p.to(dt)

                m1.mul_(beta1).add_(g, alpha=1 - beta1)
                m2.mul_(beta3).add_(g, alpha=1 - beta3)
                nu.mul_(beta2).addcmul_(g, g, value=1 - beta2)

                bias_correction1 = 1 - beta1 ** t
                bias_correction2 = 1 - beta2 ** t
                denom = (nu.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                update = (m1 / bias_correction1 + alpha * m2) / denom
                update.add_(w, alpha=wd)  # decoupled weight decay uses p before this step
                w.add_(update, alpha=-lr)
                if w is not p:
                    p.copy_(w)
        return loss
