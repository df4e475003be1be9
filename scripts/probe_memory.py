"""Probe: CUDA memory at each phase of a training step, for both variants (measurement only).

    PYTHONPATH=. python3 scripts/probe_memory.py > memory.json                 # the four named cases
    PYTHONPATH=. python3 scripts/probe_memory.py --hypothesis 32 --seed 2026 \\
        --out $OUT/probe_memory_hypothesis.json                                  # + 32 drawn GPU configs

Each row also holds `trace`: the same phase figures from the allocator trace's live bytes (requested
sizes), without the slack of reused unsplit blocks that max_memory_allocated counts.
The drawn configs come from validations.configs.gpu_configs/gpu_runs with a fixed seed; each row
records the config it ran, so the comparison (validations/test_memory_model.py) reads the rows and
never re-draws. With --out the JSON is rewritten after every row: a run cut short keeps its rows.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from anatomy.config import ModelConfig, PRESETS, Run
from anatomy.measure.memory import measure_phases, trace_phases

CASES = [("seed", PRESETS["seed"], Run(4, 1024)),
         ("seed", PRESETS["seed"], Run(2, 4096)),
         ("tiny-gqa", ModelConfig(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640,
                                  vocab=5000), Run(4, 512)),
         ("anchor-1b", PRESETS["anchor-1b"], Run(1, 2048))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypothesis", type=int, default=0, help="also this many drawn GPU configs (no optimizer)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--skip-named", action="store_true")
    ap.add_argument("--out", help="write the JSON here after every row (default: stdout at the end)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_memory: error: needs a CUDA GPU (it reads the CUDA caching allocator); this machine has none",
              file=sys.stderr)
        return 2
    cases = [] if a.skip_named else [(n, c, r, opt) for n, c, r in CASES for opt in ("adamw", None)]
    if a.hypothesis:
        from hypothesis import strategies as st

        from validations.configs import draw_examples, gpu_configs, gpu_runs

        cases += [(f"hyp{i}", c, r, None) for i, (c, r) in
                  enumerate(draw_examples(st.tuples(gpu_configs(), gpu_runs()), a.hypothesis, a.seed))]
    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda,
                command="PYTHONPATH=. python3 scripts/probe_memory.py " + " ".join(sys.argv[1:]),
                seed=a.seed, rows=[])
    # Process-level allocations (the cuBLAS/cuBLASLt workspaces, about 64 MiB on the H200) are made by
    # a process's first matmuls and stay: one throwaway step of each variant makes them before any
    # row is measured, so that the first row measures its step alone, like every other row.
    warm = ModelConfig(name="warm-up", hidden=256, layers=1, heads=4, intermediate=512, vocab=1000)
    for variant in ("baseline", "efficient"):
        measure_phases(warm, Run(1, 256), variant, "adamw")
    t0 = time.time()
    for k, (name, cfg, run, opt) in enumerate(cases):
        for variant in ("baseline", "efficient"):
            try:
                row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant, optimizer=opt,
                           phases=measure_phases(cfg, run, variant, opt),
                           trace=trace_phases(cfg, run, variant, opt))
            except torch.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant,
                           optimizer=opt, error=f"OutOfMemoryError: {e}"[:300])
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant,
                           optimizer=opt, error=f"{type(e).__name__}: {e}"[:300])
            head["rows"].append(row)
            print(f"[{k + 1}/{len(cases)} {time.time() - t0:5.0f}s] {name} B{run.batch}S{run.seq} {variant} {opt}: "
                  + ("error" if "error" in row else f"peak {max(p['peak'] for p in row['phases']) / 2**20:,.1f} MiB"),
                  file=sys.stderr, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(head, indent=1))
    if not a.out:
        print(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
