"""Optimizer state bytes and bytes moved per step. Pure Python (the calculator never imports torch).

What is stored, per parameter element (bytes), and what is not:
  ademamix  12 = 3 x 4: m1 (exp_avg_fast), m2 (exp_avg_slow), nu (exp_avg_sq), all fp32 whatever
            the param dtype (bf16 params too: see anatomy/optim/common.py). Its `step` is a
            Python int in the state dict, so it costs no tensor bytes.
  adamw      8 = 2 x 4: exp_avg, exp_avg_sq for fp32 params (torch keeps them in the param dtype),
            plus torch's `step`: a 0-dim fp32 tensor per parameter *tensor* (4 B each, a 4-byte
            storage of its own), counted only when n_tensors is given.
  sgd        0: plain SGD (momentum=0) keeps no state at all (torch 2.13: an empty dict).
The measured side (validations/test_optim.py) sums the unique storages of every tensor in
`optimizer.state`, so a view or a shared buffer counts once, as the DESIGN's storage rule says.
"""
from __future__ import annotations

FP32 = 4

# state bytes per parameter element, by state tensor
_PER_PARAM: dict[str, dict[str, int]] = {
    "ademamix": {"exp_avg_fast": FP32, "exp_avg_slow": FP32, "exp_avg_sq": FP32},
    "adamw": {"exp_avg": FP32, "exp_avg_sq": FP32},
    "sgd": {},
}
# bytes per parameter *tensor* (torch's 0-dim fp32 `step`)
_PER_TENSOR: dict[str, int] = {"ademamix": 0, "adamw": FP32, "sgd": 0}

OPTIMIZERS = tuple(_PER_PARAM)


def _check(optimizer: str) -> str:
    name = optimizer.lower()
    if name not in _PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    return name


def state_breakdown(optimizer: str = "ademamix") -> dict[str, int]:
    """Bytes per parameter element of each state tensor, e.g. {'exp_avg_fast': 4, ...}."""
    return dict(_PER_PARAM[_check(optimizer)])


def state_bytes_per_param(optimizer: str = "ademamix") -> int:
    return sum(_PER_PARAM[_check(optimizer)].values())


def state_bytes(n_params: int, optimizer: str = "ademamix", *, n_tensors: int = 0) -> int:
    """Bytes of optimizer state for n_params parameter elements held in n_tensors tensors.

    ademamix: 12 * n_params.   adamw: 8 * n_params + 4 * n_tensors.   sgd: 0.
    """
    name = _check(optimizer)
    return state_bytes_per_param(name) * n_params + _PER_TENSOR[name] * n_tensors


def step_bytes_moved(n_params: int, optimizer: str = "ademamix", *, param_bytes: int = 4,
                     grad_bytes: int = 4) -> int:
    """Minimum HBM traffic of one optimizer step (a single fused read-modify-write pass).

    Read p, g and every state tensor; write p and every state tensor back. The 0-dim step tensors
    and per-step scalars are negligible and not counted. ademamix, fp32: (4+4+12) + (4+12) = 36 B
    per parameter; adamw: (4+4+8) + (4+8) = 28 B. The ratio, 9/7, is the time AdEMAMix's extra
    EMA costs a bandwidth-bound step.
    """
    state = state_bytes_per_param(optimizer)
    return n_params * ((param_bytes + grad_bytes + state) + (param_bytes + state))
