"""A fake GPU and a stand-in for pytest-benchmark's fixture: the CPU tests of the GPU-time harness.

FakeGPU's events read a GPU clock that only the test's work advances, so every figure a test checks
is exact, whatever else the machine runs.
"""
from __future__ import annotations

from validations.gpu_clock import GpuRound

REFS = dict(gemm_s=0.002, copy_s=0.0005, sleep_cycles_per_s=1e9, extra_launch_s=0.0)


class FakeGPU:
    """A GPU and a host that only the test moves. Ops queue in order: an event records the GPU time
    at which the ops before it are done; a spin of c cycles lasts launch_s + c / rate.

    What a GPU carries from one test to the next, as the tests of the harness need it:
    - `dirty_s`: GPU time the next ops pay to write back L2 lines that an earlier test left dirty (each op
      pays what is left, up to its own time), until a flush (settle) writes them back untimed;
    - `edge_s`: GPU time the first op after a spin pays on top of its own (a cold start at a round's edge);
    - `resolution_s`: events read the clock rounded down to this step (CUDA's are about 0.5 us);
    - `queue`: pending kernels the GPU holds; the launch past them waits, on the host, for the spin to end.
    `log` lists what ran: ("spin", seconds), ("run", seconds), ("settle",)."""

    def __init__(self, rate: float = 1e9, launch_s: float = 0.0, edge_s: float = 0.0, resolution_s: float = 0.0,
                 queue: int = 0):
        self.gpu = self.host = 0.0
        self.rate, self.launch_s, self.edge_s, self.resolution_s, self.queue = rate, launch_s, edge_s, resolution_s, queue
        self.dirty_s, self._after_spin, self._spin_s, self._since_spin = 0.0, False, 0.0, 0
        self.log: list[tuple] = []

    def run(self, gpu_s: float, host_s: float = 0.0) -> None:  # one op: its GPU time, the host's issue time
        paid = min(self.dirty_s, gpu_s)
        self.dirty_s -= paid
        self.gpu += gpu_s + paid + (self.edge_s if self._after_spin else 0.0)
        self._since_spin += 1
        self.host += host_s + (self._spin_s if self._since_spin == self.queue + 1 and self.queue else 0.0)
        self._after_spin = False
        self.log.append(("run", gpu_s))

    def sleep(self, cycles: int) -> None:
        self.gpu += self.launch_s + cycles / self.rate
        self._after_spin, self._spin_s, self._since_spin = True, cycles / self.rate, 0
        self.log.append(("spin", cycles / self.rate))

    def settle(self) -> dict:
        """gpu_clock.settle's effect: the dirty lines written back untimed, then the fixed spin."""
        self.gpu += self.dirty_s
        self.dirty_s = 0.0
        self.log.append(("settle",))
        self.sleep(0)
        return dict(flush_bytes=0, spin_s=0.0)

    def event(self):
        gpu = self

        class Event:
            t = None

            def record(self):
                step = gpu.resolution_s
                self.t = gpu.gpu if not step else (gpu.gpu // step) * step

            def elapsed_time(self, other) -> float:
                return (other.t - self.t) * 1e3  # ms, as CUDA's

            def synchronize(self):
                pass
        return Event()

    def round(self, work, clock: list[float]) -> GpuRound:
        return GpuRound(work, cycles_per_s=self.rate, event=self.event, sleep=self.sleep, host=lambda: self.host,
                        clock=clock)


class BenchStub:
    """pytest-benchmark's pedantic contract: setup untimed, warm-up untimed, one call per round timed
    as timer() after minus timer() before (fixture.py, _make_runner)."""
    disabled = False

    def __init__(self, timer):
        self.timer, self.extra_info, self.times = timer, {}, []

    def pedantic(self, target, setup, rounds, warmup_rounds, iterations):
        for i in range(warmup_rounds + rounds):
            args, kw = setup()
            t0 = self.timer()
            target(*args, **kw)
            if i >= warmup_rounds:
                self.times.append(self.timer() - t0)
