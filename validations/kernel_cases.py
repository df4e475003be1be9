"""Shared by the kernel tests (test_kernels.py, test_rms_norm.py, test_swiglu.py, test_rope.py,
test_kernels_compile.py): the plain-torch twins of each op, the input cases, and the accuracy check.

Accuracy is judged against the reference's own error (DESIGN.md): for every output and gradient,
    err(op in dtype vs fp64) <= 2 * err(plain torch in dtype vs fp64) + floor,
err = max abs difference, the fp64 reference being the same plain-torch code run on the
dtype-rounded inputs in float64. floor = eps(dtype) * max|fp64 value| is one unit of rounding at
the tensor's largest magnitude: no result stored in that dtype can be promised closer than half of
it, and it keeps the bound meaningful where the plain code happens to be exact (v in rope_qkv is a
pure copy; some fp32 elementwise results round identically), where 2 * 0 would demand the
impossible of any implementation that rounds differently.

Paths: "reference" runs the ops as CPU CI does (plain-torch implementations); "triton" runs them
inside triton_on_cpu(), i.e. through the Triton kernels under TRITON_INTERPRET=1; gpu-marked tests
run the Triton kernels on CUDA in bf16.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from llm_anatomy.kernels import INTERPRET, rms_norm, rope_qkv, swiglu, triton_on_cpu

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="TRITON_INTERPRET=1 is not set (conftest sets it where nvidia-smi is absent): "
                          "the Triton kernels are checked on CUDA by the gpu-marked tests instead")
PATHS = ["reference", pytest.param("triton", marks=needs_interpreter)]
# The interpreter evaluates sigmoid as 1/(1+exp(-x)) in numpy: exp overflows to inf for very
# negative x and the result is the correct 0, with a numpy warning.
IGNORE_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def path_ctx(name: str):
    """The context a path runs in: triton_on_cpu() for "triton", nothing for "reference"."""
    return triton_on_cpu() if name == "triton" else contextlib.nullcontext()


# ---- plain-torch implementations: the same-dtype baseline, and in fp64 the reference -----------
def plain_rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def plain_swiglu(gate, up, variant):
    if variant == "gpt-oss":
        return (up.clamp(-7.0, 7.0) + 1) * F.silu(gate.clamp(max=7.0))
    return F.silu(gate) * up


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain_rope_qkv(qkv, cos, sin, heads, kv_heads):  # Hugging Face style: tables cast to the activation dtype
    B, S, W = qkv.shape
    D = W // (heads + 2 * kv_heads)
    q, k, v = (t.transpose(1, 2) for t in qkv.view(B, S, -1, D).split([heads, kv_heads, kv_heads], dim=2))
    c, s = cos.to(qkv.dtype), sin.to(qkv.dtype)
    return (q * c + _rotate_half(q) * s).contiguous(), (k * c + _rotate_half(k) * s).contiguous(), v.contiguous()


def rope_tables(S, D, dtype=FP32, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=FP64) / D)
    emb = torch.outer(torch.arange(S, dtype=FP64), inv).repeat(1, 2)  # cat(freqs, freqs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ---- cases: inputs (leaves), the op, and its plain-torch twin ----------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def rms_case(dtype, wdtype=None, device="cpu", shape=(2, 7, 48), seed=0):
    g = gen(seed)
    x = torch.randn(shape, generator=g).to(device, dtype) * 3
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, wdtype or dtype)
    return (dict(x=x, w=w), (lambda t: (rms_norm(t["x"], t["w"]),)), (lambda t: (plain_rms_norm(t["x"], t["w"]),)),
            _rms_dx_scale)


def _rms_dx_scale(ref_in, dref):
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w: a projection that cancels when x has few
    columns (for N = 1 it is exactly eps-sized), so rounding is set by the terms, of size rstd * |g|."""
    x, w = ref_in["x"].detach(), ref_in["w"].detach()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return {"dx": (rstd * dref[0] * w).abs().max().item()}


def swiglu_case(dtype, variant, device="cpu", shape=(2, 7, 40), seed=0):
    g = gen(seed)
    gate, up = (torch.randn(shape, generator=g) * 4 for _ in range(2))  # |.| > 7 happens: both clamps act
    gate.view(-1)[:3] = torch.tensor([7.0, -7.0, 8.0])  # the clamp boundaries, where the gradient passes
    up.view(-1)[:3] = torch.tensor([7.0, -7.0, -8.0])
    # .clone() makes them non-leaf activations, so the in-place backward path is the one exercised
    op = lambda t: (swiglu(t["gate"].clone(), t["up"].clone(), variant),)  # noqa: E731
    return (dict(gate=gate.to(device, dtype), up=up.to(device, dtype)), op,
            lambda t: (plain_swiglu(t["gate"], t["up"], variant),), None)


def rope_case(dtype, device="cpu", B=2, S=7, H=6, KV=2, D=8, seed=0):
    cos, sin = (t.to(device) for t in rope_tables(S, D))
    qkv = torch.randn(B, S, (H + 2 * KV) * D, generator=gen(seed)).to(device, dtype)
    return (dict(qkv=qkv), lambda t: rope_qkv(t["qkv"], cos, sin, H, KV),
            lambda t: plain_rope_qkv(t["qkv"], cos, sin, H, KV), None)


def _err(a, ref):
    return (a.double() - ref).abs().max().item() if a.numel() else 0.0


def check_accuracy(inputs, op, plain, term_scale=None, path=contextlib.nullcontext(), seed=1):
    """Forward outputs and gradients of every input: op vs plain, both against fp64.

    The floor's scale is the fp64 value's max magnitude, or, where term_scale names a tensor, the
    magnitude of the terms it is computed from (when those cancel, their rounding is the floor)."""
    leaf = lambda t, dt=None: t.detach().to(dt or t.dtype).requires_grad_()  # noqa: E731
    ref_in = {k: leaf(v, FP64) for k, v in inputs.items()}
    ref_out = plain(ref_in)
    g = gen(seed)
    grads = [torch.randn(o.shape, generator=g).to(o.device) for o in ref_out]
    results = {}
    for name, fn in (("op", op), ("plain", plain)):
        t_in = {k: leaf(v) for k, v in inputs.items()}
        with path if name == "op" else contextlib.nullcontext():
            out = fn(t_in)
            dout = [gr.to(o.dtype) for gr, o in zip(grads, out)]
            results[name] = (list(out), list(torch.autograd.grad(out, list(t_in.values()), dout)))
    # the reference sees the exact upstream gradients the others saw (rounded to the output dtype)
    dref = [gr.to(o.dtype).double() for gr, o in zip(grads, results["op"][0])]
    ref = list(ref_out), list(torch.autograd.grad(ref_out, list(ref_in.values()), dref))
    names = [f"out{i}" for i in range(len(ref_out))] + [f"d{k}" for k in inputs]
    scales = term_scale(ref_in, dref) if term_scale else {}
    for name, o, p, r in zip(names, sum(results["op"], []), sum(results["plain"], []), sum(ref, [])):
        assert o.dtype == p.dtype or name.startswith("out"), (name, o.dtype, p.dtype)
        e_op, e_plain = _err(o, r), _err(p, r)
        floor = torch.finfo(o.dtype).eps * scales.get(name, r.abs().max().item())
        assert e_op <= 2 * e_plain + floor, \
            f"{name}: op error {e_op:.3g} > 2 x plain {e_plain:.3g} + floor {floor:.3g}"
    return results
