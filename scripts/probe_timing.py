"""Probe: GPU time of each component, per phase, of a training step, for both variants (measurement only).

    PYTHONPATH=. python3 scripts/probe_timing.py --out $OUT/probe_timing.json              # the named cases
    PYTHONPATH=. python3 scripts/probe_timing.py --skip-named --hypothesis 32 --seed 2026 \\
        --out $OUT/probe_timing_hypothesis.json                                            # 32 drawn configs

Each row holds anatomy.measure.timeline.component_times (CUDA events at every component change,
median of 6 steps after 2 warm-up steps, plus 6 unmarked steps) and the config it ran, so the
comparison (validations/test_timing_probe.py) reads the rows and never re-draws. With --out the
JSON is rewritten after every row: a run cut short keeps its rows.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from anatomy.config import ModelConfig, PRESETS, Run
from anatomy.measure.timeline import component_times

BOTH, EFF = ("baseline", "efficient"), ("efficient",)
# anchor-1b B4S4096 baseline is left out: its eager S×S attention needs ~143 GiB at its peak
CASES = [("seed", PRESETS["seed"], Run(16, 4096), BOTH),
         ("seed", PRESETS["seed"], Run(4, 1024), BOTH),
         ("anchor-1b", PRESETS["anchor-1b"], Run(4, 4096), EFF),
         ("tiny-gqa", ModelConfig(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640,
                                  vocab=5000), Run(4, 512), BOTH),
         ("llama3.2-1b", PRESETS["llama3.2-1b"], Run(2, 2048), BOTH)]


def _summary(t: dict) -> str:
    return (f"fwd {t['phases']['forward']:.2f} bwd {t['phases']['backward']:.2f} opt {t['phases']['optimizer']:.2f} "
            f"ms; plain step {t['plain_step_ms']:.2f} ms (marked {t['step_ms']:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypothesis", type=int, default=0, help="also this many drawn GPU configs (adamw)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--skip-named", action="store_true")
    ap.add_argument("--out", help="write the JSON here after every row (default: stdout at the end)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_timing: error: needs a CUDA GPU (it times kernels with CUDA events); this machine has none",
              file=sys.stderr)
        return 2
    cases = [] if a.skip_named else list(CASES)
    if a.hypothesis:
        from hypothesis import strategies as st

        from validations.configs import draw_examples, gpu_configs, gpu_runs

        cases += [(f"hyp{i}", c, r, BOTH) for i, (c, r) in
                  enumerate(draw_examples(st.tuples(gpu_configs(), gpu_runs()), a.hypothesis, a.seed))]
    import triton

    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda, triton=triton.__version__,
                command="PYTHONPATH=. python3 scripts/probe_timing.py " + " ".join(sys.argv[1:]), seed=a.seed, rows=[])
    t0, opt = time.time(), "adamw"
    for k, (name, cfg, run, variants) in enumerate(cases):
        for variant in variants:
            row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant, optimizer=opt)
            try:
                row["timeline"] = component_times(cfg, run, variant, opt)
            except torch.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                row["error"] = f"OutOfMemoryError: {e}"[:300]
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                torch.cuda.empty_cache()
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            head["rows"].append(row)
            print(f"[{k + 1}/{len(cases)} {time.time() - t0:5.0f}s] {name} B{run.batch}S{run.seq} {variant} {opt}: "
                  + (row["error"][:120] if "error" in row else _summary(row["timeline"])), file=sys.stderr, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(head, indent=1))
    if not a.out:
        print(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
