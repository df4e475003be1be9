"""Probe: does a GEMM's rate depend on the operand layout, as the calibrate grid (A @ B, both
row-major) and the model (x @ W.t(), g @ W, g.t() @ x) differ? Measurement only; JSON to stdout.

    PYTHONPATH=. python3 scripts/probe_gemm_layouts.py > gemm_layouts.json
"""
import json
import sys
import time

import torch

from anatomy.measure.calibrate import _median_ms

SHAPES = [(8192, 8192, 8192), (16384, 11264, 2048), (16384, 2048, 5632), (16384, 2048, 2048), (8192, 10240, 2048),
          (8192, 2048, 5120)]  # (m, n, k): tokens x out x in for the forward


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_gemm_layouts: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    bf = dict(device="cuda", dtype=torch.bfloat16)
    rows = []
    for m, n, k in SHAPES:
        a, b = torch.randn(m, k, **bf), torch.randn(k, n, **bf)  # row-major A (m, k), B (k, n): calibrate's grid
        w = torch.randn(n, k, **bf)  # a weight (out, in): the model's forward is x @ w.t()
        g = torch.randn(m, n, **bf)  # an output gradient
        cases = {"NN a@b (calibrate)": lambda a=a, b=b: a @ b, "x@w.t() (forward)": lambda a=a, w=w: a @ w.t(),
                 "g@w (grad_input)": lambda g=g, w=w: g @ w, "g.t()@x (grad_weight)": lambda g=g, a=a: g.t() @ a}
        for name, fn in cases.items():
            ms = _median_ms(fn)
            flops = 2 * m * n * k
            rows.append(dict(m=m, n=n, k=k, layout=name, ms=ms, tflops=flops / (ms * 1e-3) / 1e12))
            print(f"{m}x{n}x{k} {name}: {rows[-1]['tflops']:.0f} TFLOP/s", file=sys.stderr)
        del a, b, w, g, cases
    print(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0),
                          torch=torch.__version__, cuda=torch.version.cuda,
                          command="PYTHONPATH=. python3 scripts/probe_gemm_layouts.py", rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
