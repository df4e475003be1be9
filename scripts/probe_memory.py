"""Probe: CUDA memory at each phase of a training step, for a few configs and both variants (measurement only).

PYTHONPATH=. python3 scripts/probe_memory.py > memory.json
"""
import json
import sys
import time

import torch

from anatomy.config import ModelConfig, PRESETS, Run
from anatomy.measure.memory import measure_phases
from anatomy.measure.run import measure_saved

CASES = [("seed", PRESETS["seed"], Run(4, 1024)),
         ("seed", PRESETS["seed"], Run(2, 4096)),
         ("tiny-gqa", ModelConfig(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640,
                                  vocab=5000), Run(4, 512)),
         ("anchor-1b", PRESETS["anchor-1b"], Run(1, 2048))]

rows = []
for name, cfg, run in CASES:
    for variant in ("baseline", "efficient"):
        for opt in ("adamw", None):
            try:
                ph = measure_phases(cfg, run, variant, opt)
                saved = measure_saved(cfg, run, variant, "cuda").report
                row = dict(config=name, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant, optimizer=opt,
                           phases=ph, saved_storage=saved.storage_bytes(), saved_by_component=saved.by_component(),
                           params=sum(p.numel() for p in torch.nn.Module.parameters(
                               __import__("anatomy.models", fromlist=["x"]).build_model(cfg, variant, device="meta"))))
            except Exception as e:
                row = dict(config=name, variant=variant, optimizer=opt, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("cfg",)}), file=sys.stderr, flush=True)
print(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0),
                      torch=torch.__version__, cuda=torch.version.cuda,
                      command="PYTHONPATH=. python3 scripts/probe_memory.py", rows=rows), indent=1))
