"""Probe: the kernels of small steps, timed by the profiler (GPU time alone), for the timing model's two
small-shape misses (issue 5, session 13).

    PYTHONPATH=. python3 scripts/probe_small_kernels.py --out $OUT/small_kernels.json

1. GEMMs at few tokens, in the layouts a step runs them (F.linear forward, dgrad dy @ W, wgrad dyᵀ @ x),
   each after a producer kernel that writes its activation operand: session12b's tiny-gqa MLP backward ran
   5.5 µs a GEMM against 4.2 predicted. Rows: (op, m, n, k) and the kernel time per call.
2. The fused RMSNorm backward's two kernels at few rows, with the rows per program and the partial sum's
   column block swept: below 8192 rows the dw partial sum (_sum_partials_kernel) took 30-60% of the op.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import probe_common
import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile, record_function

from anatomy.kernels._dispatch import reduction_programs
from anatomy.kernels.rmsnorm import _bwd_tile, _rms_norm_bwd_kernel, _sum_block, _sum_partials_kernel
from anatomy.measure.timeline import MARK, attribute_kernels, trace_kernels

# (hidden, intermediate, qkv out): tiny-gqa, the seed, a 2-layer hidden-1024 drawn row, llama3.2-1b-like
MODELS = ((256, 640, 384), (512, 1024, 1536), (1024, 2560, 1152), (2048, 5632, 3072))
TOKENS = (512, 2048, 4096, 8192)
RMS_ROWS = (1024, 2048, 4096, 8192, 16384)
RMS_WIDTHS = (256, 512, 1024, 2048, 4096)
PER = (1, 2, 4, 8, 16, 32, 64)
BN = (8, 16, 32, 64)


def profiled(cases, reps: int) -> dict:
    """{label: {ms per call, top}} of each (label, pre, fn): fn's kernels only (pre runs under its own mark)."""
    def mark(label):
        with record_function(MARK + label):
            pass

    def run(n, mk):
        for label, pre, fn in cases:
            for _ in range(n):
                mk("phase:forward")
                mk("producer")
                pre()
                mk(label)
                fn()
    run(3, lambda label: None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(reps, mark)
        mark("phase:end")
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    comps = attribute_kernels(*trace_kernels(trace)).get("forward", {})
    return {k: dict(ms=v["ms"] / reps, kernels=v["n"] / reps, top={n[:100]: t / reps for n, t in v["top"].items()})
            for k, v in comps.items() if k != "producer"}


def gemm_cases():
    bf = dict(device="cuda", dtype=torch.bfloat16)
    cases, meta = [], {}
    for (H, I, Q), T in ((m, t) for m in MODELS for t in TOKENS):
        for n_out, k_in in ((Q, H), (H, H), (2 * I, H), (H, I)):
            x, dy = torch.randn(T, k_in, **bf), torch.randn(T, n_out, **bf)
            W, src = torch.randn(n_out, k_in, **bf), torch.randn(T, max(k_in, n_out), **bf)
            for op, m, n, k, fn in (
                    ("fwd", T, n_out, k_in, lambda x=x, W=W: F.linear(x, W)),
                    ("dgrad", T, k_in, n_out, lambda dy=dy, W=W: dy @ W),
                    ("wgrad", n_out, k_in, T, lambda dy=dy, x=x: dy.t() @ x)):
                label = f"gemm {op} {m}x{n}x{k}"
                if label in meta:
                    continue
                a = x if op != "dgrad" else dy  # the operand the step's previous kernel wrote
                pre = (lambda a=a, src=src: a.copy_(src[:, :a.shape[1]]))
                cases.append((label, pre, fn))
                meta[label] = dict(kind="gemm", op=op, m=m, n=n, k=k)
    return cases, meta


def _row_pass(dy, x, w, dx, dwp, M, N, per):
    """The backward's row pass, launched as the launcher does, with `per` rows a program."""
    block = triton.next_power_of_2(N)
    bm, warps = _bwd_tile(block)
    return lambda: _rms_norm_bwd_kernel[(triton.cdiv(M, per),)](
        dy, x, w, dx, dwp, dy.stride(0), x.stride(0), dx.stride(0), M, N, 1e-5, per, NUM_STAGES=3, BLOCK_M=bm,
        BLOCK_N=block, num_warps=warps)


def _partial_sum(dwp, dw, N, bn, elems):
    """The dw partial sum over dwp's rows with `bn`-column blocks walking `elems`-element tiles."""
    return lambda: _sum_partials_kernel[(triton.cdiv(N, bn),)](dwp, dw, dwp.shape[0], N, BLOCK_R=elems // bn,
                                                               BLOCK_N=bn)


def rms_cases():
    cases, meta = [], {}
    for M, N in ((m, n) for m in RMS_ROWS for n in RMS_WIDTHS):
        x = torch.randn(M, N, device="cuda")
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(N, device="cuda") + 0.5
        dx, dw, src = torch.empty_like(x), torch.empty(N, device="cuda"), torch.randn(M, N, device="cuda")
        cur = triton.cdiv(M, reduction_programs(x.device, M, N))
        cur_bn = _sum_block(triton.next_power_of_2(N))  # the launcher's (session13-small ran 16-64 before it)
        for per in sorted({cur, *PER}):
            programs = triton.cdiv(M, per)
            dwp = torch.empty(programs, N, device="cuda")
            label = f"rms rows M{M} N{N} per{per}"
            cases.append((label, (lambda x=x, src=src: x.copy_(src)), _row_pass(dy, x, w, dx, dwp, M, N, per)))
            meta[label] = dict(kind="rms_rows", M=M, N=N, per=per, programs=programs, current=per == cur)
            for bn, br in ((bn, br) for bn in BN for br in (2048, 4096)):
                label = f"rms sum M{M} N{N} per{per} bn{bn} r{br}"
                cases.append((label, (lambda dwp=dwp: dwp.mul_(1.0)), _partial_sum(dwp, dw, N, bn, br)))
                meta[label] = dict(kind="rms_sum", M=M, N=N, per=per, programs=programs, bn=bn, block_elems=br,
                                   current=per == cur and bn == cur_bn and br == 4096)
            label = f"rms torchsum M{M} N{N} per{per}"
            cases.append((label, (lambda dwp=dwp: dwp.mul_(1.0)), (lambda dwp=dwp: dwp.sum(0))))
            meta[label] = dict(kind="rms_torchsum", M=M, N=N, per=per, programs=programs)
    return cases, meta


def main() -> int:
    ap = argparse.ArgumentParser(prog="probe_small_kernels")
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_small_kernels: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for build in (gemm_cases, rms_cases):
        cases, meta = build()
        got = profiled(cases, a.reps)
        rows += [dict(meta[k], label=k, **v) for k, v in got.items() if k in meta]
        print(f"{build.__name__}: {len(got)} of {len(cases)} timed", file=sys.stderr)
        del cases
        torch.cuda.empty_cache()
    probe_common.write_json("probe_small_kernels", a.out, triton=triton.__version__, reps=a.reps, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
