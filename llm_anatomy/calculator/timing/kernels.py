"""The kernel list of a training step: the variant's model (kernels_baseline.py, kernels_efficient.py),
then the optimizer; and one fused op on its own, as bench/kernel_rates.py times it.
"""
from __future__ import annotations

from functools import lru_cache

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.moe import refuse_phases
from llm_anatomy.config import time_unmodelled
from llm_anatomy.calculator.optimizer import implementation, of_implementation, step_bytes_moved
from llm_anatomy.calculator.timing.kernels_baseline import baseline_kernels
from llm_anatomy.calculator.timing.kernels_efficient import efficient_kernels, liger_loss
from llm_anatomy.calculator.timing.op_bytes import dw_sum_bytes
from llm_anatomy.calculator.timing.ops import Kernel, Ops
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import ConfigError, ModelConfig, Run

VARIANTS = ("baseline", "efficient")
SDPA_BACKENDS = ("cudnn", "flash", "memory-efficient")


def param_sizes(cfg: ModelConfig, variant: str) -> dict[int, int]:
    """{elements: how many parameter tensors of that size} in the variant's module tree: memory.param_tensors's
    list (the efficient model holds qkv and gate_up as one tensor each, a mixture of experts its stacked experts;
    a tied head is the embedding's tensor)."""
    from llm_anatomy.calculator.memory import param_tensors

    out: dict[int, int] = {}
    for n, count in param_tensors(cfg, variant):
        out[n] = out.get(n, 0) + count
    return out


# AdEMAMix's eager step (llm_anatomy/optim): (fp32 passes over the tensor, ops) for fp32 parameters. The loop
# (baseline.py): m1 mul_, add_ (2+3); m2 mul_, add_ (2+3); nu mul_, addcmul_ reading g twice (2+4); denom
# sqrt, div, add_ (3 x 2); update m1 / bc1, alpha * m2, add, / denom (2+2+3+3); + wd p (3); p -= lr update (3):
# 38 passes in 15 ops. foreach (efficient.py, eager): the same with (1 - beta3) g, alpha m2 and wd p as
# products of their own (a mul, then an add: one pass more each) and lr applied by its own mul_: 44 in 18.
# bf16 parameters add casts of g and p to fp32 and p's copy back: 6 B each per element, 18 B in all.
# validations/test_optim.py counts both on CPU, op by op.
_EAGER = {"ademamix-loop": (38, 15), "ademamix-foreach": (44, 18)}
CAST_BYTES = 18
# torch's foreach kernels (ATen/native/cuda/MultiTensorApply.cuh): one launch covers at most 48 tensors (3
# lists) and 320 chunks of 65,536 elements; a larger list takes more launches of the same op
FOREACH_TENSORS, FOREACH_CHUNKS, FOREACH_CHUNK = 48, 320, 65_536


def optimizer_step_bytes(impl: str, numel: int, param_bytes: int = 4) -> int:
    """HBM bytes one step of `impl` moves for a parameter tensor of numel elements (param_bytes each):
    the sum over its ops of the tensors each reads and writes; a fused pass moves the minimum."""
    if impl in _EAGER:
        return numel * (_EAGER[impl][0] * 4 + (CAST_BYTES if param_bytes != 4 else 0))
    return step_bytes_moved(numel, of_implementation(impl), param_bytes=param_bytes, grad_bytes=param_bytes)


