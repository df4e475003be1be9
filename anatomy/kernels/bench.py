"""Time the fused kernels against plain eager torch on a CUDA GPU: python3 -m anatomy.kernels.bench

Steady state: 50 calls back to back between two CUDA events after a warm-up, so the GPU queue stays
full and the figure is device time per call; the CPU time to issue one call (Python, the custom-op
and autograd machinery, the Triton launcher) is printed beside it, since where it exceeds the
device time the op is launch-bound. Bandwidth counts the bytes each fused kernel must move (read +
write of its activations); the plain-torch rows use the same byte count, so the ratio is the speed-up.
gate and up are leaves here, so the swiglu backward runs out of place (the in-place path, taken
for activations, moves the same bytes).
Shapes: bf16 activations at B*S = 32768 tokens (llama-2-7b-like widths), rope at B=8, S=4096 with
llama-3-8b heads (32 q, 8 kv, head_dim 128). Results and environment: BENCH.md beside this file.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from anatomy.kernels import rms_norm, rope_qkv, swiglu


def _steady(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    cpu = (time.perf_counter() - t0) / n
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e-3, cpu  # seconds per call: device, CPU issue


def _row(name, impl, fn, nbytes):
    dev, cpu = _steady(fn)
    print(f"{name:18s} {impl:6s} {dev * 1e6:8.1f} us  {nbytes / dev / 1e12:5.2f} TB/s  CPU issue {cpu * 1e6:6.1f} us")


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def main():
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
    M, N, I = 32768, 4096, 11008
    x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
    w = torch.ones(N, device=dev, dtype=bf16, requires_grad=True)

    def plain_norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf16) * w

    gate, up = (torch.randn(M, I, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    S, H, KV, D = 4096, 32, 8, 128
    qkv = torch.randn(8, S, (H + 2 * KV) * D, device=dev, dtype=bf16, requires_grad=True)
    emb = torch.outer(torch.arange(S, device=dev).float(),
                      1 / 10000 ** (torch.arange(0, D, 2, device=dev).float() / D)).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()

    def plain_rope(t):
        q, k, v = (u.transpose(1, 2) for u in t.view(8, S, -1, D).split([H, KV, KV], 2))
        c, s = cos.to(bf16), sin.to(bf16)
        return (q * c + _rotate_half(q) * s).contiguous(), (k * c + _rotate_half(k) * s).contiguous(), v.contiguous()

    cases = [  # name, fused, plain, inputs to differentiate, bytes forward, bytes backward
        ("rmsnorm", lambda: (rms_norm(x, w),), lambda: (plain_norm(x, w),), (x, w), 2 * M * N * 2, 3 * M * N * 2),
        ("swiglu", lambda: (swiglu(gate, up),), lambda: (F.silu(gate) * up,), (gate, up), 3 * M * I * 2, 5 * M * I * 2),
        ("rope_qkv", lambda: rope_qkv(qkv, cos, sin, H, KV), lambda: plain_rope(qkv), (qkv,), 2 * qkv.numel() * 2,
         2 * qkv.numel() * 2),
    ]
    for name, fused, plain, inputs, fwd_bytes, bwd_bytes in cases:
        for impl, fn in (("fused", fused), ("plain", plain)):
            _row(name + " fwd", impl, fn, fwd_bytes)
            outs = fn()
            grads = [torch.randn_like(o) for o in outs]
            _row(name + " bwd", impl, lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True), bwd_bytes)


if __name__ == "__main__":
    main()
