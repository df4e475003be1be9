"""Every committed data file that code, tests and the docs read, by what it is.

Nothing else under reports/ is tracked; a run's full output stays on the machine that made it, and
docs/history.md says how each record was made. The files live in a checkout of the repo, never beside the
installed package: ROOT is the folder set with `at()` (`anatomy report --root`, the validation suite), else
the nearest folder at or above the current directory that holds reports/. Each name below is an absolute
path under that ROOT, computed when it is read; `rel()` turns one into the repo-relative form that is printed.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# The packaged H200 profile (`anatomy calibrate` on a fresh H200): what `--gpu h200-measured` predicts with.
H200_PROFILE = PACKAGE / "calculator" / "profiles" / "h200.json"

_root: Path | None = None


class NotACheckout(ValueError):
    """A folder that is not a checkout of the repo with its reports/: the message is one line naming it."""


def checkout(path) -> Path:
    """`path`, resolved, where it holds reports/; NotACheckout otherwise."""
    p = Path(path).resolve()
    if not (p / "reports").is_dir():
        raise NotACheckout(f"{path}: not a checkout of efficient-llm-anatomy (it has no reports/ folder)")
    return p


def root() -> Path:
    """The checkout whose records are read (module doc)."""
    if _root is not None:
        return _root
    here = Path.cwd().resolve()
    return next((d for d in (here, *here.parents) if (d / "reports").is_dir()), here)


@contextlib.contextmanager
def at(path):
    """Read the records of the checkout at `path` inside the block (NotACheckout where it is none)."""
    global _root
    before, _root = _root, checkout(path)
    try:
        yield _root
    finally:
        _root = before


def use(path) -> Path:
    """Read the records of the checkout at `path` from now on (the validation suite's checkout)."""
    global _root
    _root = checkout(path)
    return _root


def _layout(root: Path) -> dict:
    """The records under `root`, by name (the names module attributes resolve to)."""
    reports = root / "reports"
    h200 = reports / "h200"
    mp, tp = h200 / "memory-probe", h200 / "timing-probe"
    # bench/step.py: one peer per process, forward + backward, median of 10 steps. Each folder is one run
    # (compare peers only within one): baseline-peers (our baseline and efficient models beside HF and Liger);
    # seed-repeat (the seed step again, on another H200); profiled (the seed step under bench/profile_step.py);
    # recompute (efficient with and without MLP recompute); peers (efficient, efficient with the lean block,
    # HF + Liger, HF + compile at the seed and two real configs; scripts/gpu_records.sh's "peers" part);
    # power (the peers' steps with clock, power and energy: bench/step_power.py); moe-peers (a training step
    # with fused AdamW of Qwen3-30B-A3B's first layers: ours beside transformers' grouped_mm and eager experts).
    steps = {name: h200 / "steps" / name for name in ("peers", "baseline-peers", "seed-repeat", "profiled",
                                                       "recompute", "power", "moe-peers")}
    real = ("tinyllama-1.1b", "llama3.2-1b")
    return dict(
        ROOT=root, REPORTS=reports, H200=h200, STEPS=steps,
        # claims reports written by the suite (`pytest --claims-report`): the CPU run (gzip -n of the JSON) and
        # the GPU-marked run
        CPU_CLAIMS=reports / "cpu" / "claims.json.gz", GPU_CLAIMS=h200 / "claims-gpu.json",
        # GPU runs of one part of the suite, each its own run (machine, date, command), read where present beside
        # the whole-suite run: the MoE live claims (validations/test_moe_live.py; moe-gptoss: its gpt-oss cases, run
        # apart, `-k "gptoss or olmoe"`; moe-bf16: gpt-oss on bf16 weights, its expert biases added after the
        # grouped GEMMs, `-k "test_moe_phase_memory_on_this_gpu and gptoss-L2-bf16"`), the mesh code paths on CUDA
        # (validations/test_mesh_cuda.py) and the real-depth live claims (validations/test_real_depth_live.py),
        # each written by `pytest FILE -m gpu --claims-report PATH`, under the folder of the GPU that ran it
        # the user's loop measured on an H100 (the rows the live claims keep beside their report): the real-depth
        # draw sized to 80 GB and the MoE cases; scripts/compare_h100.py predicts them on the derived H100 profile
        H100_STEPS=dict(dense=reports / "h100" / "real-depth-live.json", moe=reports / "h100" / "moe-live.json"),
        GPU_CLAIMS_PARTS=tuple(reports / gpu / f"claims-gpu-{part}.json" for gpu in ("h200", "h100")
                               for part in ("moe", "moe-gptoss", "moe-bf16", "moe-mixtral", "moe-baseline", "mesh",
                                            "realdepth")),
        # scripts/probe_memory.py: phase memory of named and drawn configs, both variants, under two allocator
        # settings; under Run.recompute="mlp" (efficient only); and the lean block (Run.lean)
        MEMORY_PROBE={"expandable segments": (mp / "named.json", mp / "drawn.json"),
                      "default allocator": (mp / "named-default-allocator.json", mp / "drawn-default-allocator.json")},
        MEMORY_PROBE_RECOMPUTE=(mp / "recompute-named.json", mp / "recompute-drawn.json",
                                mp / "recompute-drawn-training.json"),
        MEMORY_PROBE_LEAN=(mp / "lean-named.json", mp / "lean-drawn-training.json"),
        # scripts/probe_timing.py: unmarked steps and per-component intervals, judged against the profile
        # calibrated in the same run
        TIMING_PROBE_PROFILE=tp / "profile.json",
        # the GPU suite's calibration under which reports/h200/claims-gpu-moe.json ran (2026-12-05): with the two
        # above and the next, the H200 calibrations whose spread sets the derived profiles' same-generation range
        MOE_LIVE_PROFILE=h200 / "moe-live-profile.json",
        # the GPU suite's calibration under which reports/h200/claims-gpu-moe-gptoss.json ran (2026-12-06), whose
        # grouped-GEMM, masked-SDPA and sinks rows supplement the packaged profile (scripts/supplement_profile.py)
        MOE_GPTOSS_PROFILE=h200 / "moe-gptoss-profile.json",
        TIMING_PROBE={"named": tp / "named.json", "drawn, training-sized": tp / "drawn-training.json",
                      "drawn, small": tp / "drawn-small.json"},
        PEERS_ENV=steps["peers"] / "env.json",  # scripts/env_json.py, same run: cuDNN, Triton and driver versions
        # bench/profile_step.py, the call after the peers' steps: the lean step and HF + Liger's by kernel family
        PEERS_PROFILES={c: tuple(steps["peers"] / f"profile-{c}-{p}.json" for p in ("efficient-lean", "hf-liger"))
                        for c in real},
        PEERS_POWER={c: tuple(steps["power"] / f"power-{c}-{p}.json" for p in ("efficient-lean", "hf-liger"))
                     for c in real},
        PEERS_POWER_ENV=steps["power"] / "env.json",
        # (record, variant) of every step record of our own models, uncompiled (the others are peers'): the
        # memory and timing claims against the committed steps read this one list
        OWN_STEPS=tuple((steps[run] / f"step-{name}.json", "baseline" if "baseline" in name else "efficient")
                        for run, names in (("baseline-peers", ("seed-efficient", "1b-efficient", "seed-baseline")),
                                           ("seed-repeat", ("seed-efficient",)),
                                           ("profiled", ("seed-efficient", "1b-efficient")),
                                           ("recompute", ("seed-efficient", "seed-efficient-recompute",
                                                          "anchor-1b-efficient", "anchor-1b-efficient-recompute")),
                                           ("peers", tuple(f"{c}-efficient{lean}" for c in ("seed", *real)
                                                           for lean in ("", "-lean"))))
                        for name in names),
        STEP_PROFILE=steps["profiled"] / "profile-seed-efficient.json",
        # bench/loss_memory.py: the efficient step's phases with our fused linear CE, and the loss op alone
        LOSS_MEMORY=tuple(h200 / "loss-memory" / f"loss-memory-{n}.json" for n in ("seed", "tinyllama", "llama3.2")),
        # bench/kernel_rates.py (back to back, against peers); llm_anatomy.kernels.bench (GPU-only, behind a sleep
        # kernel); pytest-benchmark JSON of validations/test_optim.py; bench/linear_ce.py (ours against Liger's)
        KERNELS_BACK_TO_BACK=h200 / "kernels" / "back-to-back-seed.json",
        KERNELS_GPU_ONLY=h200 / "kernels" / "gpu-only-seed.json",
        OPTIMIZER_STEPS=h200 / "kernels" / "optimizer-steps.json",
        LINEAR_CE=h200 / "kernels" / "linear-ce.json",
        # scripts/probe_timing.py --user-loop --real-depth 30 --presets --calibrate: the user's own loop on
        # real-depth models (llm_anatomy/real_depth.py), one freshly started H200 per folder, named by its draw
        # seed, beside the profile `anatomy calibrate` measured first in the same run (calibrated.json) and env.json
        REAL_DEPTH_RUNS=tuple(h200 / "user-loop" / f"seed-{s}" / "real-depth.json"
                              for s in (20261202, 20261203, 20261204)),
        # scripts/probe_power.py: each kernel class's burst and sustained rate, clock and power at the power limit
        POWER_PROBE=h200 / "power" / "clock-by-kernel-class.json",
        PLAN_CHECK=h200 / "plan" / "check.json",  # scripts/check_plan.py: the plan's micro-batch and the next one
        # scripts/gate_check.sh's runs (the regression gate's own check), one entry per machine
        GATE_CHECK=h200 / "gate" / "check.json",
        BASELINE=root / "baselines.json",  # the regression gate's baseline; GATE_CHECK names its sha256
        # `anatomy train` on the seed config, baseline and efficient, from the same weights and data
        LOSS_CURVES=h200 / "training" / "loss-curves-seed.json",
        LOSS_CURVES_ENV=h200 / "training" / "env.json",
        # scripts/compare_published.py: published runs on other GPUs against the derived profiles (no GPU needed)
        DERIVED_GPUS=reports / "derived-gpus" / "published.json",
    )


def __getattr__(name: str):
    """A record's path, computed on each read (a test patches _layout, never a name: a name set on the module
    would stop following the checkout)."""
    layout = _layout(root())
    if name in layout:
        return layout[name]
    raise AttributeError(f"module 'llm_anatomy.records' has no attribute {name!r}")


def gpu_claims() -> list[Path]:
    """The GPU claims reports present: the whole-suite run, then each part's (GPU_CLAIMS_PARTS)."""
    layout = _layout(root())
    return [p for p in (layout["GPU_CLAIMS"], *layout["GPU_CLAIMS_PARTS"]) if p.exists()]


def step_records(run: str) -> list[Path]:
    """The step records of one bench/step.py run (a STEPS key), sorted by name."""
    return sorted(_layout(root())["STEPS"][run].glob("step-*.json"))


def rel(path: Path) -> str:
    """A path as printed: relative to the checkout (or, for package data, to the package's parent), never
    this machine's absolute path."""
    p = Path(os.path.abspath(path))  # links kept: a record linked into a checkout prints as that checkout's
    for base in (root(), PACKAGE.parent):
        with contextlib.suppress(ValueError):
            return p.relative_to(base).as_posix()
    return p.name


def command(cmd: str | None) -> str:
    """A recorded command as printed: each absolute path (the recording machine's output folder) becomes
    `out/` and its file name, so a reader can paste it as it stands."""
    return re.sub(r"(?<![\w.])/[^\s`'\"]*/([^\s/`'\"]+)", r"out/\1", cmd or "")


def sha256(path: Path) -> str:
    """A file's SHA-256, hex: which baseline a gate run compared against (GATE_CHECK's baseline_sha256)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
