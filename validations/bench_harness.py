"""The benchmark harness of validations/test_benchmarks.py: what each benchmark builds, runs and times.

Timing: benchmark.pedantic, one call per round; setup (untimed) picks the next input set, drops
the previous gradients and synchronizes; the target runs the work and synchronizes, so a round is
the wall time of launching and finishing it. Warm-up rounds (Triton JIT, cuDNN plans, the AdamW
state) are not timed. Input sets rotate, enough of them that one round's inputs are not still in
the 60 MB L2 from the round before. Inputs and weights are random normals: never zeros.

ANATOMY_BENCH_SLOWDOWN=<component>:<factor>[,...] (read only here; rms_norm = norm, swiglu = mlp,
model = the full-model tests) injects a calibrated slowdown for the regression-gate demo
(scripts/bench_gate_demo.sh): each round of the matching benchmarks busy-waits (factor - 1) x the
median of its own un-slowed rounds after synchronizing, exactly as a kernel that much slower would.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from anatomy.config import PRESETS, ModelConfig, Run
from anatomy.measure.components import COMPONENTS, component_modules
from anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations.configs import NAMED


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
ROUNDS = {"component": 25, "model": 10}
WARMUP = 3
CALIBRATION_ROUNDS = 7  # for an injected slowdown only
ALIASES = {"rms_norm": "norm", "swiglu": "mlp"}  # the kernel ops, by their component


# ---- the injected slowdown (regression-gate demo) ---------------------------------------------------
def parse_slowdown(text: str) -> dict[str, float]:
    """'rms_norm:1.2,model:1.05' -> {'norm': 1.2, 'model': 1.05}. A factor is >= 1: a slowdown."""
    out: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, factor = item.partition(":")
        name = ALIASES.get(name.strip(), name.strip())
        if not sep or name not in COMPONENTS + ("model",):
            raise ValueError(f"ANATOMY_BENCH_SLOWDOWN: bad item {item!r}; expected <component>:<factor> with a "
                             f"component in {', '.join(COMPONENTS + ('model',) + tuple(ALIASES))}")
        try:
            f = float(factor)
        except ValueError:
            f = float("nan")
        if not f >= 1.0 or math.isinf(f):
            raise ValueError(f"ANATOMY_BENCH_SLOWDOWN: factor {factor!r} for {name} must be a number >= 1")
        out[name] = f
    return out


def spin(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Busy-wait: sleep() overshoots by tens of microseconds, a spin on perf_counter does not."""
    end = clock() + seconds
    while clock() < end:
        pass


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
        _sync(self.device)

    def fwd_bwd(self, inputs, grad) -> None:
        out = self._forward(inputs)
        out.backward(grad)  # grad None: a scalar loss
        _sync(self.device)

    def step(self, inputs, grad) -> None:
        self._forward(inputs).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)

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


def bench(benchmark, target, setup, *, rounds: int, warmup: int, slowdown: float = 1.0,
          clock: Callable[[], float] = time.perf_counter, delay: Callable[[float], None] = spin) -> None:
    """benchmark.pedantic over `target`; with a slowdown, each round first runs the work, then
    delay()s (slowdown - 1) x the median of CALIBRATION_ROUNDS un-slowed rounds timed on `clock`.
    The GPU benchmarks use the wall clock and a spin; the CPU test passes a clock it advances itself."""
    if slowdown != 1.0 and not benchmark.disabled:
        for _ in range(warmup):
            args, kw = setup()
            target(*args, **kw)
        times = []
        for _ in range(CALIBRATION_ROUNDS):
            args, kw = setup()
            t0 = clock()
            target(*args, **kw)
            times.append(clock() - t0)
        extra = (slowdown - 1.0) * statistics.median(times)
        fast = target

        def target(*a, **k):  # noqa: F811 - the same work, then the injected delay
            fast(*a, **k)
            delay(extra)

        benchmark.extra_info["injected_delay_s"] = extra
    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
