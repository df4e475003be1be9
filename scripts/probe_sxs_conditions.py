"""Probe: the eager baseline's S x S ops timed as calibrate times them and as a training step runs them.

    PYTHONPATH=. python3 scripts/probe_sxs_conditions.py --out $OUT/sxs_conditions.json

Why (issue 5, session 11): in the drawn baseline rows, the broadcast mask add and the fp32 -> bf16 cast
of the S x S attention ran 1.35x and 1.5x the rates calibrate measured for them (train10, 65536 rows of
S = 1024, session11c), while the fp32 softmax and the bf16 -> fp32 cast matched. Calibrate times each op
queued behind a sleep kernel (calibrate_kernels.queued_ms: an idle, cool GPU). The conditions here:
  idle     calibrate's method, at its 32768 rows and at 4x that
  loaded   each rep right after ~2 ms of large GEMMs (the step's power-capped state), at both row counts
  chain    the forward chain as the model runs it (scale, mask add, float, softmax, to bf16), each op timed
           inside the chain with events, so each reads what the one before just wrote
Each row also carries the SM clock and power that nvidia-smi sampled while that condition repeated.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import probe_common
import torch
import torch.nn.functional as F

from anatomy.measure.calibrate_aten import SXS_ROWS, sxs_case
from anatomy.measure.calibrate_kernels import queued_ms

OPS = ("sxs.scale", "sxs.mask_add", "sxs.float", "sxs.softmax", "sxs.to_compute")
S = 1024


def _loaded_ms(fn, pre, reps: int = 10) -> float:
    """GPU ms of fn() with ~2 ms of 8192^3-class GEMMs queued right before each rep."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def before():
        pre()
        for _ in range(2):
            torch.matmul(a, a, out=c)
    return probe_common.events_ms(fn, reps, before)


def _chain(rows: int, reps: int = 10) -> dict:
    """Each op's GPU ms inside the forward chain, as anatomy/baseline/attention.py runs it under autocast."""
    x = torch.randn(rows // S, S, S, device="cuda", dtype=torch.bfloat16)
    bias = torch.triu(torch.full((S, S), float("-inf"), device="cuda", dtype=torch.bfloat16), 1)
    steps = (("sxs.scale", lambda t: t * 0.125), ("sxs.mask_add", lambda t: t + bias), ("sxs.float", lambda t: t.float()),
             ("sxs.softmax", lambda t: F.softmax(t, dim=-1)), ("sxs.to_compute", lambda t: t.to(torch.bfloat16)))
    ms = {op: [] for op, _ in steps}
    for _ in range(reps):
        t = x
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
        evs[0].record()
        for i, (_, f) in enumerate(steps):
            t = f(t)
            evs[i + 1].record()
        torch.cuda.synchronize()
        for i, (op, _) in enumerate(steps):
            ms[op].append(evs[i].elapsed_time(evs[i + 1]))
        del t
    return {op: statistics.median(v) for op, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_sxs_conditions: error: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    rows = []
    for n in (SXS_ROWS, 4 * SXS_ROWS):
        for op in OPS:
            pre, fn = sxs_case(op, S, n)()
            idle = queued_ms(fn, pre)[0]
            loaded = _loaded_ms(fn, pre)
            rows.append(dict(op=op, S=S, rows=n, idle_ms=idle, loaded_ms=loaded))
            print(f"{op:16s} rows {n:7d}: idle {idle:.4f} ms, loaded {loaded:.4f} ms ({loaded / idle:.2f}x)", flush=True)
            del pre, fn
            torch.cuda.empty_cache()
        chain = _chain(n)
        for r in rows[-len(OPS):]:
            r["chain_ms"] = chain[r["op"]]
            print(f"{r['op']:16s} rows {n:7d}: in chain {r['chain_ms']:.4f} ms ({r['chain_ms'] / r['idle_ms']:.2f}x idle)", flush=True)
    pre, fn = sxs_case("sxs.to_compute", S, SXS_ROWS)()
    a8 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    clocks = dict(idle=probe_common.clocks_while(lambda: (pre(), fn()), 1.0)[0],
                  loaded=probe_common.clocks_while(lambda: (torch.matmul(a8, a8), pre(), fn()), 1.0)[0])
    print("clocks [MHz, W]", clocks, flush=True)
    probe_common.write_json("probe_sxs_conditions", a.out, rows=rows, clocks_while=clocks)


if __name__ == "__main__":
    main()
