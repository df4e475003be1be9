"""GPU timing benchmarks (pytest-benchmark) with a regression gate, and CPU checks of the harness.

GPU part (every test `gpu`-marked; skipped without CUDA; timed only with --benchmark-enable, since
pyproject's addopts disable pytest-benchmark and a disabled run calls each target once, untimed):
  test_component  one component module of each variant (embedding, attention, norm, mlp, loss; the
                  first instance in the model), forward and forward+backward, fed what the model
                  feeds it: the module and its inputs are captured from a real forward of a 1-layer
                  model, then the per-batch inputs are redrawn at the benchmark's batch size.
  test_model      the full model: forward, forward+backward, forward+backward+AdamW step.
ids: <config>/<variant>/<component>/<phase>, e.g. test_component[seed-B16-S4096/efficient/norm/fwd+bwd].
The seed config at B=16, S=4096 is `slow`; `-m "gpu and not slow"` is the quick subset (the
seed-narrow-B4-S1024 config only). See docs/benchmarks.md for the gate's commands.

Timing: benchmark.pedantic, one call per round; setup (untimed) picks the next input set, drops
the previous gradients and synchronizes; the target runs the work and synchronizes, so a round is
the wall time of launching and finishing it. Warm-up rounds (Triton JIT, cuDNN plans, the AdamW
state) are not timed. Input sets rotate, enough of them that one round's inputs are not still in
the 60 MB L2 from the round before. Inputs and weights are random normals: never zeros.

ANATOMY_BENCH_SLOWDOWN=<component>:<factor>[,...] (read only here; rms_norm = norm, swiglu = mlp,
model = the full-model tests) injects a calibrated slowdown for the regression-gate demo
(scripts/bench_gate_demo.sh): each round of the matching benchmarks busy-waits (factor - 1) x the
median of its own un-slowed rounds after synchronizing, exactly as a kernel that much slower would.

CPU part (not gpu-marked): the harness's inputs match what the model feeds each component, the
slowdown parser, the gate itself (pytest-benchmark's compare/compare-fail on a synthetic benchmark
in a subprocess), the forensics replay/attribution/plot on a synthetic snapshot, and `anatomy sweep`.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch

from anatomy.config import PRESETS, ModelConfig, Run
from anatomy.measure.components import COMPONENTS, component_modules
from anatomy.models import VARIANTS, autocast_ctx, build_model, make_batch, param_dtype
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


def _spin(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
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
          clock: Callable[[], float] = time.perf_counter, delay: Callable[[float], None] = _spin) -> None:
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


def _env_info() -> dict:
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    return info


def _slowdowns() -> dict[str, float]:
    return parse_slowdown(os.environ.get("ANATOMY_BENCH_SLOWDOWN", ""))


def _cases(components, phases):
    out = []
    for cname, bc in CONFIGS.items():
        for variant, comp, phase in itertools.product(VARIANTS, components, phases):
            out.append(pytest.param(cname, variant, comp, phase, id=f"{cname}/{variant}/{comp}/{phase}",
                                    marks=[pytest.mark.slow] if bc.slow else []))
    return out


@pytest.fixture
def free_cuda():
    yield
    gc.collect()
    torch.cuda.empty_cache()


# ---- GPU benchmarks ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("config,variant,component,phase", _cases(COMPONENTS, COMPONENT_PHASES))
def test_component(benchmark, free_cuda, config, variant, component, phase):
    bc = CONFIGS[config]
    slowdown = _slowdowns().get(component, 1.0)
    case = component_case(bc.cfg, bc.run, variant, component, "cuda")
    benchmark.group = f"{config}/{component}/{phase}"
    benchmark.extra_info.update(_env_info(), config=config, batch=bc.run.batch, seq=bc.run.seq,
                                dtype=bc.run.dtype, variant=variant, component=component, phase=phase,
                                input_sets=len(case.sets), injected_slowdown=slowdown)
    bench(benchmark, case.target(phase), case.setup, rounds=ROUNDS["component"], warmup=WARMUP, slowdown=slowdown)
    if component == "attention" and variant == "efficient":
        benchmark.extra_info["sdpa_backend"] = case.module.last_backend


@pytest.mark.gpu
@pytest.mark.parametrize("config,variant,component,phase", _cases(("model",), MODEL_PHASES))
def test_model(benchmark, free_cuda, gpu_fits, config, variant, component, phase):
    bc = CONFIGS[config]
    gpu_fits(bc.cfg, bc.run, variant, optimizer="adamw" if phase == "fwd+bwd+adamw" else None)
    slowdown = _slowdowns().get("model", 1.0)
    case = model_case(bc.cfg, bc.run, variant, "cuda", optimizer=phase == "fwd+bwd+adamw")
    benchmark.group = f"{config}/model/{phase}"
    benchmark.extra_info.update(_env_info(), config=config, batch=bc.run.batch, seq=bc.run.seq,
                                dtype=bc.run.dtype, variant=variant, component="model", phase=phase,
                                layers=bc.cfg.layers, tokens=bc.run.tokens, input_sets=len(case.sets),
                                injected_slowdown=slowdown)
    bench(benchmark, case.target(phase), case.setup, rounds=ROUNDS["model"], warmup=WARMUP, slowdown=slowdown)


# ---- CPU: the harness feeds each component what the model feeds it -------------------------------
TINY = NAMED["tiny-gqa"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_component_inputs_match_the_model(variant, component):
    """Dtypes and shapes of every arg, and of the output, equal those of a real forward at the same
    batch; per-batch inputs are random (nonzero), and fwd+bwd leaves a gradient on every parameter."""
    run = Run(3, 12, "amp")
    case = component_case(TINY, run, variant, component, "cpu")
    model = build_model(replace(TINY, layers=1), variant, device="cpu")
    name = next(n for n, c in component_modules(model).items() if c == component)
    args, out = capture(model, name, run, *make_batch(TINY, run, "cpu"))
    for (inputs, grad) in (case.setup()[0] for _ in range(len(case.sets))):
        assert [(tuple(a.shape), a.dtype) for a in inputs if isinstance(a, torch.Tensor)] == \
               [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
        assert [a for a in inputs if not isinstance(a, torch.Tensor)] == \
               [a for a in args if not isinstance(a, torch.Tensor)]
        assert (grad is None) == (out.ndim == 0)
        if grad is not None:
            assert (tuple(grad.shape), grad.dtype) == (tuple(out.shape), out.dtype)
        assert all(a.float().abs().sum() > 0 for a in inputs if isinstance(a, torch.Tensor))
    assert len(case.sets) >= 2
    inputs, grad = case.setup()[0]
    case.fwd(inputs, grad)
    case.fwd_bwd(inputs, grad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in case.module.parameters())


@pytest.mark.parametrize("phase", MODEL_PHASES)
def test_model_targets_run(phase):
    case = model_case(TINY, Run(2, 8, "amp"), "efficient", "cpu", optimizer=phase == "fwd+bwd+adamw")
    before = [p.detach().clone() for p in case.module.parameters()]
    args, kw = case.setup()
    case.target(phase)(*args, **kw)
    changed = any(not torch.equal(a, p) for a, p in zip(before, case.module.parameters()))
    assert changed == (phase == "fwd+bwd+adamw")


def test_benchmark_ids_are_stable():
    ids = [p.id for p in _cases(COMPONENTS, COMPONENT_PHASES) + _cases(("model",), MODEL_PHASES)]
    assert len(ids) == len(set(ids)) == 2 * 2 * (5 * 2 + 3)
    assert "seed-B16-S4096/efficient/norm/fwd+bwd" in ids
    assert "seed-narrow-B4-S1024/baseline/model/fwd+bwd+adamw" in ids


def test_parse_slowdown():
    assert parse_slowdown("") == {}
    assert parse_slowdown("rms_norm:1.2, model:1.05,swiglu:1") == {"norm": 1.2, "model": 1.05, "mlp": 1.0}
    for bad in ("rms_norm", "rmsnorm:1.2", "nope:1.2", "norm:0.8", "norm:x", "norm:inf"):
        with pytest.raises(ValueError, match="ANATOMY_BENCH_SLOWDOWN"):
            parse_slowdown(bad)


class _Clock:
    """A clock that only the test moves: the benchmarked work and the injected delay advance it by
    known amounts, so no other process on the machine can change a measured duration."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class _TimingStub:
    """benchmark.pedantic's contract (setup untimed, warm-up untimed, one call per round), timed on `clock`."""
    disabled = False

    def __init__(self, clock):
        self.clock, self.extra_info, self.times = clock, {}, []

    def pedantic(self, target, setup, rounds, warmup_rounds, iterations):
        for i in range(warmup_rounds + rounds):
            args, kw = setup()
            t0 = self.clock()
            target(*args, **kw)
            if i >= warmup_rounds:
                self.times.append(self.clock() - t0)


