"""Probe: CUDA memory at each phase of a training step, for both variants (measurement only).

    python3 -m scripts.probe_memory > memory.json                 # the four named cases
    python3 -m scripts.probe_memory --hypothesis 32 --seed 2026 \\
        --out $OUT/probe_memory_hypothesis.json                                  # + 32 drawn GPU configs
    python3 -m scripts.probe_memory --recompute mlp ...             # efficient, Run.recompute="mlp"
    python3 -m scripts.probe_memory --lean ...                      # efficient, its lean block

Each row also holds `trace`: the same phase figures from the allocator trace's live bytes (requested
sizes), without the slack of reused unsplit blocks that max_memory_allocated counts; and each phase
the allocator's own requested_bytes counters, from the same run as its allocated figures. The header
records the allocator settings (PYTORCH_CUDA_ALLOC_CONF): run it once as it is and once with
expandable_segments:True, under which the allocator splits every block it reuses.
The drawn configs come from validations.configs.gpu_configs/gpu_runs with a fixed seed; each row
records the config it ran, so the comparison (validations/test_memory_model.py) reads the rows and
never re-draws. With --out the JSON is rewritten after every row: a run cut short keeps its rows.
"""
import sys

from scripts import probe_common
import torch

from llm_anatomy.config import ModelConfig, PRESETS, Run
from llm_anatomy.measure.memory import allocator_conf, measure_phases, splits_every_block, trace_phases

CASES = [("seed", PRESETS["seed"], Run(4, 1024)),
         ("seed", PRESETS["seed"], Run(2, 4096)),
         ("tiny-gqa", ModelConfig(name="tiny-gqa", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=640,
                                  vocab=5000), Run(4, 512)),
         ("anchor-1b", PRESETS["anchor-1b"], Run(1, 2048))]


def main() -> int:
    a = probe_common.parse("probe_memory")
    if not torch.cuda.is_available():
        print("probe_memory: error: needs a CUDA GPU (it reads the CUDA caching allocator); this machine has none",
              file=sys.stderr)
        return 2
    both = ("baseline", "efficient")
    cases = [] if a.skip_named else [(n, c, r, both, opt) for n, c, r in CASES for opt in ("adamw", None)]
    cases += [(n, c, r, both, None) for n, c, r in probe_common.drawn(a.hypothesis, a.seed, a.strategy)]
    if a.lean and a.recompute != "none":
        print("probe_memory: error: --lean is the block without recompute: drop --recompute or --lean", file=sys.stderr)
        return 2
    if a.recompute != "none" or a.lean:  # options of the efficient variant
        cases = [(n, c, Run(r.batch, r.seq, r.dtype, a.recompute, lean=a.lean), ("efficient",), o)
                 for n, c, r, _, o in cases]
    # Process-level allocations (the cuBLAS/cuBLASLt workspaces, about 64 MiB on the H200) are made by
    # a process's first matmuls and stay: one throwaway step of each variant makes them before any
    # row is measured, so that the first row measures its step alone, like every other row.
    warm = ModelConfig(name="warm-up", hidden=256, layers=1, heads=4, intermediate=512, vocab=1000)
    for variant in both:
        measure_phases(warm, Run(1, 256), variant, "adamw")
    return probe_common.run_rows(
        "probe_memory", a, cases,
        lambda cfg, run, variant, opt: dict(phases=measure_phases(cfg, run, variant, opt),
                                            trace=trace_phases(cfg, run, variant, opt)),
        lambda row: f"peak {max(p['peak'] for p in row['phases']) / 2**20:,.1f} MiB "
                    f"(requested {max(p['requested_peak'] for p in row['phases']) / 2**20:,.1f} MiB)",
        alloc_conf=allocator_conf(), splits_every_block=splits_every_block())


if __name__ == "__main__":
    sys.exit(main())
