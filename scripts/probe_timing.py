"""Probe: GPU time of each component, per phase, of a training step, for both variants (measurement only).

    python3 -m scripts.probe_timing --out $OUT/probe_timing.json              # the named cases
    python3 -m scripts.probe_timing --skip-named --hypothesis 32 --seed 2026 \\
        --out $OUT/probe_timing_hypothesis.json                                            # 32 drawn configs
    python3 -m scripts.probe_timing --user-loop --real-depth 30 --presets --calibrate \\
        --out $OUT/user_loop.json          # the user's own loop on real-depth models (scripts/user_loop.py)

Each row holds llm_anatomy.measure.timeline.component_times (CUDA events at every component change,
median of 6 steps after 2 warm-up steps, plus 6-24 unmarked steps, each kept, with calibrate's tiny
host step timed right before and after them: host_ref_ms), `kernels`: the GPU kernel time per
phase and component from a torch.profiler trace of 2 more marked steps (timeline.kernel_times: what
the kernels ran for, without the host's gaps), and the config it ran, so the
comparison (validations/test_timing_probe.py) reads the rows and never re-draws. With --out the
JSON is rewritten after every row: a run cut short keeps its rows.
"""
import sys

from scripts import probe_common
import torch

from llm_anatomy.config import ModelConfig, PRESETS, Run
from llm_anatomy.measure.timeline import component_times, kernel_times

BOTH, EFF = ("baseline", "efficient"), ("efficient",)
# unmarked steps per row: as many as fit in this at the marked steps' median, 6 to 24. Their median is the
# row's step time: a short host-bound row's single steps spread by up to 1.6x, so it gets more of them; a long
# GPU-bound row keeps 6
PLAIN_BUDGET_MS = 300
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
    if sys.argv[1:2] == ["--user-loop"]:  # a plain training loop on real-depth models: scripts/user_loop.py
        from scripts import user_loop

        return user_loop.main(sys.argv[2:])
    a = probe_common.parse("probe_timing")
    if not torch.cuda.is_available():
        print("probe_timing: error: needs a CUDA GPU (it times kernels with CUDA events); this machine has none",
              file=sys.stderr)
        return 2
    import triton

    cases = [] if a.skip_named else [(n, c, r, v, "adamw") for n, c, r, v in CASES]
    cases += [(n, c, r, BOTH, "adamw") for n, c, r in probe_common.drawn(a.hypothesis, a.seed, a.strategy)]
    # Every row's steps are timed before the first torch.profiler session (the `second` pass): the profiler
    # leaves CUPTI attached when it ends (pytorch/pytorch#144455), and every kernel launch after it costs the
    # host more. calibrate's tiny host step is timed in this process, before and after the rows' timed pass
    # (host_step_before, _after), and beside each row (host_ref_ms: its tiny step of the row's variant, right
    # before and right after the row's unmarked steps): the host's speed moves between processes and within
    # one, so the comparison reads the host's speed where the row ran. A measurement only: nothing here reads
    # the calculator.
    from llm_anatomy.measure.calibrate_host import HostStep, measure_host_step

    before, ref = measure_host_step(), HostStep()

    def measure(cfg, run, variant, opt):
        return dict(timeline=component_times(cfg, run, variant, opt, plain_budget_ms=PLAIN_BUDGET_MS,
                                             reference=lambda: ref.reference(variant, blocks=2, steps=6)))

    def between():
        ref.close()
        return dict(host_step_after=measure_host_step())

    return probe_common.run_rows("probe_timing", a, cases, measure, lambda row: _summary(row["timeline"]),
                                 second=lambda cfg, run, variant, opt: dict(kernels=kernel_times(cfg, run, variant, opt)),
                                 between=between, triton=triton.__version__, host_step_before=before,
                                 plain_budget_ms=PLAIN_BUDGET_MS)

if __name__ == "__main__":
    sys.exit(main())
