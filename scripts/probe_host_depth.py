"""How does a host-bound step's host time grow with depth and with Liger's chunk count? (issue 5)

The calculator's host model is per-op figures times one factor (timing.host_scale), fitted on
calibrate's tiny 2-layer step. The seed's B4 S1024 efficient row (6 layers, 32 chunks, host-bound) ran
+5..+23% over its prediction in all four session-10 runs while the 2-layer host-bound rows held: so
either the per-layer share or the per-chunk share of that factor is off. This probe times, in one
process with the conditions interleaved block by block, the probe's unmarked steps
(timeline._plain_steps) of calibrate's tiny model at 1, 2, 4 and 8 layers (8 Liger chunks), at 2 layers
with 1 and 32 chunks (vocab 256 and 8192), and the seed at B4 S1024 with 2 and 6 layers, both variants;
and calibrate's own Liger per-chunk figure (calibrate_host.measure_liger_host) between blocks, to see
how much that one figure moves in one process. The comparison with the calculator is made offline
(docs/timing.md), against the profile calibrate wrote in the same run.

  PYTHONPATH=. python3 scripts/probe_host_depth.py --out reports/h200/<session>/host_depth.json
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, replace
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import write_json  # noqa: E402

from anatomy.config import ModelConfig, Run  # noqa: E402
from anatomy.measure.calibrate_host import HOST_STEP, HostStep, measure_liger_host  # noqa: E402
from anatomy.measure.memory import setup_step  # noqa: E402
from anatomy.measure.timeline import _Clock, _plain_steps  # noqa: E402

TINY = ModelConfig(**HOST_STEP["cfg"])
SEED = ModelConfig(name="seed", hidden=512, layers=6, heads=8, kv_heads=8, intermediate=1024, vocab=16000)
TINY_RUN = (HOST_STEP["batch"], HOST_STEP["seq"])
CONDITIONS = ([(replace(TINY, name=f"tiny-L{n}", layers=n), *TINY_RUN) for n in (1, 2, 4, 8)]
              + [(replace(TINY, name=f"tiny-L2-V{v}", vocab=v), *TINY_RUN) for v in (256, 8192)]
              + [(replace(SEED, name=f"seed-L{n}", layers=n), 4, 1024) for n in (2, 6)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_host_depth: error: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    setups = []
    for cfg, b, s in CONDITIONS:
        run = Run(b, s, "amp")
        for variant in ("baseline", "efficient"):
            model, ids, targets, opt = setup_step(cfg, run, variant, "adamw", "cuda")
            _plain_steps(model, ids, targets, opt, run, 3, _Clock("cuda"), "cuda")
            setups.append((cfg, run, variant, model, ids, targets, opt, []))
    ref, refs, liger = HostStep(), {"baseline": [], "efficient": []}, []
    clock = _Clock("cuda")
    for blk in range(a.blocks):
        for variant in refs:
            refs[variant].append(ref.reference(variant, blocks=1, steps=8))
        for cfg, run, variant, model, ids, targets, opt, fb in setups:
            torch.cuda.synchronize()
            stamps = _plain_steps(model, ids, targets, opt, run, a.steps, clock, "cuda")
            clock.sync()
            fb.extend(clock.ms(t0, t1) for t0, t1, _ in stamps)
        liger.append(measure_liger_host(reps=12))
        print(f"block {blk}: ref {refs['efficient'][-1]:.2f} ms, liger chunk {liger[-1]['chunk']:.0f} us", flush=True)
    rows = []
    for cfg, run, variant, *_, fb in setups:
        rows.append(dict(config=cfg.name, cfg=asdict(cfg), batch=run.batch, seq=run.seq, variant=variant,
                         median_ms=statistics.median(fb), steps_ms=fb))
        print(f"{cfg.name:12s} B{run.batch}S{run.seq} {variant:9s} median {rows[-1]['median_ms']:.2f} ms", flush=True)
    write_json("probe_host_depth", str(a.out), host_ref_ms=refs, liger=liger, rows=rows)


if __name__ == "__main__":
    main()