def test_injected_slowdown_is_calibrated():
    """The demo's 1.2 makes a benchmark's median 1.2x its own: the delay is (factor - 1) x the median
    of the benchmark's own un-slowed rounds (one round in four is a 10x outlier, which a mean would
    follow), not a guess."""
    clock, work = _Clock(), [0.004, 0.004, 0.004, 0.040]
    rounds = itertools.cycle(work)
    medians = {}
    for factor in (1.0, 1.2):
        stub = _TimingStub(clock)
        bench(stub, lambda: clock.advance(next(rounds)), lambda: ((), {}), rounds=9, warmup=1, slowdown=factor,
              clock=clock, delay=clock.advance)
        medians[factor] = statistics.median(stub.times)
    assert medians[1.0] == pytest.approx(0.004, rel=1e-9)
    assert medians[1.2] / medians[1.0] == pytest.approx(1.2, rel=1e-9)
    assert stub.extra_info["injected_delay_s"] == pytest.approx(0.2 * 0.004, rel=1e-9)


def test_spin_waits_on_its_clock():
    """_spin busy-waits until its clock has moved by the delay (no sleep, which overshoots)."""
    calls = itertools.count()
    clock = lambda: next(calls)  # noqa: E731 - each reading is one unit after the last
    _spin(20, clock)
    assert next(calls) == 21  # the start reading 0, then readings 1 .. 20: 20 ends it


