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

The harness (what a round runs and times, the injected slowdown) is validations/bench_harness.py.

CPU part (not gpu-marked): the harness's inputs match what the model feeds each component, the
slowdown parser and its calibration, and the gate itself (pytest-benchmark's compare/compare-fail on
a synthetic benchmark in a subprocess). Both time on a clock the test advances, never the wall clock.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from anatomy.config import Run
from anatomy.measure.components import COMPONENTS, component_modules
from anatomy.models import VARIANTS, build_model, make_batch
from validations.bench_harness import (COMPONENT_PHASES, CONFIGS, MODEL_PHASES, ROUNDS, WARMUP, bench, capture,
                                       component_case, model_case, parse_slowdown, spin)
from validations.configs import NAMED


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


def testspin_waits_on_its_clock():
    """spin busy-waits until its clock has moved by the delay (no sleep, which overshoots)."""
    calls = itertools.count()
    clock = lambda: next(calls)  # noqa: E731 - each reading is one unit after the last
    spin(20, clock)
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
