"""How reproducible is a host-bound training step, and what moves it? (issue 5's step misses)

The same host-bound step measured 55.2, 32.2 and 43.1 ms in three H200 runs (seed B4S1024, efficient;
sessions 8, 8b, 8c), on three machines. This probe times such steps the way
scripts/probe_timing.py does (timeline._plain_steps: CUDA events around forward + backward, AdamW
after), in blocks, rotating the conditions block by block so that a drift of the machine falls on
all of them alike:
  * threads: the process on every CPU, or pinned (all its threads) to two;
  * gc: Python's cyclic collector on, or off (gc.freeze() of what exists, then gc.disable()).
Per condition: every block's median and every step, so the spread within and between blocks shows.
With --profiler the conditions are instead "before" and "after" one torch.profiler session of two
steps in the same process (as timeline.kernel_times runs), all threads, gc on: the profiler leaves
CUPTI attached when it ends (pytorch/pytorch#144455), which probe_timing and calibrate used to do
between their host-sensitive timings.

  PYTHONPATH=. python3 scripts/probe_host_noise.py --out reports/h200/<session>/host_noise.json
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import write_json  # noqa: E402

from anatomy.config import ModelConfig, Run  # noqa: E402
from anatomy.measure.memory import setup_step  # noqa: E402
from anatomy.measure.timeline import _Clock, _plain_steps  # noqa: E402

# (config, batch, seq): the seed's host-bound row, and a 2-layer model as most host-bound drawn rows are
CASES = ((ModelConfig.from_name("seed"), 4, 1024),
         (ModelConfig(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640, vocab=5000), 4, 512))


def _pin(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):  # every thread: the autograd engine's device thread runs backward
        os.sched_setaffinity(int(tid), cpus)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host_noise")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profiler", action="store_true", help="before and after a profiler session instead")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_noise: needs a CUDA GPU", file=sys.stderr)
        return 2
    every = os.sched_getaffinity(0)
    two = set(sorted(every)[2:4]) or every
    conds = [dict(threads=t, gc=g) for t, g in itertools.product(("all", "two"), ("on", "off"))]
    if a.profiler:
        conds = [dict(threads="all", gc="on", profiler=w) for w in ("before", "after")]
    rows = []
    for cfg, batch, seq in CASES[:1] if a.profiler else CASES:  # (--profiler: nothing profiled before "before")
        name, run = cfg.name, Run(batch, seq, "amp")
        model, ids, targets, opt = setup_step(cfg, run, "efficient", "adamw", "cuda")
        clock = _Clock("cuda")
        _plain_steps(model, ids, targets, opt, run, 5, clock, "cuda")  # warm-up
        per = {i: dict(blocks=[], steps=[]) for i in range(len(conds))}
        # rotating blocks; with --profiler, all "before" blocks, the session, then all "after" blocks
        order = ([(i, c) for i, c in enumerate(conds) for _ in range(a.blocks)] if a.profiler
                 else [(i, c) for _ in range(a.blocks) for i, c in enumerate(conds)])
        for i, c in order:
            if c.get("profiler") == "after" and not per[i]["blocks"]:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                    _plain_steps(model, ids, targets, opt, run, 2, clock, "cuda")
                    clock.sync()
            _pin(every if c["threads"] == "all" else two)
            if c["gc"] == "off":
                gc.collect()
                gc.freeze()
                gc.disable()
            stamps = _plain_steps(model, ids, targets, opt, run, a.steps, clock, "cuda")
            clock.sync()
            gc.enable()
            gc.unfreeze()
            ms = [clock.ms(s, m) for s, m, _ in stamps]  # forward + backward, as the probe's plain steps
            per[i]["blocks"].append(statistics.median(ms))
            per[i]["steps"].extend(ms)
        _pin(every)
        for i, c in enumerate(conds):
            b, s = per[i]["blocks"], sorted(per[i]["steps"])
            rows.append(dict(config=name, batch=batch, seq=seq, **c, cpus=len(every) if c["threads"] == "all" else len(two),
                             median_ms=statistics.median(s), p10_ms=s[len(s) // 10], p90_ms=s[9 * len(s) // 10],
                             block_medians_ms=b, steps_ms=per[i]["steps"]))
            print(f"{name} B{batch}S{seq} threads={c['threads']:3s} gc={c['gc']:3s} {c.get('profiler', '')}: median {rows[-1]['median_ms']:.1f} ms, "
                  f"p10-p90 {rows[-1]['p10_ms']:.1f}-{rows[-1]['p90_ms']:.1f}, blocks "
                  + " ".join(f"{x:.1f}" for x in b), flush=True)
        del model, opt, ids, targets
        torch.cuda.empty_cache()
    write_json("probe_host_noise", a.out, loadavg=os.getloadavg(), cpus=len(every), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
