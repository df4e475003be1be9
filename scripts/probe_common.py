"""What scripts/probe_memory.py and scripts/probe_timing.py share: the command line, the drawn
configs, the JSON header, and a loop that records each (config, variant) row, or what failed, and
rewrites --out after every row so that a run cut short keeps what it measured."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def parse(prog: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--hypothesis", type=int, default=0, help="also this many drawn GPU configs")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--strategy", choices=("gpu", "training"), default="gpu",
                    help="the drawn configs: small GPU configs (gpu_configs) or training-sized ones (training_configs)")
    ap.add_argument("--skip-named", action="store_true")
    ap.add_argument("--out", help="write the JSON here after every row (default: stdout at the end)")
    ap.add_argument("--recompute", choices=("none", "mlp", "full"), default="none",
                    help="probe_memory: the efficient variant alone, under this Run.recompute")
    ap.add_argument("--lean", action="store_true", help="probe_memory: the efficient variant alone, its lean block "
                    "(Run.lean)")
    return ap.parse_args(argv)


def drawn(n: int, seed: int, strategy: str = "gpu") -> list[tuple]:
    """(name, cfg, run) of n configs drawn with a fixed seed (validations.configs: gpu_configs/gpu_runs,
    or training_configs/training_runs): the rows record the config they ran, so a comparison reads
    them and never re-draws."""
    if not n:
        return []
    from hypothesis import strategies as st

    from validations import configs as c

    cfgs, runs = (c.gpu_configs, c.gpu_runs) if strategy == "gpu" else (c.training_configs, c.training_runs)
    prefix = "hyp" if strategy == "gpu" else "train"
    return [(f"{prefix}{i}", cfg, run) for i, (cfg, run) in enumerate(c.draw_examples(st.tuples(cfgs(), runs()), n,
                                                                                        seed))]


def run_rows(prog: str, a: argparse.Namespace, cases: list[tuple], measure: Callable[[object, object, str, object],
             dict], summary: Callable[[dict], str], second: Callable | None = None, between: Callable | None = None,
             **header) -> int:
    """cases: (name, cfg, run, variants, optimizer). measure(cfg, run, variant, optimizer) -> the row's fields.
    second (same arguments): more fields, measured for every row only after `measure` has run for all of
    them (probe_timing: the profiler's pass, which leaves the process slower, comes last). between() -> fields
    for the header, measured after the first pass and before the second."""
    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda, **header,
                command=f"python3 -m scripts.{prog} " + " ".join(sys.argv[1:]), seed=a.seed, rows=[])
    t0, done = time.time(), []
    for k, (name, cfg, run, variants, opt) in enumerate(cases):
        for variant in variants:
            row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant, optimizer=opt,
                       **({} if run.recompute == "none" else dict(recompute=run.recompute)),
                       **(dict(loss_impl=run.loss_impl) if variant == "efficient" else {}),
                       **(dict(lean=True) if run.lean else {}))
            try:
                row.update(measure(cfg, run, variant, opt))
            except Exception as e:  # noqa: BLE001 - a probe records what failed (an OOM too) and goes on
                torch.cuda.empty_cache()
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            head["rows"].append(row)
            done.append((row, cfg, run, variant, opt))
            print(f"[{k + 1}/{len(cases)} {time.time() - t0:5.0f}s] {name} B{run.batch}S{run.seq} {variant} {opt}: "
                  + (row["error"][:120] if "error" in row else summary(row)), file=sys.stderr, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(head, indent=1))
    if between is not None:
        head.update(between())
    for k, (row, cfg, run, variant, opt) in enumerate(done if second else ()):
        if "error" in row:
            continue
        try:
            row.update(second(cfg, run, variant, opt))
        except Exception as e:  # noqa: BLE001
            torch.cuda.empty_cache()
            row["error"] = f"second pass: {type(e).__name__}: {e}"[:300]
        print(f"[pass 2 {k + 1}/{len(done)} {time.time() - t0:5.0f}s] {row['config']} {variant}", file=sys.stderr, flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(head, indent=1))
    if not a.out:
        print(json.dumps(head, indent=1))
    return 0


def write_json(prog: str, out: str | None, **fields) -> None:
    """A one-shot probe's result: the GPU, torch and CUDA versions, the date and the exact command, then
    `fields`; written to `out` (or printed)."""
    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda, command=f"python3 -m scripts.{prog} " + " ".join(sys.argv[1:]),
                **fields)
    text = json.dumps(head, indent=1)
    if out:
        Path(out).write_text(text)
    else:
        print(text)


def events_ms(fn, reps: int = 10, before=None) -> float:
    """Median CUDA-event ms of fn() over `reps` calls, each after before() (untimed) where given."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def clocks_while(fn, seconds: float = 1.5, last=None) -> tuple[dict, object]:
    """({sm_mhz, power_w, samples}, last()): medians of what nvidia-smi sampled every 20 ms while fn()
    repeated for `seconds` (each call synchronized; the first quarter dropped: the clock settling), and
    what last() returned when run right after, before sampling stops (None without it)."""
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "-lms", "20"], stdout=subprocess.PIPE, text=True)
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        fn()
        torch.cuda.synchronize()
    result = last() if last is not None else None
    p.terminate()
    rows = [[float(v) for v in line.split(",")] for line in p.communicate()[0].splitlines() if line.count(",") == 1]
    rows = rows[len(rows) // 4:]
    return (dict(sm_mhz=statistics.median(r[0] for r in rows), power_w=statistics.median(r[1] for r in rows),
                 samples=len(rows)) if rows else {}), result
