"""Fused-kernel benchmark on the GPU: each kernel's fwd+bwd time against its minimal bytes (or FLOPs),
next to the copy-bandwidth and matmul ceilings measured in the same process, and next to peers
(Liger's kernels, torch.compile of the unfused code).

python3 -m bench.kernel_rates [--preset seed --batch 16 --seq 4096] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from llm_anatomy.config import ConfigError, ModelConfig
from llm_anatomy.io import write_atomic

BF16 = torch.bfloat16


def _ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.randn(1 << 30, device="cuda", dtype=BF16)  # 2 GiB, far past the 60 MB L2
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (_ms(lambda: y.copy_(x)) / 1e3)


def matmul_ceiling() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=BF16) for _ in range(2))
    return 2 * 8192 ** 3 / (_ms(lambda: a @ b) / 1e3)


def fwd_bwd(fn, *inputs):
    """A closure running fn forward and backward with a fixed random upstream gradient."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]

    def run():
        o = fn(*leaves)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)
    return run


def rms_norm_unfused(x, w, eps=1e-5):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def main(argv=None):
    from llm_anatomy.baseline.transformer import rope_tables
    from llm_anatomy.efficient.loss import linear_ce
    from llm_anatomy.kernels import rms_norm, rope_qkv, swiglu

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="seed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--json")
    a = p.parse_args(argv)
    try:
        cfg = ModelConfig.from_name(a.preset)
    except ConfigError as e:
        p.error(str(e))  # one line, exit 2
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    B, S, H, I, V, hd = a.batch, a.seq, cfg.hidden, cfg.intermediate, cfg.vocab, cfg.head_dim
    T, D = B * S, (cfg.heads + 2 * cfg.kv_heads) * hd
    bw, mm = copy_bandwidth(), matmul_ceiling()
    x, w = torch.randn(T, H, device="cuda", dtype=BF16), torch.ones(H, device="cuda", dtype=BF16)
    g, u = (torch.randn(T, I, device="cuda", dtype=BF16) for _ in range(2))
    qkv = torch.randn(B, S, D, device="cuda", dtype=BF16)
    cos, sin = rope_tables(S, hd, cfg.rope_theta, "cuda", torch.float32)
    tgt = torch.randint(0, V, (T,), device="cuda")
    W = torch.randn(V, H, device="cuda", dtype=BF16) * 0.02

    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    rows = []

    def add(kernel, impl, ms, bytes_=None, flops=None):
        r = dict(kernel=kernel, impl=impl, ms=ms)
        if bytes_:
            r.update(bytes=bytes_, tb_s=bytes_ / (ms / 1e3) / 1e12, frac_copy=bytes_ / (ms / 1e3) / bw)
        if flops:
            r.update(flops=flops, tflop_s=flops / (ms / 1e3) / 1e12, frac_matmul=flops / (ms / 1e3) / mm)
        rows.append(r)
        print(f"{kernel:10s} {impl:16s} {ms:8.3f} ms  " + (f"{r['tb_s']:5.2f} TB/s ({r['frac_copy']:.0%} of copy)"
              if bytes_ else f"{r['tflop_s']:6.1f} TFLOP/s ({r['frac_matmul']:.0%} of matmul)"), flush=True)

    norm_bytes = (2 + 2) * T * H + (2 + 2 + 2) * T * H  # fwd: read x, write y; bwd: read dy, x, write dx
    add("rms_norm", "ours", _ms(fwd_bwd(lambda x, w: rms_norm(x, w, 1e-5), x, w)), norm_bytes)
    add("rms_norm", "liger", _ms(fwd_bwd(lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5), x, w)), norm_bytes)
    add("rms_norm", "torch.compile", _ms(fwd_bwd(torch.compile(rms_norm_unfused), x, w)), norm_bytes)
    add("rms_norm", "unfused", _ms(fwd_bwd(rms_norm_unfused, x, w)), norm_bytes)
    glu_bytes = 2 * T * I * (2 + 1 + 3 + 2)  # fwd: read g, u, write h; bwd: read dh, g, u, write dg, du
    for variant in ("swiglu", "gpt-oss"):
        add(f"{variant}", "ours", _ms(fwd_bwd(lambda g, u: swiglu(g, u, variant), g, u)), glu_bytes)
    add("swiglu", "liger", _ms(fwd_bwd(LigerSiLUMulFunction.apply, g, u)), glu_bytes)
    add("swiglu", "torch.compile", _ms(fwd_bwd(torch.compile(lambda g, u: F.silu(g) * u), g, u)), glu_bytes)
    rope_bytes = 2 * T * D * 4  # fwd: read qkv, write q, k, v; bwd: read dq, dk, dv, write dqkv
    add("rope_qkv", "ours", _ms(fwd_bwd(lambda t: rope_qkv(t, cos, sin, cfg.heads, cfg.kv_heads), qkv)), rope_bytes)
    ce_flops = 6 * T * H * V  # logits, grad_input, grad_weight
    add("linear_ce", "liger", _ms(fwd_bwd(lambda x, W: linear_ce(x, W, tgt), x, W)), flops=ce_flops)
    res = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), preset=a.preset, batch=B, seq=S,
               copy_tb_s=bw / 1e12, matmul_tflop_s=mm / 1e12, rows=rows,
               command="python3 -m bench.kernel_rates " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    if a.json:
        write_atomic(a.json, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
