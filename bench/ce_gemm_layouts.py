"""Exploration (not a claim): the fused CE's three GEMMs in each operand layout cuBLAS can be handed, timed
alone at T 16,384, H 2,048 and vocab 32,000 / 128,256, against the 8192^3 bf16 ceiling in the same process.

python3 -m bench.ce_gemm_layouts --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(fn, reps: int = 20) -> float:
    """Median ms of `reps` CUDA-event timings of fn, after 3 untimed calls."""
    for _ in range(3):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    a = p.parse_args()
    dev, bf = "cuda", torch.bfloat16
    n = 8192
    m1, m2 = torch.randn(n, n, device=dev, dtype=bf), torch.randn(n, n, device=dev, dtype=bf)
    ceil = 2 * n ** 3 / (timed(lambda: m1 @ m2) / 1e3)
    rows = []
    T, H = 16384, 2048
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for V, C in ((32000, 16384), (128256, 4096), (128256, 8192)):
            x = torch.randn(T, H, device=dev, dtype=bf)
            w = torch.randn(V, H, device=dev, dtype=bf) * 0.02
            wt = w.t().contiguous()  # (H, V)
            xc = x[:C]
            lc = torch.randn(C, V, device=dev, dtype=bf) * 1e-3
            lct = lc.t().contiguous()  # (V, C)
            gx = torch.empty(C, H, device=dev, dtype=bf)
            gw = torch.zeros(V, H, device=dev, dtype=torch.float32)
            gwt = torch.zeros(H, V, device=dev, dtype=torch.float32)
            flops = 2 * C * H * V
            cases = {
                "logits x@w.t()": lambda: torch.mm(xc, w.t(), out=lc),
                "logits x@wt": lambda: torch.mm(xc, wt, out=lc),
                "logitsT w@x.t()": lambda: torch.mm(w, xc.t(), out=lct),
                "grad_x g@w": lambda: torch.mm(lc, w, out=gx),
                "grad_x g@wt.t()": lambda: torch.mm(lc, wt.t(), out=gx),
                "grad_w mm g.t()@x fp32": lambda: torch.mm(lc.t(), xc, out_dtype=torch.float32, out=gw),
                "grad_w addmm g.t()@x fp32": lambda: torch.addmm(gw, lc.t(), xc, out_dtype=torch.float32, out=gw),
                "grad_wT addmm x.t()@g fp32": lambda: torch.addmm(gwt, xc.t(), lc, out_dtype=torch.float32, out=gwt),
                "grad_w addmm gT@x fp32 (gT contiguous)": lambda: torch.addmm(gw, lct, xc, out_dtype=torch.float32,
                                                                              out=gw),
                "grad_w mm g.t()@x bf16": lambda: torch.mm(lc.t(), xc),
            }
            for name, fn in cases.items():
                try:
                    ms = timed(fn)
                    rows.append({"lib": lib, "V": V, "C": C, "case": name, "ms": ms,
                                 "frac": flops / (ms / 1e3) / ceil})
                    print(f"{lib:8s} V{V:6d} C{C:5d} {name:42s} {ms:7.3f} ms {rows[-1]['frac']:.3f}", flush=True)
                except Exception as e:  # noqa: BLE001  (an exploration: record what fails)
                    print(lib, V, C, name, "failed:", str(e).splitlines()[0], flush=True)
            cases.clear()  # the closures hold this shape's tensors: release them before the next
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_tflop_s": ceil / 1e12,
           "rows": rows}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