def foreach_launches(sizes: dict[int, int]) -> int:
    """Launches of one foreach op over tensors of these sizes ({elements: how many})."""
    tensors = sum(sizes.values())
    chunks = sum(n * -(-numel // FOREACH_CHUNK) for numel, n in sizes.items())
    return max(-(-tensors // FOREACH_TENSORS), -(-chunks // FOREACH_CHUNKS))


def optimizer_kernels(cfg: ModelConfig, run: Run, variant: str, optimizer: str = "ademamix") -> list[Kernel]:
    """One optimizer step's kernels (_optimizer_kernels): they follow the parameters, never the micro-batch or
    sequence, so they are built once per model, variant, optimizer and parameter dtype."""
    return list(_optimizer_kernels(cfg, BYTES[dtypes(run).param], variant, optimizer))


@lru_cache(maxsize=256)
def _optimizer_kernels(cfg: ModelConfig, pb: int, variant: str, optimizer: str) -> tuple[Kernel, ...]:
    """One optimizer step, for the implementation the step runs (calculator/optimizer.py:
    implementation(optimizer, variant), what `anatomy train` builds on CUDA; an implementation name picks
    one directly), each timed from the bytes it moves (optimizer_step_bytes):
      adamw, ademamix-compiled  one read-modify-write pass per tensor, the minimum of
                  calculator/optimizer.step_bytes_moved, at the rate calibrate measured for the op where it
                  did (registry: optimizer.adamw is torch's fused AdamW), else the copy bandwidth; an entry
                  per group of same-size tensors, a launch per tensor;
      ademamix-loop     15 eager ops per tensor (_EAGER), one tensor at a time (bf16: 3 casts more);
      ademamix-foreach  18 foreach ops over the list of every tensor, each foreach_launches() launches
                  (bf16: the casts of g and p per tensor, and one foreach copy back).
    Host: a launch costs one eager op (host.host_seconds), except the compiled step's where the profile
    measured its call (Profile.optimizer_host): then one host-only entry first, the call (shape: its
    tensors), holds the host time before the step's first kernel, and its launches none (inside the call,
    they run beside the kernels)."""
    impl = implementation(optimizer, variant)
    cast = pb != 4
    sizes = param_sizes(cfg, variant)
    if impl == "ademamix-foreach":
        ops = _EAGER[impl][1] + (1 if cast else 0)
        launches = ops * foreach_launches(sizes)
        total = sum(n * (optimizer_step_bytes(impl, numel, pb) - (12 * numel if cast else 0))
                    for numel, n in sizes.items())  # all but the per-tensor casts
        out = [Kernel("optimizer.ademamix_foreach", "optimizer", "optimizer", "memory", launches, 0, total // launches)]
        if cast:  # g.to(fp32), p.to(fp32): a launch each per tensor
            out += [Kernel(f"optimizer.ademamix_foreach.cast[{numel}]", "optimizer", "optimizer", "memory", 2 * n, 0,
                           6 * numel) for numel, n in sorted(sizes.items())]
        return tuple(out)
    name = "adamw_fused" if impl == "adamw" else impl.replace("-", "_")
    out, host = [], "op"
    if impl == "ademamix-compiled":  # the call's host time, before its first kernel (host.optimizer_call_seconds)
        host = f"optimizer_launch.{impl}"
        out.append(Kernel(f"optimizer.{name}.call", "optimizer", "optimizer", "host", 1, 0, 0,
                          shape=(sum(sizes.values()),), host=f"optimizer_call.{impl}", order=0))
    for numel, n in sorted(sizes.items()):
        nbytes = optimizer_step_bytes(impl, numel, pb)
        if impl == "ademamix-loop":
            launches = _EAGER[impl][1] + (3 if cast else 0)
            out.append(Kernel(f"optimizer.{name}[{numel}]", "optimizer", "optimizer", "memory", n * launches, 0,
                              nbytes // launches))  # the ops' average: the time is the bytes' and the launches'
        else:
            out.append(Kernel(f"optimizer.{name}[{numel}]", "optimizer", "optimizer", "memory", n, 0, nbytes,
                              host=host, fused=(f"optimizer.{of_implementation(impl)}", numel)))
    return tuple(out)


def kernels(cfg: ModelConfig, run: Run, variant: str, sdpa_backend: str | None = None,
            optimizer: str | None = "adamw", hist=None) -> list[Kernel]:
    """Every kernel of one training step; hist: a mixture of experts' rows per expert, the same in every layer
    (calculator/moe.py; default balanced)."""
    # what the memory phases do not model is not timed either: the step is one model (calculator/moe.py)
    refuse_phases(cfg, run, variant, what="the timing model")
    if name := time_unmodelled(cfg):
        raise ConfigError(f"the timing model: {name} not modelled yet (config {cfg.name}); the memory phases are")
    if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
        raise ConfigError(f"unknown SDPA backend {sdpa_backend!r}; choose from {', '.join(SDPA_BACKENDS)}")
    if variant == "efficient":
        ks = efficient_kernels(cfg, run, sdpa_backend or "cudnn", hist)
    elif variant == "baseline":
        ks = baseline_kernels(cfg, run, hist)
    else:
        raise ConfigError(f"timing has no {variant!r} variant; choose from {', '.join(VARIANTS)}")
    return ks + (optimizer_kernels(cfg, run, variant, optimizer) if optimizer else [])


def standalone_kernels(op: str, cfg: ModelConfig, batch: int, seq: int) -> list[Kernel]:
    """One bf16 fused op, forward + backward, as bench/kernel_rates.py times it (leaves, no autocast,
    a random upstream gradient): "rms_norm", "swiglu", "rope_qkv" (ours) or "linear_ce" (Liger)."""
    o = Ops(cfg, Run(batch, seq, "bf16"))
    T, H, I, D, c = o.run.tokens, cfg.hidden, cfg.intermediate, cfg.q_dim + 2 * cfg.kv_dim, o.c
    if op == "rms_norm":
        o.mem("rms_norm", "norm", "forward", T * H * c, T * H * c, host="rms_norm.forward")
        o.mem("rms_norm.backward", "norm", "backward", 2 * T * H * c, T * H * c, host="rms_norm.backward")
        o.mem("rms_norm.dw_sum", "norm", "backward", *dw_sum_bytes(H, T), host=None)
    elif op == "swiglu":  # gate and up are separate leaves here: backward writes new dgate, dup
        o.mem("swiglu", "mlp", "forward", 2 * T * I * c, T * I * c, host="swiglu.forward")
        o.mem("swiglu.backward", "mlp", "backward", 3 * T * I * c, 2 * T * I * c, host="swiglu.backward")
    elif op == "rope_qkv":
        o.mem("rope_qkv", "attention", "forward", T * D * c, T * D * c, host="rope_qkv.forward")
        o.mem("rope_qkv.backward", "attention", "backward", T * D * c, T * D * c, host="rope_qkv.backward")
    elif op == "linear_ce":
        liger_loss(o)  # a random upstream gradient: backward scales grad_input and grad_weight
        o.mem("loss.grad_input_mul", "loss", "backward", T * H * c, T * H * c)
        o.mem("loss.grad_weight_mul", "loss", "backward", cfg.vocab * H * c, cfg.vocab * H * c)
    else:
        raise ConfigError(f"no standalone model for {op!r}")
    return o.k
