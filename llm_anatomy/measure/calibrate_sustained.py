"""The sustained-load regime: the GEMM, attention and copy rates a long step sees, beside the burst rates.

A short burst of GEMMs (calibrate's grid: tens of milliseconds per shape, with host syncs between) runs at
the boost clock. A training step of hundreds of milliseconds, steps back to back, draws more than the
board's power limit at that clock, and the power controller lowers the SM clock until it fits (on the H200:
~1980 MHz in bursts, 1515-1650 MHz at 460-550 W in real-depth steps). measure_sustained times one GEMM, one
causal SDPA forward + backward and one device copy in both regimes:

  1. burst       each timed over ~BURST_MS of back-to-back calls, after IDLE_S of idle of its own: a
                 GEMM burst draws enough power for the controller to start lowering the clock within
                 ~100 ms, so a timing that followed it would not be a burst
  2. warm-up     8192^3 GEMMs back to back (the queue kept two chunks deep, so the GPU never idles) for at
                 least MIN_WARMUP_S and at most warmup_s, until the chunk rate has settled (its spread over
                 the last SETTLE_S within SETTLE_TOL); every chunk's rate, SM clock and power is the trace
                 fit.fit_tau reads the time constant from
  3. sustained   the same three timings, right after the warm-up (no idle between)

The SM clock and the board power are read during each timing (NVML through pynvml, else torch.cuda's
clock_rate / power_draw, else the latest line of a background `nvidia-smi -lms 20`, else None). The
calculator reads the rate ratios (Profile.sustained_ratio), the time constant (Profile.sustained_tau_s) and
the clocks (Profile.clocks). About 16 s.
"""
from __future__ import annotations

import statistics
import time

IDLE_S = 2.0  # idle before the burst timings: the power controller returns to boost within this
BURST_MS = 60.0  # GPU time per burst timing: calibrate's own timings are of this order
MIN_WARMUP_S, SETTLE_S, SETTLE_TOL = 3.0, 1.0, 0.015
GEMM_N = 8192  # (8192, 8192) @ (8192, 8192): ~1.4 ms at burst on an H200, far past the L2
ATTN = (4, 16, 4096, 128)  # (B, heads, S, head_dim): anchor-1b's attention
COPY_NUMEL = 1 << 29  # 1 GiB of bf16 each way


