"""Tune: the rms_norm Triton kernels' tile (rows per tile), warps and pipeline stages per row width.

    PYTHONPATH=. python3 scripts/tune_rms_norm.py --out $OUT/tune_rms_norm.json

Launches anatomy/kernels/rmsnorm.py's kernels directly (as the launchers do, with the programs the
launcher would use: the backward's dw partials, and so the calculator's transient, do not change)
and times each setting on the GPU alone (calibrate_kernels.queued_ms), x fp32 and y / dy bf16 as
under amp, at 65,536 rows (the seed step) and 16,384. Prints the best setting per width.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import probe_common
import torch
import triton

from anatomy.kernels._dispatch import reduction_programs
from anatomy.kernels.rmsnorm import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel
from anatomy.measure.calibrate_kernels import queued_ms


def main() -> int:
    ap = argparse.ArgumentParser(prog="tune_rms_norm")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_rms_norm: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for M, N in itertools.product((65536, 16384), (512, 1024, 2048, 4096)):
        block = triton.next_power_of_2(N)
        x = torch.randn(M, N, device="cuda")
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(N, device="cuda") + 0.5
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty_like(x)
        programs = reduction_programs(x.device, M, N)
        per = triton.cdiv(M, programs)
        programs = triton.cdiv(M, per)
        dwp = torch.empty(programs, N, device="cuda")
        for bm, warps in itertools.product((1, 2, 4, 8), (4, 8)):
            if bm * block > 16384:
                continue
            ms, _ = queued_ms(lambda: _rms_norm_fwd_kernel[(triton.cdiv(M, bm),)](
                x, w, y, x.stride(0), y.stride(0), M, N, 1e-5, BLOCK_M=bm, BLOCK_N=block, num_warps=warps))
            rows.append(dict(kernel="fwd", M=M, N=N, block_m=bm, warps=warps, stages=0, ms=ms,
                             tbps=M * N * 6 / (ms * 1e-3) / 1e12))
            for stages in (1, 3):
                ms, _ = queued_ms(lambda: _rms_norm_bwd_kernel[(programs,)](
                    dy, x, w, dx, dwp, dy.stride(0), x.stride(0), dx.stride(0), M, N, 1e-5, per, NUM_STAGES=stages,
                    BLOCK_M=bm, BLOCK_N=block, num_warps=warps))
                rows.append(dict(kernel="bwd", M=M, N=N, block_m=bm, warps=warps, stages=stages, ms=ms,
                                 tbps=M * N * 10 / (ms * 1e-3) / 1e12))
        for kern in ("fwd", "bwd"):
            best = max((r for r in rows if r["kernel"] == kern and r["M"] == M and r["N"] == N), key=lambda r: r["tbps"])
            print(f"{kern} M={M} N={N}: best block_m {best['block_m']} warps {best['warps']} stages {best['stages']}: "
                  f"{best['tbps']:.2f} TB/s", file=sys.stderr)
    probe_common.write_json("tune_rms_norm", a.out, triton=triton.__version__, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
