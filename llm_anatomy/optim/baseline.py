"""AdEMAMix, baseline: a per-parameter Python loop that reads like Algorithm 1 of the paper.

    m1 <- beta1 m1 + (1 - beta1) g                       fast EMA, bias-corrected
    m2 <- beta3(t) m2 + (1 - beta3(t)) g                 slow EMA, NOT bias-corrected
    nu <- beta2 nu + (1 - beta2) g^2                     second moment, bias-corrected
    p  <- p - lr ((m1 / (1 - beta1^t) + alpha(t) m2) / (sqrt(nu / (1 - beta2^t)) + eps) + wd p)

Each tensor op runs over one parameter at a time: about 15 kernels per parameter per step, each
reading and writing whole tensors, plus transients (denominator, numerator, update) of the
parameter's size; this op sequence is what calculator/timing/kernels.py: optimizer_kernels counts
(validations/test_optim_kernels.py checks it op by op). The efficient version (efficient.py) writes
the same update in foreach form and runs it in one pass; the per-step scalars and the bookkeeping are
common.py's, shared by both.
"""
from __future__ import annotations

from llm_anatomy.optim.common import AdEMAMixBase, state_dtype, step_scalars


class AdEMAMix(AdEMAMixBase):
    """AdEMAMix, one parameter at a time (hyperparameters and state: llm_anatomy/optim/common.py)."""

    def _update(self, group, params) -> None:
        beta1, beta2, _ = group["betas"]
        for p in params:
            state = self.state[p]
            s = step_scalars(group, state["step"])
            m1, m2, nu = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]

            # bf16 params: the math runs in fp32 on an fp32 copy, rounded back once at the end
            dt = state_dtype(p)
            g = p.grad.to(dt)
            w = p if p.dtype == dt else p.to(dt)

            m1.mul_(beta1).add_(g, alpha=1 - beta1)
            m2.mul_(s.beta3).add_(g, alpha=s.one_minus_beta3)
            nu.mul_(beta2).addcmul_(g, g, value=1 - beta2)

            denom = (nu.sqrt() / s.sqrt_bias_correction2).add_(group["eps"])
            update = (m1 / s.bias_correction1 + s.alpha * m2) / denom
            update.add_(w, alpha=s.weight_decay)  # decoupled weight decay uses p before this step
            w.add_(update, alpha=-s.lr)
            if w is not p:
                p.copy_(w)