def nvml_reader():
    """(read() -> (SM clock MHz | None, board power W | None), limits {power_limit_W, max_clock_MHz}, source)."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            idx = torch.cuda._get_nvml_device_index(torch.cuda.current_device())  # CUDA_VISIBLE_DEVICES-aware
        except Exception:  # noqa: BLE001 (a private helper: any failure falls back to the first device)
            idx = 0
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)

        def read():
            try:
                return (float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1e3)
            except pynvml.NVMLError:
                return None, None

        limits = {}
        for k, f in (("power_limit_W", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3),
                     ("max_clock_MHz", lambda: float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)))):
            try:
                limits[k] = f()
            except pynvml.NVMLError:
                pass

        def reasons():
            for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
                try:
                    return int(getattr(pynvml, name)(h))
                except (AttributeError, pynvml.NVMLError):
                    continue
            return None

        read.reasons = reasons
        return read, limits, "pynvml"
    except Exception:  # noqa: BLE001 (no pynvml, no driver library, no permission: try torch's readers)
        pass
    try:
        torch.cuda.clock_rate()
        torch.cuda.power_draw()

        def read():
            try:
                return float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3
            except Exception:  # noqa: BLE001
                return None, None

        read.reasons = lambda: None
        return read, {}, "torch.cuda.clock_rate/power_draw"
    except Exception:  # noqa: BLE001
        pass
    return _smi_reader()


def _smi_reader():
    """The latest (SM clock, power) of `nvidia-smi -lms 20` streaming in the background (a reader thread keeps
    the last line): a read never waits on the tool, so the warm-up's queue never drains."""
    import subprocess
    import threading

    last = [(None, None)]
    try:
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "-lms", "20", "-i", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        read = lambda: (None, None)  # noqa: E731
        read.reasons, read.close = (lambda: None), (lambda: None)
        return read, {}, None

    def pump():
        for line in p.stdout:
            try:
                clock, power = (float(v) for v in line.split(","))
                last[0] = (clock, power)
            except ValueError:
                continue

    threading.Thread(target=pump, daemon=True).start()
    read = lambda: last[0]  # noqa: E731
    read.reasons, read.close = (lambda: None), p.terminate
    return read, {}, "nvidia-smi -lms 20"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def timed_rate(fn, work: float, read, target_ms: float = BURST_MS) -> dict:
    """work / second over back-to-back calls of fn lasting ~target_ms of GPU time, with the SM clock and
    power sampled while they run (the host polls until the closing event has passed)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    calls = max(3, int(target_ms / max(a.elapsed_time(b), 1e-3)))
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    samples = []
    while not b.query():
        samples.append(read())
        time.sleep(0.004)
    b.synchronize()
    ms = a.elapsed_time(b) / calls
    clocks = [c for c, _ in samples if c is not None]
    return dict(rate=work / (ms * 1e-3), ms=ms, calls=calls, clock_MHz=_median(clocks),
                power_W=_median(p for _, p in samples), clock_min_MHz=min(clocks) if clocks else None,
                samples=len(samples))


def _cases():
    """{class: (fn, work per call, unit scale)}: the GEMM (FLOPs), causal SDPA fwd+bwd (3.5x the causal
    forward's FLOPs, the calculator's convention) and the copy (bytes read + written)."""
    import torch
    import torch.nn.functional as F

    bf = dict(device="cuda", dtype=torch.bfloat16)
    n = GEMM_N
    A, B, C = torch.randn(n, n, **bf), torch.randn(n, n, **bf), torch.empty(n, n, **bf)
    Bt, h, S, hd = ATTN
    q, k, v = (torch.randn(Bt, h, S, hd, **bf, requires_grad=True) for _ in range(3))
    g = torch.randn(Bt, h, S, hd, **bf)
    x, y = torch.randn(COPY_NUMEL, **bf), torch.empty(COPY_NUMEL, **bf)

    def attn():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)

    causal_fwd = 2 * Bt * h * S * S * hd  # QK^T and PV, each 2 B h S^2 hd, halved by the causal mask
    return dict(matmul=(lambda: torch.mm(A, B, out=C), 2 * n ** 3, 1e12),
                attention=(attn, 3.5 * causal_fwd, 1e12),
                memory=(lambda: y.copy_(x), 2 * COPY_NUMEL * 2, 1e12))


def _regime(cases, read, idle_s: float = 0.0) -> dict:
    """Each class's rate, clock and power; idle_s of idle before each timing (the burst regime's)."""
    out = {}
    clocks, powers = [], []
    for cls, key in (("matmul", "matmul_tflops"), ("attention", "attention_tflops"), ("memory", "copy_tbps")):
        fn, work, unit = cases[cls]
        time.sleep(idle_s)
        r = timed_rate(fn, work, read)
        out[key] = r["rate"] / unit
        out[f"{cls}_clock_MHz"], out[f"{cls}_power_W"] = r["clock_MHz"], r["power_W"]
        # the lowest clock read during the timing: a regime the power controller left part-way shows here
        out[f"{cls}_clock_min_MHz"], out[f"{cls}_samples"] = r["clock_min_MHz"], r["samples"]
        clocks.append(r["clock_MHz"] if cls != "memory" else None)  # the compute timings' clock
        powers.append(r["power_W"] if cls != "memory" else None)
    out["clock_MHz"], out["power_W"] = _median(clocks), _median(powers)
    return out


def settle(fn, work: float, read, max_s: float, min_s: float = MIN_WARMUP_S, chunk: int = 10,
           event=None, sync=None) -> tuple[list[dict], bool]:
    """Back-to-back chunks of `chunk` calls of fn (each `work` units: FLOPs or bytes) until the chunk rate
    settles (its spread over the last SETTLE_S within SETTLE_TOL, after min_s) or max_s: [{t_s, rate,
    clock_MHz, power_W}] per chunk, and whether it settled. The host waits for chunk i-1 while chunk i runs,
    so the GPU never idles. event/sync are injectable for the CPU tests."""
    if event is None or sync is None:
        import torch

        event = event or (lambda: torch.cuda.Event(enable_timing=True))
        sync = sync or torch.cuda.synchronize
    events = [event()]
    events[0].record()
    t0, trace, settled = time.monotonic(), [], False
    while True:
        for _ in range(chunk):
            fn()
        events.append(event())
        events[-1].record()
        if len(events) < 3:
            continue
        events[-2].synchronize()  # chunk i-1 done; chunk i still queued
        clock, power = read()
        ms = events[-3].elapsed_time(events[-2])
        trace.append(dict(t_s=round(time.monotonic() - t0, 4), rate=work * chunk / (ms * 1e-3), clock_MHz=clock,
                          power_W=power))
        t = trace[-1]["t_s"]
        last = [r["rate"] for r in trace if r["t_s"] >= t - SETTLE_S]
        if t >= min_s and len(last) >= 3 and max(last) / min(last) - 1 <= SETTLE_TOL:
            settled = True
        if settled or t >= max_s:
            break
        events = events[-2:]
    sync()
    return trace, settled


def warm_up(read, warmup_s: float, chunk: int = 10) -> tuple[list[dict], bool]:
    """8192^3 GEMMs back to back until their rate settles (settle): [{t_s, tflops, clock_MHz, power_W}] per
    chunk, and whether it settled."""
    import torch

    n = GEMM_N
    bf = dict(device="cuda", dtype=torch.bfloat16)
    A, B, C = torch.randn(n, n, **bf), torch.randn(n, n, **bf), torch.empty(n, n, **bf)
    trace, settled = settle(lambda: torch.mm(A, B, out=C), 2 * n ** 3, read, warmup_s, chunk=chunk)
    return [dict(t_s=r["t_s"], tflops=r["rate"] / 1e12, clock_MHz=r["clock_MHz"], power_W=r["power_W"])
            for r in trace], settled


def measure_sustained(warmup_s: float = 8.0) -> dict:
    """measurements.sustained: {burst, sustained: {matmul_tflops, attention_tflops, copy_tbps, clock_MHz,
    power_W, ...}, trace, warmup_s, settled, limits, reasons, reader} (the module doc says how)."""
    import torch

    read, limits, source = nvml_reader()
    cases = _cases()
    for fn, _, _ in cases.values():  # cuBLAS/cuDNN handles and plans, outside every timing
        fn()
    torch.cuda.synchronize()
    burst = _regime(cases, read, IDLE_S)
    trace, settled = warm_up(read, warmup_s)
    sustained = _regime(cases, read)
    reasons = read.reasons()
    getattr(read, "close", lambda: None)()
    del cases
    torch.cuda.empty_cache()
    return dict(burst=burst, sustained=sustained, trace=trace, warmup_s=round(trace[-1]["t_s"], 3) if trace else
                warmup_s, settled=settled, limits=limits, reasons=reasons, reader=source,
                shapes=dict(gemm=[GEMM_N] * 3, attention=list(ATTN), copy_bytes=2 * COPY_NUMEL * 2,
                            idle_s=IDLE_S, burst_ms=BURST_MS))
