"""The user's own training loop on real-depth models: what a step costs when nobody tunes the loop to us.

    python3 -m scripts.probe_timing --user-loop --real-depth 30 --presets --calibrate \\
        --out $OUT/user_loop.json          # ANATOMY_DRAW_SEED=<n> picks the draw (llm_anatomy/real_depth.py)

The loop is written as a user writes it, not through llm_anatomy.measure: the model (llm_anatomy.models.build_model,
fp32 weights on the GPU), torch.optim.AdamW(fused=True), random token ids, and per step

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, targets)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

steps back to back, no synchronize between them. Per case (llm_anatomy/real_depth.py: the drawn cases and
the named presets), after WARMUP steps:
  wall         CUDA events at every step's start and after its backward over STEPS steps back to back:
               the step and its forward + backward (median), and the host's own step time
  clocks       the SM clock and board power nvidia-smi sampled every 20 ms during those steps (medians)
  kernels      a torch.profiler trace of PROFILED more steps with record_function ranges around forward,
               backward and the optimizer: the summed GPU time of the kernels each range launched (fwd+bwd
               and the whole step, per step), and the GPU's busy fraction of the wall step
  components   on the first --components cases: llm_anatomy.measure.timeline.kernel_times (per component and
               phase), a separate pass
With --calibrate, `anatomy calibrate` runs first in this process and writes its profile beside --out
(calibrated.json): the comparison (validations/test_timing_probe.py) predicts against the profile
measured in the same run. Budget on an H200: calibrate ~2 min, then ~3-10 s a case (build, Triton's compile at
a new width, WARMUP + STEPS + PROFILED steps, the trace; the components pass ~3 s more): 30 drawn cases and
the 8 preset rows in about 6 minutes (--budget-s 345: no case starts after it, and --out says which were cut).
A case that does not fit records its error and the run goes on; --out is rewritten after every case.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WARMUP, STEPS, PROFILED = 2, 4, 2
GPU_CATS, LAUNCH_CATS = ("kernel", "gpu_memcpy", "gpu_memset"), ("cuda_runtime", "cuda_driver")
PHASES = ("forward", "backward", "optimizer")


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="probe_timing.py --user-loop")
    ap.add_argument("--real-depth", type=int, default=30, help="drawn real-depth cases (llm_anatomy/real_depth.py)")
    ap.add_argument("--seed", type=int, default=None, help="the draw's seed (default: ANATOMY_DRAW_SEED, else 24)")
    ap.add_argument("--presets", action="store_true", help="also the named real presets at B1 S4096")
    ap.add_argument("--components", type=int, default=6, help="per-component kernel times on the first N cases")
    ap.add_argument("--calibrate", action="store_true", help="run `anatomy calibrate` first (profile beside --out)")
    ap.add_argument("--budget-s", type=float, default=345.0,
                    help="start no case after this many seconds, calibrate included (a case takes ~3-10 s)")
    ap.add_argument("--out", required=True, help="the JSON written after every case")
    return ap.parse_args(argv)


class Smi:
    """nvidia-smi sampling SM clock and board power every 20 ms until stop(); None where it cannot run."""

    def __init__(self):
        try:
            self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                       "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.p = None

    def stop(self) -> dict:
        if self.p is None:
            return dict(sm_mhz=None, power_w=None, samples=0)
        self.p.terminate()
        rows = []
        for line in self.p.communicate()[0].splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
        rows = [r for r in rows if len(r) == 2]
        if not rows:
            return dict(sm_mhz=None, power_w=None, samples=0)
        return dict(sm_mhz=statistics.median(r[0] for r in rows), power_w=statistics.median(r[1] for r in rows),
                    sm_mhz_min=min(r[0] for r in rows), power_w_max=max(r[1] for r in rows), samples=len(rows))


def setup(cfg, run, variant):
    from llm_anatomy.models import build_model

    model = build_model(cfg, variant, device="cuda", recompute=run.recompute, lean=run.lean)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (run.batch, run.seq), device="cuda", generator=g)
    targets = torch.randint(0, cfg.vocab, (run.batch, run.seq), device="cuda", generator=g)
    return model, opt, ids, targets


def step(model, opt, ids, targets, mark=None):
    """One training step as a user writes it; mark(phase) opens a profiler range (None: no ranges)."""
    from contextlib import nullcontext

    rng = (lambda name: torch.profiler.record_function(name)) if mark else (lambda name: nullcontext())
    with rng("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, targets)
    with rng("backward"):
        loss.backward()
    with rng("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def wall(model, opt, ids, targets, steps: int = STEPS) -> dict:
    """Steps back to back: CUDA events at each start and after each backward; the steady step is the time
    from one start to the next (the last step's end is a closing event)."""
    starts, after_bwd = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        starts.append(e)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, targets)
        loss.backward()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        after_bwd.append(e)
        opt.step()
        opt.zero_grad(set_to_none=True)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    starts.append(end)
    step_ms = [a.elapsed_time(b) for a, b in zip(starts, starts[1:])]
    fb_ms = [a.elapsed_time(b) for a, b in zip(starts, after_bwd)]
    return dict(step_ms=statistics.median(step_ms), forward_backward_ms=statistics.median(fb_ms),
                steps_ms=step_ms, host_issue_ms=host_ms, steps=steps)


