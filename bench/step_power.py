"""One peer's training step run back to back, as a training loop runs it, with the SM clock and board power
sampled by nvidia-smi every 20 ms: the sustained step time, the clock and power it settles at, and the energy
per step (a record, not a prediction; README "power-peers", docs/peers.md).

Why. A step of a 1B model draws the board's power limit (700 W on an H200) the whole time, so the power
controller sets its SM clock, and a peer's time is its energy per step over the limit: a step with less
memory-bound time draws more power per millisecond and runs its GEMMs and attention at a lower clock.

python3 -m bench.step_power --peer efficient --lean --preset tinyllama-1.1b --batch 8 --seq 2048
    [--steps 40] [--json OUT]
Samples from the half second before the loop and the loop's first half second are dropped (the clock falls
from its burst value within about 0.1 s: docs/timing.md, sustained_tau_s)."""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llm_anatomy.config import ConfigError, ModelConfig, Run

from bench.step import loop_step

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.sw_power_cap"
PERIOD_MS = 20


def smi(query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [c.strip() for c in out.splitlines()[0].split(",")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True, help="a bench/step.py peer: efficient, hf-liger, ...")
    p.add_argument("--preset", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--lean", action="store_true", help="the efficient peer's lean block (Run.lean)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json")
    a = p.parse_args()
    if a.lean and not a.peer.startswith("efficient"):
        p.error(f"--lean applies to the efficient peers, not {a.peer}")
    try:
        cfg, run = ModelConfig.from_name(a.preset), Run(a.batch, a.seq, "amp", lean=a.lean)
    except ConfigError as e:
        p.error(str(e))
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        p.error("needs a CUDA GPU and nvidia-smi")
    limit_w, max_mhz, driver = smi("power.limit,clocks.max.sm,driver_version")
    one = loop_step(a.peer, cfg, run)

    for _ in range(5):
        one()
    torch.cuda.synchronize()
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                "-lms", str(PERIOD_MS)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.steps):
        one()
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    rows = [[c.strip() for c in line.split(",")] for line in sampler.communicate()[0].strip().splitlines()]
    rows = rows[1000 // PERIOD_MS:-2]  # the loop after its first half second, to its end
    if len(rows) < 50:
        p.exit(2, f"step_power: {len(rows)} clock samples in the loop, under 50; raise --steps\n")
    clock, power = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    step_ms = start.elapsed_time(end) / a.steps
    res = dict(peer=a.peer + ("-lean" if run.lean else ""), preset=a.preset, batch=run.batch, seq=run.seq,
               steps=a.steps, step_ms=step_ms, samples=len(rows), sm_clock_mhz=statistics.median(clock),
               sm_clock_mhz_range=[min(clock), max(clock)], power_w=statistics.median(power),
               energy_j_per_step=statistics.mean(power) * step_ms / 1e3,
               power_cap_share=sum(r[3] == "Active" for r in rows) / len(rows),
               temp_c_max=max(float(r[2]) for r in rows),
               power_limit_w=float(limit_w), max_sm_clock_mhz=float(max_mhz), driver=driver,
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               command="python3 -m bench.step_power " + " ".join(sys.argv[1:]))
    print(f"{res['peer']:16s} {a.preset:16s} {step_ms:8.2f} ms/step  {res['sm_clock_mhz']:.0f} MHz  "
          f"{res['power_w']:.0f} W  {res['energy_j_per_step']:.1f} J/step  "
          f"at the power cap {res['power_cap_share']:.0%}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
