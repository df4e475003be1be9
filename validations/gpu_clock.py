"""GPU time as pytest-benchmark's clock: what the regression gate compares.

pytest-benchmark times a round as ``timer()`` after the target minus ``timer()`` before it
(fixture.py, _make_runner). ``gpu_time`` is a clock that only moves when a ``GpuRound`` finishes:
it returns the GPU seconds accumulated so far. A benchmark whose target is a GpuRound and whose
timer is gpu_time (``@pytest.mark.benchmark(timer=gpu_time)``, pytest-benchmark's own marker)
therefore records each round's GPU time as its duration, and --benchmark-compare and
--benchmark-compare-fail=median:X% work on stock pytest-benchmark with no change.

A GpuRound queues the work behind a spin kernel (torch.cuda._sleep): the host enqueues every op
while the GPU spins, so the two CUDA events around the work time the GPU's work only, never a
wait for the host (Python, launch latency, the allocator). The spin adapts: each round spins twice
the longest host issue time of the two rounds before it (at least MIN_SPIN_S, at most MAX_SPIN_S,
so a warm-up round that compiled kernels does not leave seconds of spin behind). A round whose host
issue outlasted its spin is counted as not queued (`extra_info["queued_rounds"]`); its figure
may include host gaps. A round may hold several repetitions of the work (`reps`): its GPU time
divided by reps is what the clock records, so a kernel of tens of microseconds is timed over a round of
at least MIN_ROUND_S, and the round's edges (the event's 0.5 us resolution, the first kernel after the
spin) weigh 1/reps as much (bench_harness.bench picks reps). hold_spin() fixes the spin for the rounds
that follow: every timed round of a benchmark then waits the same spin before its work.

settle() is each benchmark's own start (bench_harness.bench runs it before the warm-up): the allocator's
cached blocks returned, the L2 flushed by writing then reading a buffer of 4x its size (it ends holding
clean lines, so no line another test left dirty is written back during this benchmark's rounds), then a
fixed spin, so that the GPU's recent history is the same whatever test ran before in the process.

Everything CUDA is injected (event factory, sleep, synchronize), so the CPU tests drive a GpuRound
on a fake GPU clock (validations/test_benchmarks.py).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

_GPU_SECONDS = [0.0]  # the clock's state: GPU seconds of every finished GpuRound in this process


def gpu_time() -> float:
    """The benchmarks' timer: GPU seconds accumulated by GpuRounds so far (moves only when one ends)."""
    return _GPU_SECONDS[0]


class GpuRound:
    """A pytest-benchmark target: run `work` between two events, queued behind a spin; add its GPU time
    to gpu_time's clock. Host-side figures per round go to host_issue_s and queued."""

    MIN_SPIN_S, MAX_SPIN_S = 2e-3, 0.5

    def __init__(self, work: Callable, *, cycles_per_s: float, event: Callable | None = None,
                 sleep: Callable[[int], None] | None = None, host: Callable[[], float] = time.perf_counter,
                 clock: list[float] = _GPU_SECONDS):
        if event is None or sleep is None:
            import torch

            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            sleep = sleep or torch.cuda._sleep
        self.work, self.rate, self.event, self.sleep, self.host, self.clock = work, cycles_per_s, event, sleep, host, clock
        self.spin_s = self.MIN_SPIN_S
        self.reps = 1  # repetitions of the work that one call of `work` holds
        self.held = False
        self.gpu_s: list[float] = []  # every round's GPU time per repetition, warm-up included
        self.host_issue_s: list[float] = []  # the host's issue time per repetition
        self.queued: list[bool] = []

    def _spin_for(self, reps: int) -> float:
        """Twice the longest per-repetition issue time of the last two rounds, times reps."""
        last = max(self.host_issue_s[-2:], default=0.0)
        return min(self.MAX_SPIN_S, max(self.MIN_SPIN_S, 2 * reps * last))

    def set_reps(self, reps: int) -> None:
        self.reps, self.spin_s = reps, self._spin_for(reps)

    def hold_spin(self) -> None:
        """From now on every round spins the same time: the one the last two rounds' issue asks for."""
        self.spin_s, self.held = self._spin_for(self.reps), True

    def __call__(self, *args, **kwargs) -> None:
        before, start, end = self.event(), self.event(), self.event()
        t0 = self.host()
        before.record()
        self.sleep(int(self.spin_s * self.rate))  # the GPU spins while the host enqueues the work
        start.record()
        self.work(*args, **kwargs)
        end.record()
        issue = self.host() - t0
        end.synchronize()
        gpu = start.elapsed_time(end) * 1e-3 / self.reps  # elapsed_time is in ms
        self.clock[0] += gpu
        self.gpu_s.append(gpu)
        self.host_issue_s.append(issue / self.reps)
        self.queued.append(issue < before.elapsed_time(start) * 1e-3)
        if not self.held:
            self.spin_s = self._spin_for(self.reps)