def kernel_ms(trace: dict, steps: int) -> dict:
    """GPU time per step of the kernels each phase's range launched (by the trace's correlation ids: a kernel
    belongs to the range its launch lies in, whichever host thread launched it)."""
    evs = trace.get("traceEvents", [])
    ranges = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in evs
              if e.get("cat") == "user_annotation" and e.get("name") in PHASES]
    launch = {e["args"]["correlation"]: e["ts"] for e in evs
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    out = dict.fromkeys(PHASES, 0.0)
    first, last, n = float("inf"), 0.0, 0
    for e in evs:
        if e.get("cat") not in GPU_CATS or e.get("args", {}).get("correlation") not in launch:
            continue
        t = launch[e["args"]["correlation"]]
        ph = next((name for name, a, b in ranges if a <= t <= b), None)
        if ph is not None:
            out[ph] += e["dur"] / 1e3
            first, last, n = min(first, e["ts"]), max(last, e["ts"] + e["dur"]), n + 1
    per = {k: v / steps for k, v in out.items()}
    return dict(phases=per, forward_backward_ms=per["forward"] + per["backward"], step_ms=sum(per.values()),
                span_ms=(last - first) / 1e3 / steps if n else None, kernels_per_step=n / steps)


def profiled(model, opt, ids, targets, steps: int = PROFILED) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(model, opt, ids, targets, mark=True)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    return kernel_ms(trace, steps)


def measure(case, components: bool) -> dict:
    model, opt, ids, targets = setup(case.cfg, case.run, case.variant)
    for _ in range(WARMUP):
        step(model, opt, ids, targets)
    torch.cuda.synchronize()
    smi = Smi()
    w = wall(model, opt, ids, targets)
    clocks = smi.stop()
    k = profiled(model, opt, ids, targets)
    row = dict(wall=w, clocks=clocks, kernels=k, gpu_busy=k["step_ms"] / w["step_ms"],
               max_allocated_GiB=torch.cuda.max_memory_allocated() / 2**30)
    del model, opt, ids, targets
    torch.cuda.empty_cache()
    if components:
        from llm_anatomy.measure.timeline import kernel_times

        row["components"] = kernel_times(case.cfg, case.run, case.variant, "adamw")["components"]
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if not torch.cuda.is_available():
        print("probe_timing --user-loop: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    from llm_anatomy import real_depth

    try:
        seed = real_depth.draw_seed() if a.seed is None else a.seed
    except ValueError as e:
        print(f"probe_timing --user-loop: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    out = Path(a.out)
    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), seed=seed, draw="llm_anatomy/real_depth.py",
                loop=dict(warmup=WARMUP, steps=STEPS, profiled=PROFILED, optimizer="torch.optim.AdamW(fused=True)",
                          autocast="bfloat16", weights="float32"),
                command="python3 -m scripts.probe_timing --user-loop " + " ".join(argv), rows=[])
    if a.calibrate:  # its own process: its caches and its profiler sessions stay out of this one
        prof_path = out.with_name("calibrated.json")
        rc = subprocess.run([sys.executable, "-c", "import sys; from llm_anatomy.measure.calibrate import main; "
                             "sys.exit(main(sys.argv[1:]))", "--out", str(prof_path)]).returncode
        head["profile"] = prof_path.name if rc == 0 else f"calibrate exited {rc}"
        if rc != 0:  # the rows still run; the comparison then predicts with the packaged profile and says so
            print(f"probe_timing --user-loop: WARNING: anatomy calibrate exited {rc}: no same-run profile "
                  f"({prof_path.name}); the record says \"profile\": \"calibrate exited {rc}\"", file=sys.stderr,
                  flush=True)
        head["calibrate_s"] = round(time.monotonic() - t0, 1)
    cases = [("preset", c) for c in (real_depth.preset_cases() if a.presets else [])]
    cases += [("drawn", c) for c in real_depth.draw(a.real_depth, seed)]
    for i, (kind, case) in enumerate(cases):
        if time.monotonic() - t0 > a.budget_s:
            head["cut"] = f"budget {a.budget_s:g} s reached after {i} of {len(cases)} cases"
            break
        row = dict(id=case.id, kind=kind, cfg=case.cfg.to_dict(), batch=case.run.batch, seq=case.run.seq,
                   recompute=case.run.recompute, variant=case.variant, optimizer="adamw")
        torch.cuda.reset_peak_memory_stats()
        try:
            row.update(measure(case, i < a.components))
        except Exception as e:  # noqa: BLE001 - a probe records what failed (an OOM too) and goes on
            torch.cuda.empty_cache()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        head["rows"].append(row)
        msg = row.get("error", "")[:100] or (f"step {row['wall']['step_ms']:.1f} ms, kernels {row['kernels']['step_ms']:.1f}"
                                              f" ms, busy {row['gpu_busy']:.0%}, SM {row['clocks']['sm_mhz']} MHz")
        print(f"[{i + 1}/{len(cases)} {time.monotonic() - t0:5.0f}s] {case.id}: {msg}", file=sys.stderr, flush=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(head, indent=1))
        tmp.replace(out)
    head["seconds"] = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
