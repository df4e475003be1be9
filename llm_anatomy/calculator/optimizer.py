"""Optimizer state bytes and bytes moved per step. Pure Python (the calculator never imports torch).

What is stored, per parameter element (bytes), and what is not:
  ademamix  12 = 3 x 4: m1 (exp_avg_fast), m2 (exp_avg_slow), nu (exp_avg_sq), all fp32 whatever
            the param dtype (bf16 params too: see llm_anatomy/optim/common.py). Its `step` is a
            Python int in the state dict, so it costs no tensor bytes.
  adamw      8 = 2 x 4: exp_avg, exp_avg_sq for fp32 params (torch keeps them in the param dtype:
            2 x param_bytes), plus torch's `step`: a 0-dim fp32 tensor per parameter *tensor* (4 B
            each, a 4-byte storage of its own), counted only when n_tensors is given.
  sgd        0: plain SGD (momentum=0) keeps no state at all (torch 2.13: an empty dict).
The measured side (validations/test_optim.py) sums the unique storages of every tensor in
`optimizer.state`, so a view or a shared buffer counts once, as the DESIGN's storage rule says.

Which implementation runs (IMPLEMENTATIONS, implementation()) decides the step's kernels and so its
time (calculator/timing/kernels.py: optimizer_kernels); the optimizer alone decides the state:
  adamw              torch.optim.AdamW(fused=True): one fused pass over each group of tensors
  ademamix-loop      llm_anatomy.optim.AdEMAMix: 15 eager ops per parameter tensor, one tensor at a time
  ademamix-foreach   llm_anatomy.optim.FusedAdEMAMix(compile=False): the same 18 ops as torch._foreach_*,
                     each one launch over a list of tensors (what it runs on CPU)
  ademamix-compiled  llm_anatomy.optim.FusedAdEMAMix on CUDA: the foreach step under torch.compile, one
                     read-modify-write pass per tensor
`anatomy train` on CUDA runs (llm_anatomy/train/setup.py: make_optimizer; validations/test_train.py checks
the two agree): adamw fused for either variant; ademamix as the baseline's loop and the efficient
variant's compiled step.
"""
from __future__ import annotations

from llm_anatomy.config import ConfigError

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
CHOICES = ("adamw", "ademamix")  # what a user picks (--optimizer); sgd is the state tests' no-state case
DEFAULT = "adamw"  # what users run: torch's fused AdamW
IMPLEMENTATIONS = ("adamw", "ademamix-loop", "ademamix-foreach", "ademamix-compiled")
LABELS = {"adamw": "fused AdamW", "ademamix-loop": "AdEMAMix's per-parameter loop",
          "ademamix-foreach": "AdEMAMix's foreach step", "ademamix-compiled": "AdEMAMix's compiled step"}
# what `anatomy train` runs on CUDA, by (optimizer, variant): llm_anatomy/train/setup.py make_optimizer
_TRAIN_RUNS = {("adamw", "baseline"): "adamw", ("adamw", "efficient"): "adamw",
               ("ademamix", "baseline"): "ademamix-loop", ("ademamix", "efficient"): "ademamix-compiled"}


def implementation(optimizer: str, variant: str) -> str:
    """The implementation a step of `variant` runs for `optimizer` on CUDA: the one `anatomy train`
    builds. An implementation name (IMPLEMENTATIONS) is returned as it is."""
    if optimizer in IMPLEMENTATIONS:
        return optimizer
    try:
        return _TRAIN_RUNS[optimizer, variant]
    except KeyError:
        raise ConfigError(f"unknown optimizer {optimizer!r} for the {variant} variant; choose from "
                         f"{', '.join(CHOICES)} (or an implementation: {', '.join(IMPLEMENTATIONS)})") from None


def of_implementation(impl: str) -> str:
    """The optimizer an implementation runs: ademamix-loop -> ademamix."""
    return impl.split("-")[0]


def _check(optimizer: str) -> str:
    name = optimizer.lower()
    if name not in _PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    return name


def state_breakdown(optimizer: str = "ademamix", param_bytes: int = FP32) -> dict[str, int]:
    """Bytes per parameter element of each state tensor, e.g. {'exp_avg_fast': 4, ...}, for parameters
    of param_bytes: AdamW's moments take the parameter's dtype, AdEMAMix's at least fp32."""
    name = _check(optimizer)
    b = param_bytes if name == "adamw" else max(param_bytes, FP32)
    return {k: b for k in _PER_PARAM[name]}


def state_bytes_per_param(optimizer: str = "ademamix", param_bytes: int = FP32) -> int:
    return sum(state_breakdown(optimizer, param_bytes).values())


def state_bytes(n_params: int, optimizer: str = "ademamix", *, n_tensors: int = 0, param_bytes: int = FP32) -> int:
    """Bytes of optimizer state for n_params parameter elements of param_bytes held in n_tensors tensors.

    ademamix: 12 * n_params (fp32 or wider).   adamw: 2 * param_bytes * n_params + 4 * n_tensors.   sgd: 0.
    """
    name = _check(optimizer)
    return state_bytes_per_param(name, param_bytes) * n_params + _PER_TENSOR[name] * n_tensors


def step_bytes_moved(n_params: int, optimizer: str = "ademamix", *, param_bytes: int = 4,
                     grad_bytes: int = 4) -> int:
    """Minimum HBM traffic of one optimizer step (a single fused read-modify-write pass).

    Read p, g and every state tensor; write p and every state tensor back. The 0-dim step tensors
    and per-step scalars are negligible and not counted. ademamix, fp32: (4+4+12) + (4+12) = 36 B
    per parameter; adamw: (4+4+8) + (4+8) = 28 B. The ratio, 9/7, is the time AdEMAMix's extra
    EMA costs a bandwidth-bound step. bf16 parameters: AdamW's state is bf16 too, AdEMAMix's stays fp32.
    """
    state = state_bytes_per_param(optimizer, param_bytes)
    return n_params * ((param_bytes + grad_bytes + state) + (param_bytes + state))
