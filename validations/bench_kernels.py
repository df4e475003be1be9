"""What the kernel and optimizer benchmarks run: each fused kernel, SDPA and each optimizer step alone.

A case is (setup, work): setup() (untimed) returns the args of one repetition, work(*args) is the GPU
work of one repetition (bench_harness.bench runs one or more a round, each on its own setup()).
Shapes: "seed" is the seed model's (B=16, S=4096: 65,536 tokens of
hidden 512, intermediate 1024, 8 heads of 64, vocab 16,000); "wide" a llama-7B/8B-like layer (hidden
4096, intermediate 11008, 32 heads of 128 with 8 kv heads, vocab 128,256), as llm_anatomy.kernels.bench
times them. Dtypes are the efficient model's under amp: the residual stream and the norm weight
fp32, activations bf16, the lm-head weight fp32 (cast per call), fp32 parameters for the optimizers.

Phases: "fwd" runs the op as a training forward (autograd records it); "bwd" runs only its backward
(torch.autograd.grad), the forward done in setup; linear_ce has one phase, "fwd+bwd": its forward
computes the gradients (llm_anatomy/kernels/linear_ce.py) and its backward only scales them.
"""
from __future__ import annotations

import math

import torch

KERNEL_SHAPES = {
    "seed": dict(M=65536, N=512, I=1024, B=16, S=4096, H=8, KV=8, D=64, T=65536, V=16000),
    "wide": dict(M=32768, N=4096, I=11008, B=8, S=4096, H=32, KV=8, D=128, T=8192, V=128256),
}
KERNEL_PHASES = {"rms_norm": ("fwd", "bwd"), "swiglu": ("fwd", "bwd"), "gpt_oss": ("fwd", "bwd"),
                 "rope_qkv": ("fwd", "bwd"), "linear_ce": ("fwd+bwd",), "attention": ("fwd", "bwd")}
KERNELS = tuple(KERNEL_PHASES)
OPTIMIZERS = ("adamw", "ademamix", "fused_ademamix")  # torch fused AdamW; llm_anatomy.optim's two AdEMAMix forms
L2_BYTES = 60 * 2**20


def _sets(per_set_bytes: int) -> int:
    """Input sets to rotate so that one round's inputs are not in L2 from the round before."""
    return min(8, max(2, math.ceil(2 * L2_BYTES / max(per_set_bytes, 1))))


def _rope_tables(S: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D)
    emb = torch.outer(torch.arange(S, device=device).float(), inv).repeat(1, 2)  # (S, D) fp32
    return emb.cos(), emb.sin()


def _inputs(kernel: str, sh: dict, device, g: torch.Generator):
    """(op, differentiable inputs, other args) of one input set."""
    from llm_anatomy.efficient.attention import backend_context
    from llm_anatomy.kernels import linear_cross_entropy, rms_norm, rope_qkv, swiglu

    bf = dict(device=device, dtype=torch.bfloat16)

    def rn(*shape, **kw):
        return torch.randn(*shape, generator=g, **{**dict(device=device), **kw}).requires_grad_()

    if kernel == "rms_norm":  # x: the fp32 residual stream (M, N); y in bf16 under autocast
        return (lambda x, w: rms_norm(x, w, 1e-5)), (rn(sh["M"], sh["N"]), rn(sh["N"])), ()
    if kernel in ("swiglu", "gpt_oss"):  # gate, up (M, I) bf16
        variant = "swiglu" if kernel == "swiglu" else "gpt-oss"
        return (lambda a, b: swiglu(a, b, variant)), (rn(sh["M"], sh["I"], **bf), rn(sh["M"], sh["I"], **bf)), ()
    if kernel == "rope_qkv":  # qkv (B, S, (H + 2 KV) D) bf16 -> q, k, v (B, heads, S, D)
        cos, sin = _rope_tables(sh["S"], sh["D"], device)
        qkv = rn(sh["B"], sh["S"], (sh["H"] + 2 * sh["KV"]) * sh["D"], **bf)
        return (lambda t: rope_qkv(t, cos, sin, sh["H"], sh["KV"])), (qkv,), ()
    if kernel == "linear_ce":  # x (T, H) bf16, weight (V, H) fp32, targets (T,)
        tgt = torch.randint(0, sh["V"], (sh["T"],), device=device, generator=g)
        w = (torch.randn(sh["V"], sh["N"], device=device, generator=g) * 0.02).requires_grad_()
        return (lambda x, w: linear_cross_entropy(x, w, tgt)), (rn(sh["T"], sh["N"], **bf), w), ()
    if kernel == "attention":  # q (B, H, S, D), k, v (B, KV, S, D) bf16, causal, the model's backend choice
        def sdpa(q, k, v):
            with backend_context(q.device):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                        enable_gqa=sh["KV"] != sh["H"])
        B, S, D = sh["B"], sh["S"], sh["D"]
        return sdpa, (rn(B, sh["H"], S, D, **bf), rn(B, sh["KV"], S, D, **bf), rn(B, sh["KV"], S, D, **bf)), ()
    raise KeyError(kernel)


