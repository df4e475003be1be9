"""The kernel list of a training step: the variant's model (kernels_baseline.py, kernels_efficient.py),
then the optimizer; and one fused op on its own, as bench/kernels.py times it.
"""
from __future__ import annotations

from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.optimizer import step_bytes_moved
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
    if cfg.qkv_bias:  # the q, k, v biases (one fused qkv bias in the efficient model)
        per_layer += [H + 2 * kv] if variant == "efficient" else [H, kv, kv]
    out: dict[int, int] = {}
    for n, count in ((V * H, 1 if cfg.tie_embeddings else 2), (H, 2 * L + 1), *((n, L) for n in per_layer)):
        out[n] = out.get(n, 0) + count
    return out


def optimizer_kernels(cfg: ModelConfig, run: Run, variant: str, optimizer: str = "ademamix") -> list[Kernel]:
    """One optimizer step, per group of same-size parameter tensors. efficient: AdEMAMix compiled (or
    a fused torch optimizer) makes one read-modify-write pass per tensor, the minimum of
    calculator/optimizer.py, at the rate calibrate measured for it where it did (fused_efficiency:
    torch's fused AdamW). baseline: the AdEMAMix loop, 15 kernels per tensor that move 38 fp32
    passes per element between them (bf16 params: 3 casts and 18 B more)."""
    pb = BYTES[dtypes(run).param]
    out = []
    for numel, n in sorted(param_sizes(cfg, variant).items()):
        if variant == "baseline" and optimizer == "ademamix":
            launches = 15 + (3 if pb != 4 else 0)
            per = numel * (38 * 4 + (18 if pb != 4 else 0)) // launches
            out.append(Kernel(f"optimizer.ademamix_loop[{numel}]", "optimizer", "optimizer", "memory", n * launches, 0,
                              per))
        else:
            nbytes = step_bytes_moved(numel, optimizer, param_bytes=pb, grad_bytes=pb)
            out.append(Kernel(f"optimizer.{optimizer}_fused[{numel}]", "optimizer", "optimizer", "memory", n, 0,
                              nbytes, fused=(f"optimizer.{optimizer}", numel)))
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
