"""Where one training step's GPU time goes: torch.profiler over a few steps of one peer.

python3 -m bench.profile_step --peer efficient --preset seed --batch 16 --seq 4096 --json OUT.json [--trace T.json.gz]
                              [--lean]

Writes, per step: wall time (CUDA events), GPU busy time (the union of kernel intervals, so that idle
gaps where the GPU waits for the host show up as wall - busy), every kernel name with its count
and device time, grouped into families by name (GEMM, attention, Triton, elementwise, reduction,
copy), and where the GPU idles (idle_gaps_us: the gaps between kernels by the pair of kernels around
them). The peers and the step are bench/step.py's; nothing here reads the calculator.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.step import loop_step

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.io import write_atomic

FAMILIES = (("attention", r"cudnn|fmha|flash|attention|sdpa"), ("gemm", r"gemm|sm90|cutlass|nvjet|xmma|gemv"),
            ("triton", r"^triton|_kernel$|liger"), ("reduction", r"reduce|sum|norm"),
            ("copy", r"copy|memcpy|memset|cat|fill"), ("elementwise", r"elementwise|vectorized|unrolled"))


def family(name: str) -> str:
    return next((f for f, rx in FAMILIES if re.search(rx, name, re.I)), "other")


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def idle_gaps(kernels: list[tuple[float, float, str]], steps: int, top: int = 12) -> list[dict]:
    """Where the GPU idles: the gaps between kernels (start, end, name; any one time unit), summed by the
    kernel that ran before the gap and the one that starts it, per step, largest first. The gap between two
    profiled steps (their sync and the next step's first launches) is one of them, once per step."""
    pairs: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    end, last = None, None
    for s, e, name in sorted(kernels):
        if end is not None and s > end:
            pairs[last, name][0] += 1
            pairs[last, name][1] += s - end
        if end is None or e > end:
            end, last = e, name
    rows = [dict(before=b, after=n, count=c / steps, idle=t / steps) for (b, n), (c, t) in pairs.items()]
    return sorted(rows, key=lambda r: -r["idle"])[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="efficient")
    p.add_argument("--preset", default="seed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("--trace")
    p.add_argument("--lean", action="store_true", help="the efficient peer's lean block (Run.lean), as bench/step.py")
    a = p.parse_args(argv)
    if a.lean and not a.peer.startswith("efficient"):
        p.error(f"--lean applies to the efficient peers, not {a.peer}")
    if not torch.cuda.is_available():
        print("profile_step: no CUDA device", file=sys.stderr)
        return 2
    try:
        cfg, run = ModelConfig.from_name(a.preset), Run(a.batch, a.seq, "amp", lean=a.lean)
    except ConfigError as e:
        p.error(str(e))  # one line, exit 2
    one = loop_step(a.peer, cfg, run)

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            one()
            e.record()
            torch.cuda.synchronize()
            walls.append(s.elapsed_time(e))
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = busy_union([(ev.time_range.start, ev.time_range.end) for ev in kernels]) / 1e3 / a.steps
    table = defaultdict(lambda: [0, 0.0])
    for ev in kernels:
        table[ev.name][0] += 1
        table[ev.name][1] += ev.device_time / 1e3
    rows = sorted(({"name": n, "family": family(n), "count": c / a.steps, "ms": t / a.steps}
                   for n, (c, t) in table.items()), key=lambda r: -r["ms"])
    fams = defaultdict(float)
    for r in rows:
        fams[r["family"]] += r["ms"]
    res = dict(peer=a.peer + ("-lean" if run.lean else ""), preset=a.preset, batch=run.batch, seq=run.seq, steps=a.steps, wall_ms=walls,
               gpu_busy_ms=busy_ms, kernel_ms=sum(r["ms"] for r in rows), kernels_per_step=len(kernels) / a.steps,
               families=dict(sorted(fams.items(), key=lambda kv: -kv[1])), kernels=rows,
               idle_gaps_us=idle_gaps([(ev.time_range.start, ev.time_range.end, ev.name) for ev in kernels], a.steps),
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               command="python3 -m bench.profile_step " + " ".join(argv if argv is not None else sys.argv[1:]))
    write_atomic(a.json, json.dumps(res, indent=1))
    if a.trace:
        prof.export_chrome_trace(a.trace)
    print(f"{a.peer} {a.preset} B{run.batch} S{run.seq}: wall {min(walls):.2f} ms, GPU busy {busy_ms:.2f} ms, "
          f"{res['kernels_per_step']:.0f} kernels/step")
    for f, ms in res["families"].items():
        print(f"  {f:12s} {ms:8.2f} ms")
    for r in rows[:25]:
        print(f"  {r['ms']:8.3f} ms  x{r['count']:5.0f}  {r['family']:11s} {r['name'][:110]}")
    print("  where the GPU idles (per step, between the kernel before and the kernel after):")
    for g in res["idle_gaps_us"][:8]:
        print(f"  {g['idle'] / 1e3:8.3f} ms  x{g['count']:5.1f}  {g['before'][:50]} -> {g['after'][:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
