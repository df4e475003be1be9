"""Probe: each kernel class's own sustained load, its settled SM clock and board power (measurement only).

    python3 -m scripts.probe_power --out $OUT/power.json [--max-s 6] [--idle-s 3]

The timing model's sustained regime (docs/timing.md) slows a long step's compute by the clock that
calibrate's GEMM warm-up settles at, whatever the step runs. The power controller lowers the clock only while
the board draws its limit, so a step whose kernels draw less keeps more of its boost clock. This probe
measures what each class draws on its own. After --idle-s of idle, it runs each class back to back until the
rate settles, or for --max-s: calibrate_sustained's GEMM, causal SDPA forward + backward, and device copy
(_cases), plus a launch-bound load of small elementwise kernels. For each class it records:
  - the first chunk's rate and clock (the burst);
  - the rate, SM clock and board power over the last second (settled);
  - whether the clock fell (throttled: more than THROTTLE_MHZ under the GPU's maximum);
  - the trace.
It also records the idle power before each load and the power limit. The JSON is written after every class.
Exit 2 without a CUDA GPU or with a bad argument.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

THROTTLE_MHZ = 15  # a settled clock this far under the maximum is the power controller's, not boost jitter
SMALL_NUMEL = 1 << 14  # the launch-bound load: an add of 16k elements, ~2 us of fixed cost per kernel


def summary(trace: list[dict], settle_s: float = 1.0) -> dict:
    """First chunk and the last settle_s of a settle() trace: rate, clock and power, medians."""
    def med(rows, key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    last = [r for r in trace if r["t_s"] >= trace[-1]["t_s"] - settle_s]
    return dict(burst_rate=trace[0]["rate"], burst_clock_MHz=trace[0]["clock_MHz"],
                rate=med(last, "rate"), clock_MHz=med(last, "clock_MHz"), power_W=med(last, "power_W"),
                seconds=trace[-1]["t_s"])


def _loads():
    """{class: (fn, work per call, unit name)}: calibrate_sustained's three and the launch-bound one."""
    import torch

    from llm_anatomy.measure.calibrate_sustained import _cases

    loads = {cls: (fn, work, "FLOP" if cls != "memory" else "B") for cls, (fn, work, _) in _cases().items()}
    a = torch.randn(SMALL_NUMEL, device="cuda")
    loads["launch"] = (lambda: a.add_(1.0), 1, "kernel")
    return loads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_power.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-s", type=float, default=6.0, help="longest sustained load per class (s)")
    ap.add_argument("--idle-s", type=float, default=3.0, help="idle before each load (s)")
    a = ap.parse_args(argv)
    if not (a.max_s > 0 and a.idle_s >= 0):
        print("probe_power: error: --max-s must be > 0 and --idle-s >= 0", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("probe_power: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    from llm_anatomy.measure.calibrate_sustained import nvml_reader, settle

    env = subprocess.run([sys.executable, "-m", "scripts.env_json"], cwd=ROOT, capture_output=True, text=True)
    read, limits, source = nvml_reader()
    doc = dict(env=json.loads(env.stdout) if env.returncode == 0 else None, limits=limits, reader=source,
               command="scripts/probe_power.py " + " ".join(argv or sys.argv[1:]), throttle_MHz=THROTTLE_MHZ,
               classes={})
    top = limits.get("max_clock_MHz")
    for cls, (fn, work, unit) in _loads().items():
        fn()
        torch.cuda.synchronize()
        time.sleep(a.idle_s)
        idle_clock, idle_power = read()
        chunk = 10 if cls != "launch" else 2000  # 2,000 small kernels: a chunk of a few ms, as the others
        trace, settled = settle(fn, work, read, a.max_s, min_s=min(3.0, a.max_s), chunk=chunk)
        row = dict(summary(trace), unit=unit, settled=settled, idle_W=idle_power, idle_clock_MHz=idle_clock,
                   trace=trace)
        row["throttled"] = (top is not None and row["clock_MHz"] is not None and row["clock_MHz"] < top - THROTTLE_MHZ)
        doc["classes"][cls] = row
        print(f"{cls:9s} settled {row['clock_MHz']} MHz at {row['power_W']} W (idle {idle_power} W), "
              f"rate {row['rate']:.4g} {unit}/s, burst {row['burst_rate']:.4g} at {row['burst_clock_MHz']} MHz, "
              f"{'throttled' if row['throttled'] else 'at boost'}, {row['seconds']:.1f} s", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    getattr(read, "close", lambda: None)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