# ---- CPU: the regression gate itself ---------------------------------------------------------------
# A clock the synthetic benchmark advances itself (pytest-benchmark reads it through --benchmark-timer):
# each round of test_kernel takes exactly 2 ms x GATE_SLOWDOWN on it, whatever else the machine runs.
GATE_CLOCK = '''
t = 0.0

def now():
    return t

def work(seconds):
    global t
    t += seconds
'''

GATE_TEST = '''
import os

import gate_clock

def test_kernel(benchmark):
    f = float(os.environ.get("GATE_SLOWDOWN", "1"))
    benchmark.pedantic(gate_clock.work, args=(0.002 * f,), rounds=15, warmup_rounds=2)

def test_other(benchmark):
    benchmark.pedantic(gate_clock.work, args=(0.002,), rounds=15, warmup_rounds=2)
'''


@pytest.mark.slow  # ~8 s: four pytest runs, each gathering machine info (py-cpuinfo) for its JSON
def test_regression_gate_commands(tmp_path):
    """The exact flags of docs/benchmarks.md, on a synthetic benchmark timed on GATE_CLOCK: record with
    --benchmark-json, a 30% slower kernel fails --benchmark-compare-fail=median:10% against that file, an
    unchanged run passes, and a missing baseline is a usage error (exit 4), not a silent pass."""
    (tmp_path / "test_gate.py").write_text(GATE_TEST)
    (tmp_path / "gate_clock.py").write_text(GATE_CLOCK)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --benchmark-disable\n")  # as pyproject has

    def pytest_(*flags, slowdown="1"):  # only pytest-benchmark loaded: 0.4 s a run instead of 2.5
        env = dict(os.environ, GATE_SLOWDOWN=slowdown, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        return subprocess.run([sys.executable, "-m", "pytest", "test_gate.py", "-q", "-p", "pytest_benchmark.plugin",
                               "-p", "no:cacheprovider", "--benchmark-enable",
                               "--benchmark-timer=gate_clock.now", *flags], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    rec = pytest_("--benchmark-json=baselines.json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    saved = json.loads((tmp_path / "baselines.json").read_text())
    assert {b["fullname"] for b in saved["benchmarks"]} == {"test_gate.py::test_kernel", "test_gate.py::test_other"}
    assert all(b["stats"]["median"] == pytest.approx(0.002, rel=1e-9) for b in saved["benchmarks"])  # GATE_CLOCK's
    gate = ("--benchmark-compare=baselines.json", "--benchmark-compare-fail=median:10%",
            "--benchmark-json=current.json")
    slow = pytest_(*gate, slowdown="1.3")
    assert slow.returncode != 0
    # pytest-benchmark logs the failed checks, then raises PerformanceRegression out of the terminal
    # summary: exit code 1 and a traceback, after the JSON report was written
    verdict = (slow.stdout + slow.stderr).split("Performance has regressed:", 1)[1].split("Traceback", 1)[0]
    assert "test_kernel" in verdict and "'median' has failed" in verdict and "test_other" not in verdict
    assert (tmp_path / "current.json").exists()
    same = pytest_(*gate)
    assert same.returncode == 0, same.stdout + same.stderr
    missing = pytest_("--benchmark-compare=nothing-here.json", "--benchmark-compare-fail=median:10%")
    assert missing.returncode == 4, missing.stdout + missing.stderr
    assert "requires valid --benchmark-compare" in missing.stdout + missing.stderr
