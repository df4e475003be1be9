"""The kernel list of a training step: the variant's model (kernels_baseline.py, kernels_efficient.py),
then the optimizer; and one fused op on its own, as bench/kernels.py times it.
"""
from __future__ import annotations

from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.optimizer import implementation, of_implementation, step_bytes_moved
from anatomy.calculator.timing.kernels_baseline import baseline_kernels
from anatomy.calculator.timing.kernels_efficient import efficient_kernels, liger_loss
from anatomy.calculator.timing.op_bytes import dw_sum_bytes
from anatomy.calculator.timing.ops import Kernel, Ops
from anatomy.calculator.types import BYTES
from anatomy.config import ConfigError, ModelConfig, Run

VARIANTS = ("baseline", "efficient")
SDPA_BACKENDS = ("cudnn", "flash", "memory-efficient")


def param_sizes(cfg: ModelConfig, variant: str) -> dict[int, int]:
    """{elements: how many parameter tensors of that size} in the variant's module tree (the efficient
    model holds qkv and gate_up as one tensor each; a tied head is the embedding's tensor)."""
    H, I, V, kv, L = cfg.hidden, cfg.intermediate, cfg.vocab, cfg.kv_dim, cfg.layers
    per_layer = ([(H + 2 * kv) * H, H * H, 2 * I * H, I * H] if variant == "efficient"
                 else [H * H, kv * H, kv * H, H * H, I * H, I * H, H * I])
    out: dict[int, int] = {}
    for n, count in ((V * H, 1 if cfg.tie_embeddings else 2), (H, 2 * L + 1), *((n, L) for n in per_layer)):
        out[n] = out.get(n, 0) + count
    return out


# AdEMAMix's eager step (anatomy/optim): (fp32 passes over the tensor, ops) for fp32 parameters. The loop
# (baseline.py): m1 mul_, add_ (2+3); m2 mul_, add_ (2+3); nu mul_, addcmul_ reading g twice (2+4); denom
# sqrt, div, add_ (3 x 2); update m1 / bc1, alpha * m2, add, / denom (2+2+3+3); + wd p (3); p -= lr update (3):
# 38 passes in 15 ops. foreach (efficient.py, eager): the same with 1 - beta3 and alpha * m2 and wd * p as
# products of their own (mul then add: one pass more each) and lr applied as a separate mul_: 44 in 18.
# bf16 parameters add 3 casts (g and p to fp32, p back): 18 B per element.
_EAGER = {"ademamix-loop": (38, 15), "ademamix-foreach": (44, 18)}


def optimizer_kernels(cfg: ModelConfig, run: Run, variant: str, optimizer: str = "ademamix") -> list[Kernel]:
    """One optimizer step, per group of same-size parameter tensors, for the implementation the step runs
    (calculator/optimizer.py: implementation(optimizer, variant), what `anatomy train` builds on CUDA;
    an implementation name picks one directly). Each is timed from the bytes it moves:
      adamw, ademamix-compiled  one read-modify-write pass per tensor, the minimum of
                  calculator/optimizer.step_bytes_moved, at the rate calibrate measured for the op where it
                  did (registry: optimizer.adamw is torch's fused AdamW), else the copy bandwidth;
      ademamix-loop     15 eager ops per tensor (_EAGER), each launched once per tensor;
      ademamix-foreach  18 foreach ops, each one launch over the tensors of a size (torch's multi-tensor
                  kernels), the same traffic as the loop's ops at the copy bandwidth."""
    impl = implementation(optimizer, variant)
    opt = of_implementation(impl)
    pb = BYTES[dtypes(run).param]
    name = "adamw_fused" if impl == "adamw" else impl.replace("-", "_")
    out = []
    for numel, n in sorted(param_sizes(cfg, variant).items()):
        if impl in _EAGER:
            passes, ops = _EAGER[impl]
            launches = ops + (3 if pb != 4 else 0)
            total = numel * (passes * 4 + (18 if pb != 4 else 0))  # every op of the step over one tensor
            per_tensor = impl == "ademamix-loop"
            out.append(Kernel(f"optimizer.{name}[{numel}]", "optimizer", "optimizer", "memory",
                              n * launches if per_tensor else launches, 0,
                              total // launches if per_tensor else total * n // launches))
        else:
            nbytes = step_bytes_moved(numel, opt, param_bytes=pb, grad_bytes=pb)
            out.append(Kernel(f"optimizer.{name}[{numel}]", "optimizer", "optimizer", "memory", n, 0,
                              nbytes, fused=(f"optimizer.{opt}", numel)))
    return out


def kernels(cfg: ModelConfig, run: Run, variant: str, sdpa_backend: str | None = None,
            optimizer: str | None = "ademamix") -> list[Kernel]:
    if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
        raise ConfigError(f"unknown SDPA backend {sdpa_backend!r}; choose from {', '.join(SDPA_BACKENDS)}")
    if variant == "efficient":
        ks = efficient_kernels(cfg, run, sdpa_backend or "cudnn")
    elif variant == "baseline":
        ks = baseline_kernels(cfg, run)
    else:
        raise ConfigError(f"timing has no {variant!r} variant; choose from {', '.join(VARIANTS)}")
    return ks + (optimizer_kernels(cfg, run, variant, optimizer) if optimizer else [])


def standalone_kernels(op: str, cfg: ModelConfig, batch: int, seq: int) -> list[Kernel]:
    """One bf16 fused op, forward + backward, as bench/kernels.py times it (leaves, no autocast,
    a random upstream gradient): "rms_norm", "swiglu", "rope_qkv" (ours) or "linear_ce" (Liger)."""
    o = Ops(cfg, Run(batch, seq, "bf16"))
    T, H, I, D, c = o.run.tokens, cfg.hidden, cfg.intermediate, cfg.hidden + 2 * cfg.kv_dim, o.c
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
