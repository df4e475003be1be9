"""AdEMAMix warm-up schedules (Pagliardini et al., 2024, Algorithm 1, line 5). Pure Python.

Both optimizers call these with the 1-based step t, so alpha(t) and beta3(t) are the values used
in the update of step t.

alpha: linear from 0 to alpha over T steps, then constant.
    f_alpha(t) = min(t * alpha / T, alpha)

beta3: a large beta3 from step 1 would let the slow EMA m2 (not bias-corrected) sit at ~0 and then
blow up once it has accumulated, so beta3 starts at beta_start (= beta1, the paper's choice) and
grows until T. Growing it linearly in beta is useless: nearly all of the half-life change happens
in the last few steps. The schedule is linear in the half-life instead. An EMA with decay b halves
an old gradient's weight after h(b) = ln(1/2) / ln(b) steps, so
    h(beta3(t)) = (1 - t/T) * h(beta_start) + (t/T) * h(beta3)
which the paper writes in closed form as
    f_beta3(t) = min(exp(ln(beta_start) ln(beta3) / ((1 - t/T) ln(beta3) + (t/T) ln(beta_start))), beta3).
(Apple's reference code interpolates h(b) - 1 instead; the -1 cancels, so it is the same schedule.)
"""
from __future__ import annotations

import math


def alpha_at(t: int, alpha: float, T: int | None) -> float:
    """alpha(t): linear warm-up from 0 over T steps; alpha itself when T is None (no warm-up)."""
    if T is None or t >= T:
        return alpha
    return t * alpha / T


def _half_life(beta: float) -> float:
    return math.log(0.5) / math.log(beta)  # steps for weight beta**n to reach 1/2


def beta3_at(t: int, beta3: float, beta_start: float, T: int | None) -> float:
    """beta3(t): linear in half-life from beta_start to beta3 over T steps; beta3 when T is None."""
    if T is None or t >= T or beta3 <= beta_start:
        return beta3
    if beta_start <= 0.0:  # half-life 0: interpolate from a zero half-life
        h = (t / T) * _half_life(beta3)
    else:
        h = (1.0 - t / T) * _half_life(beta_start) + (t / T) * _half_life(beta3)
    return min(math.pow(0.5, 1.0 / h), beta3) if h > 0 else 0.0
