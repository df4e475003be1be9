"""Time the fused kernels against plain eager torch on a CUDA GPU: python3 -m llm_anatomy.kernels.bench

Steady state: 50 calls back to back between two CUDA events after a warm-up, so the GPU queue stays
full and the figure is device time per call; the CPU time to issue one call (Python, the custom-op
and autograd machinery, the Triton launcher) is printed beside it, since where it exceeds the
device time the op is launch-bound. Bandwidth counts the bytes each fused kernel must move (read +
write of its activations); the plain-torch rows use the same byte count, so the ratio is the speed-up.
gate and up are leaves here, so the swiglu backward runs out of place (the in-place path, taken
for activations, moves the same bytes).
Shapes: bf16 activations at B*S = 32768 tokens (llama-2-7b-like widths), rope at B=8, S=4096 with
llama-3-8b heads (32 q, 8 kv, head_dim 128). Committed results: llm_anatomy/records.py (KERNELS_GPU_ONLY).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from llm_anatomy.kernels import rms_norm, rope_qkv, swiglu


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


def _row(name, impl, fn, nbytes, rows):
    from llm_anatomy.measure.calibrate_kernels import queued_ms

    dev, cpu = _steady(fn)
    gpu_ms, queued = queued_ms(fn, reps=30)
    gpu = gpu_ms * 1e-3
    rows.append(dict(op=name, impl=impl, bytes=nbytes, steady_us=dev * 1e6, cpu_issue_us=cpu * 1e6, gpu_only_us=gpu * 1e6,
                     queued=queued, steady_tbps=nbytes / dev / 1e12, gpu_only_tbps=nbytes / gpu / 1e12))
    print(f"{name:18s} {impl:6s} {dev * 1e6:8.1f} us  {nbytes / dev / 1e12:5.2f} TB/s  CPU issue {cpu * 1e6:6.1f} us"
          f"  GPU-only {gpu * 1e6:8.1f} us {nbytes / gpu / 1e12:5.2f} TB/s{'' if queued else ' (host caught up)'}")


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


SHAPES = {"wide": dict(M=32768, N=4096, I=11008, B=8, S=4096, H=32, KV=8, D=128),
          "seed": dict(M=65536, N=512, I=1024, B=16, S=4096, H=8, KV=8, D=64)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m llm_anatomy.kernels.bench")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("llm_anatomy.kernels.bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
    sh = SHAPES[a.shape]
    M, N, I = sh["M"], sh["N"], sh["I"]
    x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
    w = torch.ones(N, device=dev, dtype=bf16, requires_grad=True)

    def plain_norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf16) * w

    gate, up = (torch.randn(M, I, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    Bq, S, H, KV, D = sh["B"], sh["S"], sh["H"], sh["KV"], sh["D"]
    qkv = torch.randn(Bq, S, (H + 2 * KV) * D, device=dev, dtype=bf16, requires_grad=True)
    emb = torch.outer(torch.arange(S, device=dev).float(),
                      1 / 10000 ** (torch.arange(0, D, 2, device=dev).float() / D)).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()

    def plain_rope(t):
        q, k, v = (u.transpose(1, 2) for u in t.view(Bq, S, -1, D).split([H, KV, KV], 2))
        c, s = cos.to(bf16), sin.to(bf16)
        return (q * c + _rotate_half(q) * s).contiguous(), (k * c + _rotate_half(k) * s).contiguous(), v.contiguous()

    cases = [  # name, fused, plain, inputs to differentiate, bytes forward, bytes backward
        ("rms_norm", lambda: (rms_norm(x, w),), lambda: (plain_norm(x, w),), (x, w), 2 * M * N * 2, 3 * M * N * 2),
        ("swiglu", lambda: (swiglu(gate, up),), lambda: (F.silu(gate) * up,), (gate, up), 3 * M * I * 2, 5 * M * I * 2),
        ("rope_qkv", lambda: rope_qkv(qkv, cos, sin, H, KV), lambda: plain_rope(qkv), (qkv,), 2 * qkv.numel() * 2,
         2 * qkv.numel() * 2),
    ]
    rows = []
    for name, fused, plain, inputs, fwd_bytes, bwd_bytes in cases:
        for impl, fn in (("fused", fused), ("plain", plain)):
            _row(name + " fwd", impl, fn, fwd_bytes, rows)
            outs = fn()
            grads = [torch.randn_like(o) for o in outs]
            _row(name + " bwd", impl, lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True), bwd_bytes,
                 rows)
    if a.json:
        from pathlib import Path

        from llm_anatomy.report import write_atomic

        write_atomic(Path(a.json), json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0),
                                  torch=torch.__version__, cuda=torch.version.cuda, shape=a.shape, **sh,
                                  command="python3 -m llm_anatomy.kernels.bench " + " ".join(argv or sys.argv[1:]),
                                  rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
