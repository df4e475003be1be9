"""How steady is calibrate's figure for Liger's loop (calibrate_host.measure_liger_host) within one process?

Up to session 14, calibrate timed Liger's fused linear CE, as the model calls it, at 1 and 16 chunks of tiny rows
and took the difference over the gap as the host's cost per chunk: one block of 20 calls each, about a second. Over
sessions 12b-14 that figure read 156-313 µs while the host's per-op figure moved 8.6-11.7 µs. This probe runs
the measurement `--blocks` times in one process, alternating with calibrate's tiny host step (the host's speed
then) and with a four-count version (1, 8, 16, 32 chunks: the least-squares slope), and writes every block:

    PYTHONPATH=. python3 scripts/probe_liger_host.py --out $OUT/liger_host.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import probe_common

TWO, FOUR = (256, 4096), (256, 2048, 4096, 8192)  # ceil(V / 256) = 1 and 16; 1, 8, 16 and 32 chunks of 128 tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_liger_host")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_liger_host: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from anatomy.measure.calibrate_host import HostStep, measure_liger_host

    hs, rows, t0 = HostStep(), [], time.perf_counter()
    for i in range(a.blocks):
        row = dict(block=i, t_s=time.perf_counter() - t0, host_step_ms=hs.reference("efficient", 1, 8))
        row["two"] = measure_liger_host(vocabs=TWO)
        row["four"] = measure_liger_host(vocabs=FOUR)
        rows.append(row)
        print(f"[{i + 1}/{a.blocks}] host step {row['host_step_ms']:.2f} ms, chunk {row['two']['chunk']:.0f} us "
              f"(1 and 16), {row['four']['chunk']:.0f} us (1-32)", flush=True)
    for k in ("two", "four"):
        xs = [r[k]["chunk"] for r in rows]
        print(f"{k}: chunk {min(xs):.0f}-{max(xs):.0f} us, median {statistics.median(xs):.0f}")
    probe_common.write_json("probe_liger_host", a.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
