"""The benchmark harness of validations/test_benchmarks.py: what each benchmark builds, runs and times.

Timing: benchmark.pedantic, one call per round, on GPU time (validations/gpu_clock.py): the round's
work is queued behind a spin kernel and timed between two CUDA events, and pytest-benchmark's
timer is gpu_clock.gpu_time, so its stats (and --benchmark-compare-fail) are GPU seconds. setup
(untimed) picks the next input set, drops the previous gradients and synchronizes. Input sets rotate,
enough of them that one round's inputs are not still in the 60 MB L2 from the round before. Inputs and
weights are random normals: never zeros.

No benchmark's figure may depend on what ran before it in the process (the gate holds in every selection:
the whole suite, --quick, one file). So each benchmark reaches a steady state of its own before its timed
rounds, the same whatever ran before (bench(), in order):
  1. settle: the allocator's cached blocks returned, the L2 flushed to clean lines of a buffer 4x its size,
     a fixed 50 ms spin (gpu_clock.settle): no dirty line, cached block or busy GPU left by another test;
  2. WARMUP rounds of one repetition (Triton JIT, cuDNN plans, the cuBLAS workspace, optimizer state,
     compiles), whose smallest GPU time sets the repetitions per round (gpu_clock.reps_for): work under
     MIN_ROUND_S (1 ms) repeats to a round of at least 1 ms, each repetition on the next input set with its
     own gradients dropped, so that the round's edges (event resolution, the first kernel after the spin)
     weigh about 0.1% instead of several percent of a kernel of tens of microseconds;
  3. WARMUP_REPS rounds at those repetitions, then the spin is held: every timed round waits the same spin.
     A round whose host issue still outlasts its spin holds more launches than the GPU queues while it
     spins (its queue of pending kernels: about a thousand; docs/benchmarks.md): the repetitions halve and
     the WARMUP_REPS rounds run again.
The warm-up's GPU work is then the benchmark's own, in count and kind, whatever test ran before it.

Beside the gated GPU time, extra_info records the median wall time of a few
unqueued rounds (launch and finish, as eager training pays it; not gated) and the GPU time relative
to the session's reference GEMM and copy (gpu_clock.references).

ANATOMY_SLOWDOWN (validations/slowdown.py) adds a calibrated GPU slowdown to one kernel: the
harness then runs calibration rounds before timing and records what was injected.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from llm_anatomy.config import PRESETS, ModelConfig, Run
from llm_anatomy.measure.components import component_modules
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations.configs import NAMED
from validations.gpu_clock import GpuRound, reps_for
from validations.gpu_clock import settle as cuda_settle


@dataclass(frozen=True)
class BenchConfig:
    cfg: ModelConfig
    run: Run
    slow: bool


CONFIGS = {
    "seed-B16-S4096": BenchConfig(PRESETS["seed"], Run(16, 4096, "amp"), slow=True),
    # the seed's layer shapes, 1 layer, a quarter of the tokens per sequence and batch: the quick subset
    "seed-narrow-B4-S1024": BenchConfig(NAMED["seed-narrow"], Run(4, 1024, "amp"), slow=False),
}
COMPONENT_PHASES = ("fwd", "fwd+bwd")
MODEL_PHASES = ("fwd", "fwd+bwd", "fwd+bwd+adamw")
L2_BYTES = 60 * 2**20  # H200 L2 (DESIGN.md): rotate at least twice its size of inputs
ROUNDS = 10  # GPU-time rounds: how steady their median is, run to run, scripts/gate_check.sh's unmodified runs show
WARMUP = 3  # rounds of one repetition: JIT, plans, workspaces, optimizer state
WARMUP_REPS = 2  # rounds at the chosen repetitions: the spin follows their issue time, then is held
WALL_ROUNDS = 3  # unqueued rounds after the timed ones: extra_info's wall time, not gated


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- what a benchmark runs -----------------------------------------------------------------------
class Case:
    """A module, rotating input sets and (for backward) matching output gradients; fwd/fwd_bwd/step
    are the timed targets, setup() the untimed preparation of each round."""

    def __init__(self, module, sets, grads, run: Run, device, opt=None):
        self.module, self.sets, self.grads, self.run, self.device, self.opt = module, sets, grads, run, device, opt
        self._next = itertools.cycle(range(len(sets)))

    def setup(self):
        i = next(self._next)
        for t in self.sets[i]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        self.module.zero_grad(set_to_none=True)
        _sync(self.device)
        return (self.sets[i], self.grads[i]), {}

    def _forward(self, inputs):
        with autocast_ctx(self.run, torch.device(self.device).type):
            return self.module(*inputs)

    def fwd(self, inputs, grad) -> None:  # a training forward: autograd records the graph
        self._forward(inputs)

    def fwd_bwd(self, inputs, grad) -> None:
        for t in inputs:  # host only: a round's repetitions may reuse an input set, never accumulate into it
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        self.module.zero_grad(set_to_none=True)
        out = self._forward(inputs)
        out.backward(grad)  # grad None: a scalar loss

    def step(self, inputs, grad) -> None:
        self._forward(inputs).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def target(self, phase: str):
        return {"fwd": self.fwd, "fwd+bwd": self.fwd_bwd, "fwd+bwd+adamw": self.step}[phase]


def _n_sets(per_set_bytes: int) -> int:
    return min(8, max(2, math.ceil(2 * L2_BYTES / max(per_set_bytes, 1))))


def capture(model, name: str, run: Run, ids, targets):
    """The positional args `model.<name>` receives and the output it returns, in one real forward."""
    mod = model.get_submodule(name)
    seen = {}

    def pre(m, args) -> None:  # hooks return None: a returned value would replace the args / output
        seen.setdefault("args", args)

    def post(m, args, out) -> None:
        seen.setdefault("out", out)

    h1, h2 = mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)
    try:
        with torch.no_grad(), autocast_ctx(run, ids.device.type):
            model(ids, targets)
    finally:
        h1.remove()
        h2.remove()
    return seen["args"], seen["out"]


def component_case(cfg: ModelConfig, run: Run, variant: str, component: str, device) -> Case:
    """The first `component` module of a 1-layer model of `variant`, with inputs as the model feeds it.

    The args are captured from a forward at batch 1: tensors with a leading batch dimension (the
    activations, the token ids and targets) are redrawn at run.batch as random normals (random ids),
    float ones as leaves that require grad (upstream of a component, the model's do); the shared
    tables (RoPE cos/sin, the causal bias) are kept as the model built them."""
    assert run.seq > 1, "a batch dimension is told apart from the (S, ...) tables by its size 1"
    model = build_model(replace(cfg, layers=1), variant, device=device, dtype=param_dtype(run))
    name = next(n for n, c in component_modules(model).items() if c == component)
    ids1, tgt1 = make_batch(cfg, Run(1, run.seq, run.dtype), device)
    args, out = capture(model, name, run, ids1, tgt1)
    per_batch = [isinstance(a, torch.Tensor) and a.ndim >= 2 and a.shape[0] == 1 for a in args]
    set_bytes = sum(a.numel() * a.element_size() * run.batch for a, b in zip(args, per_batch) if b)
    sets, grads = [], []
    for i in range(_n_sets(set_bytes)):
        torch.manual_seed(1000 + i)
        s = []
        for a, b in zip(args, per_batch):
            if not b:
                s.append(a)
            elif a.is_floating_point():
                s.append(torch.randn((run.batch, *a.shape[1:]), device=device, dtype=a.dtype).requires_grad_())
            else:
                s.append(torch.randint(0, cfg.vocab, (run.batch, *a.shape[1:]), device=device, dtype=a.dtype))
        sets.append(tuple(s))
        grads.append(None if out.ndim == 0 else torch.randn((run.batch, *out.shape[1:]), device=device,
                                                            dtype=out.dtype))
    return Case(model.get_submodule(name), sets, grads, run, device)


def model_case(cfg: ModelConfig, run: Run, variant: str, device, optimizer: bool = False) -> Case:
    model = build_model(cfg, variant, device=device, dtype=param_dtype(run))
    n = _n_sets(2 * 8 * run.tokens)
    sets = [make_batch(cfg, run, device, seed=i) for i in range(n)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.device(device).type == "cuda") if optimizer \
        else None
    return Case(model, sets, [None] * n, run, device, opt)


def bench(benchmark, work, setup, *, refs: dict, rounds: int = ROUNDS, warmup: int = WARMUP, slowdown=None,
          wall_rounds: int = WALL_ROUNDS, make_round: Callable | None = None,
          host: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
          settle: Callable[[], dict | None] | None = None) -> None:
    """benchmark.pedantic over a GpuRound of `work` (the test's timer must be gpu_clock.gpu_time), after the
    benchmark's own warm-up (module docstring: settle, warm-up, repetitions, held spin); then extra_info: the
    GPU median, its ratio to the reference GEMM and copy, the repetitions, the host's side (issue time,
    rounds queued) and the wall time of `wall_rounds` plain rounds. `setup()` prepares one repetition.
    With a slowdown (validations/slowdown.py): calibration rounds after the warm-up, then the spin is fixed
    and recorded. make_round, host, sync and settle are the fake GPU's in the CPU tests."""
    if slowdown is not None:  # count the targets' calls inside the work only (not in setup or building)
        slowdown.calls, slowdown.counting, inner = {}, False, work

        def work(*args, **kwargs):  # noqa: F811 - the same work, counted
            slowdown.counting = True
            try:
                return inner(*args, **kwargs)
            finally:
                slowdown.counting = False

    def repeated(batch) -> None:  # one round: each repetition on its own prepared inputs, back to back
        for args, kw in batch:
            work(*args, **kw)

    rnd = (make_round or (lambda w: GpuRound(w, cycles_per_s=refs["sleep_cycles_per_s"])))(repeated)

    def round_setup():
        return ([setup() for _ in range(rnd.reps)],), {}

    def one_round() -> None:
        args, kw = round_setup()
        rnd(*args, **kw)

    if not benchmark.disabled:
        settled = (settle or (lambda: cuda_settle(refs["sleep_cycles_per_s"])))()
        for _ in range(warmup):
            one_round()
        rnd.set_reps(reps_for(min(rnd.gpu_s)))
        while True:
            for _ in range(WARMUP_REPS):
                one_round()
            if all(rnd.queued[-WARMUP_REPS:]) or rnd.reps == 1:
                break
            # the round's launches overflow the GPU's queue of pending kernels: the host would pace the GPU
            rnd.set_reps(rnd.reps // 2)
        if slowdown is not None:
            slowdown.calibrate()  # the rounds from here on are queued: their events time the GPU
            for _ in range(slowdown.ROUNDS):
                one_round()
            injected = slowdown.freeze()
            per: dict[str, list[float]] = {}  # target -> injected GPU time / the call's own, per call shape
            for key, frac in injected.items():
                per.setdefault(key[0], []).append(round(frac, 4))
            benchmark.extra_info.update(slowdown=dict(slowdown.factors), slowdown_injected=per)
        rnd.hold_spin()
        benchmark.extra_info.update(reps=rnd.reps, settle=settled)
    benchmark.pedantic(rnd, setup=round_setup, rounds=rounds, warmup_rounds=0, iterations=1)
    if benchmark.disabled:
        return
    if slowdown is not None:  # which slowed targets the timed work called: scripts/gate_check.sh reads it
        benchmark.extra_info["slowdown_calls"] = dict(slowdown.calls)
    gpu, issue, queued = rnd.gpu_s[-rounds:], rnd.host_issue_s[-rounds:], rnd.queued[-rounds:]
    med = statistics.median(gpu)
    wall = []
    for _ in range(wall_rounds):
        args, kw = setup()
        t0 = host()
        work(*args, **kw)
        (sync or torch.cuda.synchronize)()
        wall.append(host() - t0)
    benchmark.extra_info.update(
        timer="gpu_time", gpu_median_s=med, rel_gemm=med / refs["gemm_s"], rel_copy=med / refs["copy_s"],
        ref_gemm_s=refs["gemm_s"], ref_copy_s=refs["copy_s"], host_issue_median_s=statistics.median(issue),
        queued_rounds=sum(queued) / len(queued), spin_s=rnd.spin_s,
        wall_median_s=statistics.median(wall) if wall else None)
