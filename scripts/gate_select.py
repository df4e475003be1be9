"""Which benchmarks of a recorded pytest-benchmark JSON are stable enough to gate at +10% median.

    python3 scripts/gate_select.py baselines.json [--config seed-B16-S4096] [--max-iqr 0.05] [--min-median-ms 1.0]

Prints one pytest node id per line: the benchmarks of --config (the seed step's 65K tokens, where
the GPU, not the host, sets a round's time) whose recorded median is at least --min-median-ms and
whose interquartile range is at most --max-iqr of that median. The rest are host-bound: rounds that
the CPU's issue time sets, which move by up to 31% between two unmodified runs on one H200 VM, so a
10% gate on them fails on noise (docs/benchmarks.md). They are still recorded and reported, only not gated. Exit 2 with one line on a missing or unreadable file.
"""
from __future__ import annotations

import argparse
import json
import sys


def select(data: dict, config: str = "seed-B16-S4096", max_iqr: float = 0.05, min_median_s: float = 1e-3) -> list[str]:
    out = []
    for b in data.get("benchmarks", []):
        st = b["stats"]
        if f"[{config}/" in b["fullname"] and st["median"] >= min_median_s and st["iqr"] <= max_iqr * st["median"]:
            out.append(b["fullname"])
    return sorted(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline")
    p.add_argument("--config", default="seed-B16-S4096")
    p.add_argument("--max-iqr", type=float, default=0.05)
    p.add_argument("--min-median-ms", type=float, default=1.0)
    a = p.parse_args(argv)
    try:
        with open(a.baseline) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"gate_select: error: cannot read {a.baseline}: {e}", file=sys.stderr)
        return 2
    ids = select(data, a.config, a.max_iqr, a.min_median_ms / 1e3)
    if not ids:
        print(f"gate_select: error: no benchmark in {a.baseline} is stable enough to gate", file=sys.stderr)
        return 2
    print("\n".join(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