def kernel_case(kernel: str, shape: str, phase: str, device, shapes: dict = KERNEL_SHAPES):
    """(setup, work, info) for one kernel benchmark."""
    sh = shapes[shape]
    g = torch.Generator(device=device)
    g.manual_seed(0)
    first = _inputs(kernel, sh, device, g)
    per_set = sum(t.numel() * t.element_size() for t in first[1])
    sets = [first] + [_inputs(kernel, sh, device, g) for _ in range(_sets(per_set) - 1)]
    ac = lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)  # noqa: E731
    it = iter(range(10**12))

    def pick():
        op, xs, _ = sets[next(it) % len(sets)]
        for x in xs:
            x.grad = None
        return op, xs

    if phase in ("fwd", "fwd+bwd"):
        def setup():
            op, xs = pick()
            _sync(device)
            return (op, xs), {}

        def work(op, xs):
            if phase == "fwd+bwd":  # host only: a round's repetitions may reuse a set, never accumulate into it
                for x in xs:
                    x.grad = None
            with ac():
                out = op(*xs)
            if phase == "fwd+bwd":
                out.backward()
            return out
    else:  # bwd: the forward is setup's, untimed
        def setup():
            op, xs = pick()
            with ac():
                outs = op(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            grads = tuple(torch.randn(o.shape, generator=g, device=device, dtype=o.dtype) for o in outs)
            _sync(device)
            return (outs, xs, grads), {}

        def work(outs, xs, grads):
            return torch.autograd.grad(outs, xs, grads)
    return setup, work, dict(kernel=kernel, shape=shape, phase=phase, input_sets=len(sets),
                             **{k: v for k, v in sh.items()})


def _param_shapes(shape: str) -> list[tuple[int, ...]]:
    if shape == "seed":  # the seed model's parameters
        from llm_anatomy.config import PRESETS
        from llm_anatomy.models import build_model

        return [tuple(p.shape) for p in build_model(PRESETS["seed"], "baseline", device="meta").parameters()]
    h, i = 4096, 11008  # two llama-7B-like layers: q, k, v, o, gate, up, down and two norms each
    return 2 * ([(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)])


def optimizer_case(name: str, shape: str, device):
    """(setup, work, info): one optimizer step over fp32 parameters with random gradients."""
    from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix

    g = torch.Generator(device=device)
    g.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in _param_shapes(shape)]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    cuda = torch.device(device).type == "cuda"
    opt = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-4, fused=cuda),
           "ademamix": lambda: AdEMAMix(params, lr=1e-4),
           "fused_ademamix": lambda: FusedAdEMAMix(params, lr=1e-4)}[name]()

    def setup():
        _sync(device)
        return (), {}

    return setup, opt.step, dict(optimizer=name, shape=shape, phase="step", params=sum(p.numel() for p in params),
                                 tensors=len(params))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
