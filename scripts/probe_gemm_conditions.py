"""Probe: one GEMM shape timed three ways, with the SM clock and power read while each runs.

    PYTHONPATH=. python3 scripts/probe_gemm_conditions.py --out $OUT/gemm_conditions.json

Why: inside training steps the MLP's GEMMs ran at up to 781 TFLOP/s where a loop of the same
shape measured 560-700 (docs/timing.md, session 5). The modes:
  loop      calibrate's method: back to back, operands rotated past the L2
  in_step   calibrate_kernels.measure_gemms_in_step: each call after a copy that writes its A operand
  idle      each call after ~1 ms of an idle GPU (a sleep kernel), queued so the host never shows
Each mode then runs for ~1.5 s while `nvidia-smi` samples clocks.sm and power.draw every 20 ms.
"""
from __future__ import annotations

import argparse
import sys
import time

import probe_common
import torch

from anatomy.measure.calibrate import _median_ms, _rotating_matmul
from anatomy.measure.calibrate_kernels import measure_gemms_in_step, queued_ms

SHAPES = [(8192, 15360, 3072), (8192, 3072, 7680), (16384, 11264, 2048), (16384, 2048, 5632), (2048, 5632, 16384),
          (16384, 1024, 512), (8192, 8192, 8192)]


def _idle_ms(m, n, k):
    a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    return queued_ms(lambda: torch.matmul(a, b, out=c), lambda: torch.cuda._sleep(2_000_000), reps=10)[0]


def main() -> int:
    ap = argparse.ArgumentParser(prog="probe_gemm_conditions")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_gemm_conditions: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for m, n, k in SHAPES:
        f = 2 * m * n * k / 1e9  # GFLOP
        loop = _median_ms(_rotating_matmul(m, n, k))
        step = measure_gemms_in_step([(m, n, k)], time.monotonic() + 60)[0]["ms"]
        idle = _idle_ms(m, n, k)
        rows.append(dict(m=m, n=n, k=k, loop_tflops=f / loop, in_step_tflops=f / step, idle_tflops=f / idle))
        print(f"{m}x{n}x{k}: loop {f / loop:.0f}, in-step {f / step:.0f}, after idle {f / idle:.0f} TFLOP/s",
              file=sys.stderr)
    m, n, k = SHAPES[0]
    rot = _rotating_matmul(m, n, k)
    src = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a_, b_ = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    clocks = dict(idle=probe_common.clocks_while(lambda: torch.cuda._sleep(20_000_000))[0],
                  loop=probe_common.clocks_while(rot)[0],
                  in_step=probe_common.clocks_while(lambda: (a_.copy_(src), a_ @ b_))[0])
    print("clocks", clocks, file=sys.stderr)
    probe_common.write_json("probe_gemm_conditions", a.out, rows=rows, clocks_while=dict(shape=[m, n, k], **clocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
