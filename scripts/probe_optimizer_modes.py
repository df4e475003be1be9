"""Probe: why the baseline AdEMAMix step's GPU time falls in one of two modes per process (measurement only).

    python3 -m scripts.probe_optimizer_modes --out $OUT/optimizer-modes.json [--processes 6] [--cases 3]

`test_optimizer[ademamix/seed/step]` (AdEMAMix's per-tensor loop over the seed model's 57 fp32 tensors, about
855 kernels) runs at one of two GPU times per process, about 4% apart, and sets the regression gate's
threshold (docs/benchmarks.md). Each of --processes fresh processes (one after another, under the
benchmarks' expandable-segments allocator) builds the benchmark's own case (validations/bench_kernels.
optimizer_case) --cases times, freeing the previous one and the allocator's cache in between, and records for
each case:
  - the step's GPU time: the median of 10 rounds queued behind a spin, the benchmark's clock, with the host's
    issue time, the spin's length and how many rounds were queued;
  - one profiled step: every kernel's duration in issue order, their sum and the GPU's idle time between them;
  - the spin kernel's rate (the SM clock) before the case;
  - each optimizer state tensor's address modulo 2 MiB, and the allocator's segment count.
A mode that changes between cases of one process follows the allocation; one that changes only between
processes follows the context. The kernel lists of a fast and a slow case, index by index, say which kernels
carry the difference, and the idle time says whether it is in the kernels or between them.
Exit 1 when a process failed (its last error line is kept), 2 without a CUDA GPU or with a bad argument.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PAGE = 2 << 20  # the allocator's expandable-segment page
# the benchmarks' allocator (scripts/gpu_suite.sh and gate_check.sh export it)
CHILD_ENV = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")


def kernel_list(trace: dict) -> list[tuple[float, float]]:
    """(start us, duration us) of every GPU kernel in a Chrome trace, in start order."""
    ks = [(e["ts"], e["dur"]) for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    return sorted(ks)


def busy_and_idle(ks: list[tuple[float, float]]) -> tuple[float, float]:
    """The kernels' summed duration and the GPU's idle time between the first start and the last end (us)."""
    if not ks:
        return 0.0, 0.0
    busy = sum(d for _, d in ks)
    span = max(t + d for t, d in ks) - ks[0][0]
    return busy, max(0.0, span - busy)


def one_case() -> dict:
    """Build the benchmark's case, time it as the benchmark does, profile one step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from validations.bench_kernels import optimizer_case
    from validations.gpu_clock import GpuRound, sleep_rate

    rate = sleep_rate()
    _, step, info = optimizer_case("ademamix", "seed", "cuda")
    opt = step.__self__
    for _ in range(3):  # the state, then two warm steps
        step()
    torch.cuda.synchronize()
    rnd = GpuRound(step, cycles_per_s=rate, clock=[0.0])
    for _ in range(11):  # queued_median's rounds: one untimed, then ten
        rnd()
    gpu_s, issue_s = statistics.median(rnd.gpu_s[1:]), statistics.median(rnd.host_issue_s[1:])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        ks = kernel_list(json.loads(Path(f.name).read_text()))
    busy, idle = busy_and_idle(ks)
    states = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.is_cuda]
    offsets = [t.data_ptr() % PAGE for t in states]
    row = dict(gpu_s=gpu_s, host_issue_s=issue_s, spin_s=rnd.spin_s, queued=sum(rnd.queued[1:]),
               sleep_cycles_per_s=rate, kernels=len(ks), busy_us=busy, idle_us=idle,
               durations_us=[round(d, 3) for _, d in ks], state_offsets_mod_2MiB=offsets,
               segments=len(torch.cuda.memory_snapshot()), tensors=info["tensors"])
    del opt, step, states
    torch.cuda.empty_cache()
    return row


def child(cases: int) -> int:
    print(json.dumps([one_case() for _ in range(cases)]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_optimizer_modes.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.processes < 1 or a.cases < 1:
        print("probe_optimizer_modes: error: --processes and --cases must be at least 1", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("probe_optimizer_modes: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    if a.child:
        return child(a.cases)
    env = subprocess.run([sys.executable, "-m", "scripts.env_json"], cwd=ROOT, capture_output=True, text=True)
    command = f"python3 -m scripts.probe_optimizer_modes --processes {a.processes} --cases {a.cases}"
    doc = dict(env=json.loads(env.stdout) if env.returncode == 0 else None, command=command, processes=[])
    for i in range(a.processes):
        cmd = [sys.executable, __file__, "--out", str(a.out), "--cases", str(a.cases), "--child"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=CHILD_ENV)
        except subprocess.TimeoutExpired:
            out = subprocess.CompletedProcess(cmd, 1, "", "the process ran past 300 s")
        if out.returncode != 0:
            doc["processes"].append(dict(error=out.stderr.strip().splitlines()[-1:]))
            print(f"process {i + 1}/{a.processes}: failed: {doc['processes'][-1]['error']}", flush=True)
        else:
            doc["processes"].append(json.loads(out.stdout.strip().splitlines()[-1]))
            ms = [round(c["gpu_s"] * 1e3, 4) for c in doc["processes"][-1]]
            print(f"process {i + 1}/{a.processes}: step GPU ms {ms}", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc))
    ok = [c["gpu_s"] for p in doc["processes"] if isinstance(p, list) for c in p]
    if ok:
        print(f"all cases: {len(ok)}, GPU ms {min(ok) * 1e3:.3f}-{max(ok) * 1e3:.3f}, "
              f"median {statistics.median(ok) * 1e3:.3f}")
    return 0 if all(isinstance(p, list) for p in doc["processes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
