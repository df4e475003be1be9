"""Probe: host-bound steps run back to back, step by step, with the GPU's clock and power beside them.

    PYTHONPATH=. python3 scripts/probe_host_regime.py --out $OUT/host_regime.json

Why (issue 5, session 12): in session12's rows, several host-bound efficient steps ran at the model's time
for their first steps and then ~35% slower for the rest of the row (train32 B2 S4096: five steps at
11.0-11.9 ms, then 14.0-17.9 ms; train29, train30 and the seed B4 S1024 alike), while others ran flat or got
faster (train15: 11.6 -> 8.7 ms). Whether the host or the GPU's clock moved decides what a model can do.
Per row: 40 unmarked steps (CUDA events around each, the host's wall time per step), with no sampler, with
nvidia-smi sampling the SM clock, power and utilization every 1 s, and every 20 ms (each sample stamped so it
can be matched to its step): a first run with the 20 ms sampler alone slowed these steps 1.3-1.7x.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import probe_common
import torch

from anatomy.config import ModelConfig, Run
from anatomy.measure.memory import setup_step
from anatomy.models import autocast_ctx

ROWS = {  # config, batch, seq: session12's host-bound rows
    "train32": (dict(name="train32", hidden=1024, layers=2, heads=8, kv_heads=4, intermediate=3328, vocab=16000), 2, 4096),
    "seed": ("seed", 4, 1024),
    "train15": (dict(name="train15", hidden=1024, layers=2, heads=16, kv_heads=16, intermediate=2560, vocab=16000), 8, 1024),
    "tiny-gqa": (dict(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640, vocab=5000), 4, 512),
}


def sampler(period_ms: int):
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu",
                             "--format=csv,noheader,nounits", "-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)


def one_row(cfg, B: int, S: int, steps: int, period_ms: int | None) -> dict:
    cfg = ModelConfig.from_name(cfg) if isinstance(cfg, str) else ModelConfig(**cfg)
    run = Run(B, S, "amp")
    model, ids, targets, opt = setup_step(cfg, run, "efficient", "adamw", "cuda")

    def step():
        with autocast_ctx(run, "cuda"):
            loss = model(ids, targets)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    p = sampler(period_ms) if period_ms else None
    time.sleep(0.3)
    wall = []
    ev[0].record()
    for i in range(steps):
        t0 = time.time()
        step()
        ev[i + 1].record()
        wall.append((t0, time.time()))
    torch.cuda.synchronize()
    time.sleep(0.1)
    samples = []
    if p is not None:
        p.terminate()
    for line in (p.communicate()[0] if p is not None else "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4:
            try:
                samples.append((parts[0], float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                pass
    ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]
    return dict(step_ms=ms, host_wall=wall, samples=samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_host_regime: error: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    out = {}
    for rep in range(2):  # each row with no sampler, nvidia-smi every 1 s, every 20 ms; twice, interleaved
        for period in (None, 1000, 20):
            for name, (cfg, B, S) in ROWS.items():
                key = f"{name} smi={period or 'off'} rep{rep}"
                out[key] = one_row(cfg, B, S, a.steps, period)
                torch.cuda.empty_cache()  # the row's model and optimizer went with one_row's frame
                ms = out[key]["step_ms"]
                med = sorted(ms)[len(ms) // 2]
                print(f"{key}: median {med:.1f} ms, steps {min(ms):.1f}-{max(ms):.1f} ms, "
                      f"first 5 {[round(x, 1) for x in ms[:5]]}, last 5 {[round(x, 1) for x in ms[-5:]]}", flush=True)
    probe_common.write_json("probe_host_regime", a.out, rows=out)


if __name__ == "__main__":
    main()
