"""Where the compiled AdEMAMix step's host time goes, on a CUDA GPU: how long the GPU waits for the call.

    python3 -m scripts.probe_optimizer_host [--config anchor-1b] [--reps 10] [--no-one-element] [--json OUT]

The GPU suite's `optimizer step time` claim (validations/test_optim_kernels.py) times one compiled step from
a drained GPU to a drained GPU and predicts it as the step's GPU time plus the host time before its first
kernel, in series; calibrate measures that host time as the step's wall less its kernels' GPU time over
synthetic lists (calibrate_host.measure_optimizer_host). This probe measures, in one process, on the model's
own parameter list (fp32 master weights, random gradients, after three steps that compile it):

  wall_ms         the step host sync to host sync, as the claim times it (median of --reps);
  gpu_ms          the step's kernels alone: queued behind a spin long enough to hide the host, between CUDA
                  events (median);
  host_busy_ms    the call's host time while the GPU is busy (the same spin): from the call to its return,
                  every launch included, the GPU never waited for;
  first_kernel_ms the profiler's time from the step's start on the host to its first kernel's start on the GPU,
                  from a drained GPU (median over --reps profiled steps): the wait the model charges;
  tail_ms         the profiler's time from the last kernel's end to the step's end on the host;
  scalars_busy_ms the step's scalars' copy to the GPU (FusedAdEMAMix._scalars: from pageable memory) timed
                  on the host while the GPU is busy: about the spin's length if the driver synced the stream
                  before staging it (CUDA documents that it may), which in training would make the step wait
                  for backward; scalars_pinned_busy_ms the same size of copy through pin_memory() first;
  one_element     calibrate's measurement at 8, 32, 128 and the model's tensor count over one-element tensors
                  (there the GPU waits for every launch too: the whole call's host time);
  exposed         the same over calibrate's tensors (OPTIMIZER_HOST_NUMEL elements each). The row at the
                  model's count is measured, not fitted: the probe reads no calculator.

wall - gpu is what the claim's measurement exposes of the host; first_kernel + tail is where that exposure
comes from (the profiler slows the host, so first_kernel reads high); host_busy and the one-element and
exposed rows at the model's count are the candidate models of it. Exit 2 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path



def _median_ms(xs) -> float:
    return statistics.median(xs) * 1e3


def measure(config: str, reps: int, one_element: bool = True) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llm_anatomy.config import ModelConfig
    from llm_anatomy.measure.calibrate_host import compiled_ademamix, measure_optimizer_host
    from llm_anatomy.models import build_model

    cfg = ModelConfig.from_name(config)
    params = list(build_model(cfg, "efficient", device="cuda", dtype=torch.float32).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = compiled_ademamix(params)
    for _ in range(3):  # the state and the compile
        opt.step()
    torch.cuda.synchronize()

    wall = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)

    gpu, busy = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spin: the whole call is issued before the step's kernels run
        a.record()
        t0 = time.perf_counter()
        opt.step()
        busy.append(time.perf_counter() - t0)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / 1e3)

    scalars, pinned = [], []
    for _ in range(reps):
        for out, copy in ((scalars, lambda: opt._scalars(opt.param_groups[0], 1, torch.float32, torch.device("cuda"))),
                          (pinned, lambda: torch.tensor([0.9] * 8).pin_memory().to("cuda", non_blocking=True))):
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            t0 = time.perf_counter()
            copy()
            out.append(time.perf_counter() - t0)
            torch.cuda.synchronize()

    first, tail = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("probe.step"):
                opt.step()
            torch.cuda.synchronize()
        events = prof.events()
        step = next(e for e in events if e.name == "probe.step" and e.device_type.name == "CPU")
        kernels = [e for e in events if e.device_type.name == "CUDA" and e.time_range.start >= step.time_range.start]
        if not kernels:
            continue
        first.append((min(k.time_range.start for k in kernels) - step.time_range.start) / 1e6)
        tail.append(max(0.0, step.time_range.end - max(k.time_range.end for k in kernels)) / 1e6)

    tensors = len(params)
    opt = params = None  # the model's state freed before the synthetic lists
    out = dict(config=config, tensors=tensors, reps=reps, wall_ms=_median_ms(wall), gpu_ms=_median_ms(gpu),
               host_busy_ms=_median_ms(busy), scalars_busy_ms=_median_ms(scalars),
               scalars_pinned_busy_ms=_median_ms(pinned),
               first_kernel_ms=_median_ms(first) if first else None, tail_ms=_median_ms(tail) if tail else None)
    for name, numel in (("one_element", 1), ("exposed", None))[0 if one_element else 1:]:
        out[name] = measure_optimizer_host(counts=(8, 32, 128, tensors), numel=numel)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_optimizer_host.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="anchor-1b")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--no-one-element", action="store_true", help="skip the one-element lists (4 compiles fewer)")
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("probe_optimizer_host.py: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    if a.reps < 3:
        print("probe_optimizer_host.py: error: --reps must be at least 3", file=sys.stderr)
        return 2
    from llm_anatomy.config import ConfigError, ModelConfig

    try:
        ModelConfig.from_name(a.config)
    except ConfigError as e:
        print(f"probe_optimizer_host.py: error: {e}", file=sys.stderr)
        return 2
    out = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
               cuda=torch.version.cuda, command="python3 -m scripts.probe_optimizer_host "
               + " ".join(argv if argv is not None else sys.argv[1:]), **measure(a.config, a.reps, not a.no_one_element))
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
