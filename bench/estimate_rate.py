"""How many full estimates with time the calculator answers per second, in process: memory phases, the
time model and the fit verdict, as `anatomy estimate --gpu h200-measured` and each `anatomy plan`
candidate call (cli_estimate.estimate_all). Pure Python, no GPU.

python3 -m bench.estimate_rate [--preset llama3-8b] [--gpu h200-measured] [--batch 1 --batches 1 --seq 4096]
                               [--repeats 5 --seconds 0.5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from llm_anatomy.config import ConfigError, ModelConfig, Run

CASES = (("efficient", "none"), ("efficient", "mlp"), ("efficient", "full"), ("baseline", "none"))


def rate(fn, seconds: float) -> tuple[float, float]:
    """(calls per second of wall time, calls per second of this process's CPU time) of fn(i), i = 0, 1, ...,
    over at least `seconds` of wall time, after one warm-up call. The CPU-time rate is what a shared,
    loaded machine moves least."""
    fn(0)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (dt := time.perf_counter() - t0) < seconds:
        n += 1
        fn(n)
    return n / dt, n / max(time.process_time() - c0, 1e-9)


def measure(cfg: ModelConfig, run: Run, variant: str, gpu: str, optimizer: str, repeats: int,
            seconds: float, batches: int = 1) -> dict:
    from llm_anatomy.cli_estimate import estimate_all

    # call i asks for micro-batch run.batch + i % batches: with batches > 1, consecutive calls are new Runs (as
    # `anatomy plan`'s candidates are), and with many, more than any cache of per-shape figures keeps
    new = lambda i: replace(run, batch=run.batch + i % batches)  # noqa: E731
    wall, cpu = zip(*(rate(lambda i: estimate_all(cfg, new(i), variant, optimizer=optimizer, gpu=gpu), seconds)
                      for _ in range(repeats)))
    return dict(variant=variant, recompute=run.recompute, optimizer=optimizer, per_s=statistics.median(wall),
                min_per_s=min(wall), max_per_s=max(wall), cpu_per_s=statistics.median(cpu), repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b", help="model preset (default: llama3-8b, 32 layers)")
    ap.add_argument("--gpu", default="h200-measured", help="GPU profile (default: h200-measured)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (default: 1)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    ap.add_argument("--batches", type=int, default=1,
                    help="cycle the micro-batch over --batch .. --batch + N - 1, a new Run each call (default: 1)")
    ap.add_argument("--optimizer", default="adamw", help="adamw or ademamix (default: adamw)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported (default: 5)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per repeat (default: 0.5)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    a = ap.parse_args(argv)
    if min(a.batches, a.repeats) < 1 or not a.seconds > 0:
        print("error: --batches and --repeats must be at least 1, --seconds above 0", file=sys.stderr)
        return 2
    try:
        cfg = ModelConfig.from_name(a.preset)
        rows = [measure(cfg, Run(batch=a.batch, seq=a.seq, recompute=rc), v, a.gpu, a.optimizer, a.repeats,
                        a.seconds, a.batches) for v, rc in CASES]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(dict(preset=a.preset, layers=cfg.layers, gpu=a.gpu, batch=a.batch, batches=a.batches, seq=a.seq,
                              rows=rows),
                         indent=1))
    else:
        bs = f"B={a.batch}" if a.batches == 1 else f"B={a.batch}..{a.batch + a.batches - 1}"
        print(f"{a.preset} ({cfg.layers} layers), {bs} S={a.seq}, --gpu {a.gpu}, {a.optimizer}")
        for r in rows:
            print(f"  {r['variant']:9s} recompute {r['recompute']:4s}: {r['per_s']:8.0f} estimates/s "
                  f"(min {r['min_per_s']:.0f}, max {r['max_per_s']:.0f}; per CPU second {r['cpu_per_s']:.0f}; "
                  f"median of {r['repeats']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