MIN_ROUND_S = 1e-3  # a timed round holds at least this much GPU work: a microsecond at its edges weighs 0.1%
MAX_REPS = 1024  # a round of 1 us kernels: launches, not kernels, would fill it past this
SETTLE_SPIN_S = 0.05  # the fixed spin that ends settle(): the GPU's last 50 ms before a benchmark's warm-up
L2_FALLBACK_BYTES = 60 * 2**20  # H200 (DESIGN.md), where torch does not report the device's L2 size


def reps_for(gpu_s: float, min_round_s: float = MIN_ROUND_S) -> int:
    """Repetitions per round for work of gpu_s GPU seconds: 1 at or above min_round_s, else the power of two
    that lifts a round to at least min_round_s (a power of two, so that a few percent of noise in gpu_s
    moves reps across at most one step, whose edges weigh under 1/reps either way)."""
    if gpu_s >= min_round_s:
        return 1
    return min(MAX_REPS, 2 ** math.ceil(math.log2(min_round_s / max(gpu_s, 1e-9))))


def settle(cycles_per_s: float, spin_s: float = SETTLE_SPIN_S) -> dict:
    """A benchmark's own start on CUDA (module docstring): the allocator's cache returned, the L2 flushed to
    clean lines, a fixed spin. Returns what it did, for extra_info."""
    import gc

    import torch

    gc.collect()  # tensors the previous test left in reference cycles: freed before the cache is returned
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    buf = torch.empty(4 * l2 // 4, device="cuda")  # 4x the L2, fp32
    buf.zero_()  # every line of the L2 now the buffer's, dirty
    buf.sum()  # read back: the dirty lines are written back, the L2 ends holding clean lines of buf
    del buf
    torch.cuda.empty_cache()
    torch.cuda._sleep(int(spin_s * cycles_per_s))
    torch.cuda.synchronize()
    return dict(flush_bytes=4 * l2, spin_s=spin_s)


def queued_median(fn: Callable, reps: int, *, cycles_per_s: float, **inject) -> float:
    """Median GPU seconds of fn() over reps GpuRounds (after one untimed warm-up round)."""
    r = GpuRound(fn, cycles_per_s=cycles_per_s, clock=[0.0], **inject)
    for _ in range(reps + 1):
        r()
    return statistics.median(r.gpu_s[1:])


def sleep_rate(event: Callable | None = None, sleep: Callable | None = None, cycles: int = 20_000_000) -> float:
    """torch.cuda._sleep's cycles per second on this GPU (its SM clock), between two events."""
    if event is None or sleep is None:
        import torch

        event = event or (lambda: torch.cuda.Event(enable_timing=True))
        sleep = sleep or torch.cuda._sleep
    sleep(cycles // 10)  # warm-up
    a, b = event(), event()
    a.record()
    sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / (a.elapsed_time(b) * 1e-3)


# The references every benchmark is divided by (extra_info rel_gemm, rel_copy): measured once per session.
REF_GEMM = 8192  # bf16 (8192, 8192) @ (8192, 8192): 1.1 TFLOP, compute-bound on any data-centre GPU
REF_COPY_BYTES = 2**30  # a 1 GiB device-to-device copy: 2 GiB moved, far beyond any L2


def references(reps: int = 20) -> dict:
    """The GPU's reference times in this run: a bf16 GEMM and a device copy, each the median of reps
    queued rounds; also the spin kernel's rate and the GPU time one extra (empty) kernel launch adds
    between two ops, which the injected slowdown (validations/slowdown.py) subtracts."""
    import torch

    rate = sleep_rate()

    def gemm() -> float:
        a, b = (torch.randn(REF_GEMM, REF_GEMM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = torch.empty_like(a)
        return queued_median(lambda: torch.matmul(a, b, out=out), reps, cycles_per_s=rate)

    def copy() -> float:
        src = torch.randn(REF_COPY_BYTES // 4, device="cuda")
        dst = torch.empty_like(src)
        return queued_median(lambda: dst.copy_(src), reps, cycles_per_s=rate)

    def launch() -> float:  # an op alone, then the same op followed by an empty spin kernel
        x = torch.randn(2**20, device="cuda")
        one = queued_median(lambda: x.mul_(1.0), reps, cycles_per_s=rate)
        two = queued_median(lambda: (x.mul_(1.0), torch.cuda._sleep(0)), reps, cycles_per_s=rate)
        return max(0.0, two - one)

    g, c, extra = gemm(), copy(), launch()
    torch.cuda.empty_cache()  # the reference tensors (3 GiB) are gone: give their blocks back
    return dict(gemm_s=g, gemm_tflops=2 * REF_GEMM**3 / g / 1e12, copy_s=c, copy_tbps=2 * REF_COPY_BYTES / c / 1e12,
                sleep_cycles_per_s=rate, extra_launch_s=extra)
