"""Probe: cuDNN SDPA (and one GEMM) timed as calibrate times it and in the GPU's sustained, power-capped state.

    PYTHONPATH=. python3 scripts/probe_sdpa_power.py --out $OUT/sdpa_power.json

Why (issue 5, session 11): in session11c's anchor-1b row, at calibrate's own SDPA shape (B4, 16 heads,
S 4096, hd 128), the profiled SDPA kernels ran 1.11x (forward) and 1.14x (backward) calibrate's time, while
the seed's (B16, 8 heads, hd 64, also calibrate's shape) ran 0.97-1.02x. Calibrate times SDPA in short bursts
(calibrate._median_ms: 5 x 5 calls) after other work; a training step of anchor-1b keeps the GPU busy with
large GEMMs for 190 ms. The conditions, per shape:
  burst      calibrate's method, after 0.5 s of an idle GPU
  sustained  the same call repeated for 1.5 s (nvidia-smi sampling the SM clock and power), then timed
  after_gemm each call right after ~4 ms of 8192^3 GEMMs
"""
from __future__ import annotations

import argparse
import sys
import time

import probe_common
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from anatomy.measure.calibrate import _median_ms

SHAPES = ((16, 8, 4096, 64), (4, 16, 4096, 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_sdpa_power: error: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty_like(big)

    def gemms():
        for _ in range(4):
            torch.matmul(big, big, out=sink)

    cases = []
    for B, nh, S, hd in SHAPES:
        q, k, v = (torch.randn(B, nh, S, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(B, nh, S, hd, device="cuda", dtype=torch.bfloat16)

        def fwd(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fb(q=q, k=k, v=v, g=g, fwd=fwd):
            return torch.autograd.grad(fwd(), (q, k, v), g)
        cases += [(f"sdpa B{B} h{nh} S{S} hd{hd} fwd", fwd), (f"sdpa B{B} h{nh} S{S} hd{hd} fwd+bwd", fb)]
    x, w = (torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16),
            torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16))
    cases.append(("gemm 16384x6144x2048", lambda: x @ w))
    rows = []
    for name, fn in cases:
        torch.cuda.synchronize()
        time.sleep(0.5)
        burst = _median_ms(fn, batches=5, per_batch=5)
        clocks, sustained = probe_common.clocks_while(lambda fn=fn: [fn() for _ in range(4)], 1.5,
                                                      last=lambda fn=fn: probe_common.events_ms(fn))
        after = probe_common.events_ms(fn, before=gemms)
        rows.append(dict(case=name, burst_ms=burst, sustained_ms=sustained, after_gemm_ms=after, sustained_clocks=clocks))
        print(f"{name:32s} burst {burst:.4f} sustained {sustained:.4f} ({sustained / burst:.2f}x, {clocks}) "
              f"after GEMMs {after:.4f} ({after / burst:.2f}x)", flush=True)
    probe_common.write_json("probe_sdpa_power", a.out, rows=rows)


if __name__ == "__main__":
    main()
