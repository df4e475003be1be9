"""Every committed data file that code, tests and the README read, by what it is.

Nothing else under reports/ is tracked; a run's full output stays on the machine that made it, and
docs/history.md says how each record was made. Paths are absolute here (so tests and `anatomy
report` work from any directory); `rel()` turns one into the repo-relative form that is printed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
H200 = REPORTS / "h200"

# The packaged H200 profile (`anatomy calibrate` on a fresh H200): what `--gpu h200-measured` predicts with.
H200_PROFILE = ROOT / "llm_anatomy" / "calculator" / "profiles" / "h200.json"

# Claims reports written by the suite (`pytest --claims-report`): the CPU run and the GPU-marked run.
CPU_CLAIMS = REPORTS / "cpu" / "claims.json"
GPU_CLAIMS = H200 / "claims-gpu.json"

# scripts/probe_memory.py: phase memory of named and drawn configs, both variants, under two allocator
# settings; and under Run.recompute="mlp" (efficient only).
MEMORY_PROBE = {
    "expandable segments": (H200 / "memory-probe" / "named.json", H200 / "memory-probe" / "drawn.json"),
    "default allocator": (H200 / "memory-probe" / "named-default-allocator.json",
                          H200 / "memory-probe" / "drawn-default-allocator.json"),
}
MEMORY_PROBE_RECOMPUTE = (H200 / "memory-probe" / "recompute-named.json",
                          H200 / "memory-probe" / "recompute-drawn.json",
                          H200 / "memory-probe" / "recompute-drawn-training.json")
# and the efficient model's lean block (Run.lean), expandable segments: named and drawn training-sized configs
MEMORY_PROBE_LEAN = (H200 / "memory-probe" / "lean-named.json", H200 / "memory-probe" / "lean-drawn-training.json")

# scripts/probe_timing.py: unmarked steps and per-component intervals, with the profile calibrated in the same
# run (TIMING_PROBE_PROFILE), which their claims are judged against.
TIMING_PROBE_PROFILE = H200 / "timing-probe" / "profile.json"
TIMING_PROBE = {"named": H200 / "timing-probe" / "named.json",
                "drawn, training-sized": H200 / "timing-probe" / "drawn-training.json",
                "drawn, small": H200 / "timing-probe" / "drawn-small.json"}

# bench/step.py: one peer per process, forward + backward, median of 10 steps. Five runs, each its own
# folder (compare peers only within one): the first run with the baseline peers; the seed step on a second
# machine 18 minutes later; the seed step profiled (bench/profile_step.py) with the efficient steps of its run;
# efficient with and without recompute; the peers table (efficient, efficient with the lean block (Run.lean),
# HF + Liger, HF + compile at the seed and two real configs; scripts/gpu_records.sh's "peers" part, its machine
# in PEERS_ENV).
STEPS = {name: H200 / "steps" / name for name in ("peers", "first-run", "second-machine", "profiled", "recompute",
                                                  "power")}
PEERS_ENV = STEPS["peers"] / "env.json"  # scripts/env_json.py, same run: cuDNN, Triton and driver versions
# bench/profile_step.py on the peers' machine, the call after theirs (gpu_records.sh "profile-peers"): the lean
# step and HF + Liger's by kernel family at the two real configs
PEERS_PROFILES = {cfg: tuple(STEPS["peers"] / f"profile-{cfg}-{peer}.json" for peer in ("efficient-lean", "hf-liger"))
                  for cfg in ("tinyllama-1.1b", "llama3.2-1b")}
# bench/step_power.py (gpu_records.sh "power-peers"): the same two steps back to back, with clock, power, energy
PEERS_POWER = {cfg: tuple(STEPS["power"] / f"power-{cfg}-{peer}.json" for peer in ("efficient-lean", "hf-liger"))
               for cfg in ("tinyllama-1.1b", "llama3.2-1b")}
PEERS_POWER_ENV = STEPS["power"] / "env.json"  # scripts/env_json.py, same run
# (record, variant) of every step record of our own models, uncompiled (the other records are peers'): the
# memory and timing claims against the committed steps both read this one list
OWN_STEPS = tuple((STEPS[run] / f"step-{name}.json", "baseline" if "baseline" in name else "efficient")
                  for run, names in (("first-run", ("seed-efficient", "1b-efficient", "seed-baseline")),
                                     ("second-machine", ("seed-efficient",)),
                                     ("profiled", ("seed-efficient", "1b-efficient")),
                                     ("recompute", ("seed-efficient", "seed-efficient-recompute", "anchor-1b-efficient",
                                                    "anchor-1b-efficient-recompute")),
                                     ("peers", tuple(f"{c}-efficient{lean}" for c in ("seed", "tinyllama-1.1b",
                                                                                      "llama3.2-1b")
                                                     for lean in ("", "-lean"))))
                  for name in names)
STEP_PROFILE = STEPS["profiled"] / "profile-seed-efficient.json"  # bench/profile_step.py, same run as "profiled"

# bench/loss_memory.py (scripts/gpu_records.sh's "loss-memory" part): the efficient step's phases with our fused
# linear CE, and the loss op alone, at the seed and two real configs; measurements only.
LOSS_MEMORY = tuple(H200 / "loss-memory" / f"loss-memory-{n}.json" for n in ("seed", "tinyllama", "llama3.2"))

# bench/kernel_rates.py (back to back, against peers) and llm_anatomy.kernels.bench (GPU-only, behind a sleep kernel).
KERNELS_BACK_TO_BACK = H200 / "kernels" / "back-to-back-seed.json"
KERNELS_GPU_ONLY = H200 / "kernels" / "gpu-only-seed.json"
OPTIMIZER_STEPS = H200 / "kernels" / "optimizer-steps.json"  # pytest-benchmark JSON of validations/test_optim.py
LINEAR_CE = H200 / "kernels" / "linear-ce.json"  # bench/linear_ce.py: ours against Liger's, forward + backward

# scripts/probe_timing.py --user-loop --real-depth 30 --presets --calibrate: the user's own loop on real-depth
# models drawn out of sample (validations/real_depth.py), one freshly started H200 per folder, each beside the
# profile `anatomy calibrate` measured first in the same run (calibrated.json) and the machine's env.json.
REAL_DEPTH_RUNS = tuple(H200 / "user-loop" / f"machine-{i}" / "real-depth.json" for i in (1, 2, 3))

# scripts/check_plan.py: `anatomy plan --gpu H200`'s micro-batch and the next one, run in a user's loop.
PLAN_CHECK = H200 / "plan" / "check.json"

# scripts/gate_check.sh's runs (the regression gate's own check), one entry per machine: scripts/gate_check_record.py.
GATE_CHECK = H200 / "gate" / "check.json"
BASELINE = ROOT / "baselines.json"  # the regression gate's baseline (docs/benchmarks.md); GATE_CHECK names its sha256

# `anatomy train` on the seed config, baseline and efficient, from the same weights and data.
LOSS_CURVES = H200 / "training" / "loss-curves-seed.json"
LOSS_CURVES_ENV = H200 / "training" / "env.json"


def step_records(run: str) -> list[Path]:
    """The step records of one bench/step.py run (a STEPS key), sorted by name."""
    return sorted(STEPS[run].glob("step-*.json"))


def rel(path: Path) -> str:
    """A path as printed: relative to the repo root, never this machine's absolute path."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return Path(path).name


def command(cmd: str | None) -> str:
    """A recorded command as printed: each absolute path (the recording machine's output folder) becomes
    `out/` and its file name, so a reader can paste it as it stands."""
    import re

    return re.sub(r"(?<![\w.])/[^\s`'\"]*/([^\s/`'\"]+)", r"out/\1", cmd or "")


def sha256(path: Path) -> str:
    """A file's SHA-256, hex: which baseline a gate run compared against (GATE_CHECK's baseline_sha256)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
