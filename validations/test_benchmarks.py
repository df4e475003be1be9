"""GPU benchmarks (pytest-benchmark) gated on GPU time, and CPU checks of the harness and the gate.

GPU part (every test `gpu`-marked; skipped without CUDA; timed only with --benchmark-enable, since
pyproject's addopts disable pytest-benchmark and a disabled run calls each target once, untimed):
  test_component  one component module of each variant (embedding, attention, norm, mlp, loss; the
                  first instance in the model), forward and forward+backward, fed what the model
                  feeds it: the module and its inputs are captured from a real forward of a 1-layer
                  model, then the per-batch inputs are redrawn at the benchmark's batch size.
  test_model      the full model: forward, forward+backward, forward+backward+AdamW step.
  (each fused kernel, SDPA and each optimizer step alone: validations/test_bench_kernels.py)
ids: <config>/<variant>/<component>/<phase>, e.g. test_component[seed-B16-S4096/efficient/norm/fwd+bwd].
The seed config at B=16, S=4096 is `slow`, out of the quick subset (`--quick`, conftest.py).
Every round is GPU time (validations/gpu_clock.py: pytest-benchmark's timer is gpu_time), so the
design card's `--benchmark-compare=baselines.json --benchmark-compare-fail=median:X%` gates them all.
See docs/benchmarks.md.

CPU part (not gpu-marked): the harness's inputs match what the model feeds each component; the GPU
clock's semantics on fake CUDA events (the slowdown's: validations/test_slowdown.py); every fused
kernel, component and optimizer has a benchmark id. The gate's flags and verdict:
validations/test_bench_gate.py.
"""
from __future__ import annotations

import contextlib
import itertools
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_anatomy.config import Run
from llm_anatomy.measure.components import COMPONENTS, component_modules
from llm_anatomy.models import VARIANTS, build_model, make_batch
from validations.bench_harness import (COMPONENT_PHASES, CONFIGS, MODEL_PHASES, WALL_ROUNDS, WARMUP, WARMUP_REPS, bench,
                                       capture, component_case, model_case)
from validations.configs import NAMED
from validations.fake_gpu import REFS, BenchStub, FakeGPU
from validations.gpu_clock import MAX_REPS, MIN_ROUND_S, gpu_time, reps_for
from validations.slowdown import TARGETS

ROOT = Path(__file__).resolve().parent.parent
GPU_TIMER = pytest.mark.benchmark(timer=gpu_time)  # pytest-benchmark's marker: this test's rounds are GPU seconds


def env_info() -> dict:
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    return info


def _cases(components, phases):
    out = []
    for cname, bc in CONFIGS.items():
        for variant, comp, phase in itertools.product(VARIANTS, components, phases):
            out.append(pytest.param(cname, variant, comp, phase, id=f"{cname}/{variant}/{comp}/{phase}",
                                    marks=[pytest.mark.slow] if bc.slow else []))
    return out


# ---- GPU benchmarks ------------------------------------------------------------------------------
@pytest.mark.gpu
@GPU_TIMER
@pytest.mark.parametrize("config,variant,component,phase", _cases(COMPONENTS, COMPONENT_PHASES))
def test_component(benchmark, free_cuda, gpu_refs, slowdown, config, variant, component, phase):
    bc = CONFIGS[config]
    case = component_case(bc.cfg, bc.run, variant, component, "cuda")
    benchmark.group = f"{config}/{component}/{phase}"
    benchmark.extra_info.update(env_info(), config=config, batch=bc.run.batch, seq=bc.run.seq,
                                dtype=bc.run.dtype, variant=variant, component=component, phase=phase,
                                input_sets=len(case.sets))
    bench(benchmark, case.target(phase), case.setup, refs=gpu_refs, slowdown=slowdown)
    if component == "attention" and variant == "efficient":
        benchmark.extra_info["sdpa_backend"] = case.module.last_backend


@pytest.mark.gpu
@GPU_TIMER
@pytest.mark.parametrize("config,variant,component,phase", _cases(("model",), MODEL_PHASES))
def test_model(benchmark, free_cuda, gpu_fits, gpu_refs, slowdown, config, variant, component, phase):
    bc = CONFIGS[config]
    gpu_fits(bc.cfg, bc.run, variant, optimizer="adamw" if phase == "fwd+bwd+adamw" else None)
    case = model_case(bc.cfg, bc.run, variant, "cuda", optimizer=phase == "fwd+bwd+adamw")
    benchmark.group = f"{config}/model/{phase}"
    benchmark.extra_info.update(env_info(), config=config, batch=bc.run.batch, seq=bc.run.seq,
                                dtype=bc.run.dtype, variant=variant, component="model", phase=phase,
                                layers=bc.cfg.layers, tokens=bc.run.tokens, input_sets=len(case.sets))
    bench(benchmark, case.target(phase), case.setup, refs=gpu_refs, slowdown=slowdown)


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


# ---- CPU: the GPU clock, on a fake GPU -----------------------------------------------------------


def test_gpu_clock_times_the_gpus_work_only():
    """A round's duration on gpu_time's clock is the GPU time of its work, whatever the host's issue time
    or the spin before it; the clock accumulates; a round whose issue outlasted the spin is not queued,
    and the next two spins cover twice that issue time, then the spin follows the issue time back down."""
    fake, clock = FakeGPU(), [0.0]
    works = itertools.cycle([(0.004, 0.001), (0.004, 0.030), (0.004, 0.0001), (0.040, 0.001)])  # (GPU, host) s
    rnd = fake.round(lambda: fake.run(*next(works)), clock)
    stub = BenchStub(lambda: clock[0])
    stub.pedantic(rnd, lambda: ((), {}), rounds=8, warmup_rounds=0, iterations=1)
    assert stub.times == pytest.approx([0.004, 0.004, 0.004, 0.040] * 2, abs=1e-12)
    assert clock[0] == pytest.approx(2 * 0.052, abs=1e-12) and rnd.gpu_s == pytest.approx(stub.times, abs=1e-12)
    assert rnd.queued == [True, False, True, True] * 2  # 30 ms of issue behind a 2 ms spin: the GPU waited
    assert rnd.spin_s == pytest.approx(0.002)


def test_bench_records_gpu_time_and_the_relative_fields():
    """bench() gates GPU seconds and writes the GPU median, its ratio to the session's reference GEMM and
    copy, the host's side and the wall time of plain rounds into extra_info."""
    fake, clock = FakeGPU(), [0.0]
    stub = BenchStub(lambda: clock[0])
    bench(stub, lambda: fake.run(0.003, 0.0002), lambda: ((), {}), refs=REFS, rounds=5, warmup=2,
          make_round=lambda w: fake.round(w, clock), host=lambda: fake.host + fake.gpu, sync=lambda: None,
          settle=fake.settle)
    assert statistics.median(stub.times) == pytest.approx(0.003)
    x = stub.extra_info
    assert x["timer"] == "gpu_time" and x["gpu_median_s"] == pytest.approx(0.003)
    assert x["rel_gemm"] == pytest.approx(1.5) and x["rel_copy"] == pytest.approx(6.0)
    assert x["queued_rounds"] == 1.0 and x["host_issue_median_s"] == pytest.approx(0.0002)
    assert x["wall_median_s"] == pytest.approx(0.0032)  # issue + GPU, no spin: what eager training waits


# ---- CPU: every kernel, component and optimizer is benchmarked, on GPU time ------------------------
def _benchmark_tests():
    """(module.test, function) for every test in validations/test_*.py that takes the benchmark fixture."""
    import ast
    import importlib

    for path in sorted((ROOT / "validations").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for f in tree.body:
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test_") and \
                    any(a.arg == "benchmark" for a in f.args.args):
                yield f"{path.stem}.{f.name}", getattr(importlib.import_module(f"validations.{path.stem}"), f.name)


def test_every_kernel_component_and_step_has_a_gpu_timed_benchmark():
    """Collected ids (as --collect-only lists them) cover each component of both variants in each phase
    and config, each model step, each fused kernel and SDPA at both shapes in each phase, and each
    optimizer at both shapes; every slowdown target has a benchmark of its own; every benchmark test in
    validations carries the gpu_time timer, so the design card's command gates GPU time only."""
    from validations.bench_kernels import KERNEL_PHASES, KERNEL_SHAPES, OPTIMIZERS

    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                        "validations/test_benchmarks.py", "validations/test_bench_kernels.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-800:] + r.stderr[-800:]
    ids = {ln.split("::", 1)[1] for ln in r.stdout.splitlines() if "::" in ln}
    want = {f"test_component[{c}/{v}/{comp}/{ph}]" for c in CONFIGS for v in VARIANTS for comp in COMPONENTS
            for ph in COMPONENT_PHASES}
    want |= {f"test_model[{c}/{v}/model/{ph}]" for c in CONFIGS for v in VARIANTS for ph in MODEL_PHASES}
    want |= {f"test_kernel[{kn}/{sh}/{ph}]" for kn, phs in KERNEL_PHASES.items() for sh in KERNEL_SHAPES for ph in phs}
    want |= {f"test_optimizer[{o}/{sh}/step]" for o in OPTIMIZERS for sh in KERNEL_SHAPES}
    assert ids == want
    assert len(ids) == 52 + 2 * 11 + 6
    assert all(any(f"[{t}/" in i for i in ids) for t in TARGETS)
    timed = dict(_benchmark_tests())
    assert {"test_benchmarks.test_component", "test_benchmarks.test_model", "test_bench_kernels.test_kernel",
            "test_bench_kernels.test_optimizer"} <= set(timed)
    for name, fn in timed.items():
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "benchmark"]
        assert [m.kwargs.get("timer") for m in marks] == [gpu_time], f"{name} is not timed on gpu_time"


# ---- CPU: each benchmark's own steady state (bench_harness.bench, on a fake GPU) ---------------------------
def test_reps_for_lifts_a_round_to_a_millisecond():
    assert [reps_for(t) for t in (2e-3, 1e-3, 0.9e-3, 0.3e-3, 18e-6)] == [1, 1, 2, 4, 64]
    assert reps_for(0.0) == MAX_REPS and reps_for(18e-6) * 18e-6 >= MIN_ROUND_S


def _bench_on(fake: FakeGPU, clock: list, work, setup=lambda: ((), {}), settle=True, rounds: int = 5):
    stub = BenchStub(lambda: clock[0])
    start = len(fake.log)
    bench(stub, work, setup, refs=REFS, rounds=rounds, make_round=lambda w: fake.round(w, clock),
          host=lambda: fake.host + fake.gpu, sync=lambda: None, settle=fake.settle if settle else (lambda: None))
    return stub, fake.log[start:]


def test_a_tiny_kernel_is_timed_over_repetitions_of_its_own():
    """An 18 us kernel whose round edge costs 1 us more (the first kernel after the spin) and whose events
    tick every 0.5 us: one repetition a round reads it 5.6% slow; bench() repeats it 64 times a round (at least
    1 ms of work), each repetition on its own setup(), and records it within 0.1%."""
    fake, clock, setups = FakeGPU(edge_s=1e-6, resolution_s=5e-7), [0.0], []

    def setup():
        setups.append(1)
        return (), {}

    alone = fake.round(lambda: fake.run(18e-6, 2e-5), [0.0])
    for _ in range(5):
        alone()
    assert statistics.median(alone.gpu_s) == pytest.approx(19e-6)
    stub, _ = _bench_on(fake, clock, lambda: fake.run(18e-6, 2e-5), setup)
    assert stub.extra_info["reps"] == 64 and statistics.median(stub.times) == pytest.approx(18e-6, rel=1e-3)
    assert len(setups) == WARMUP + 64 * (WARMUP_REPS + 5) + WALL_ROUNDS
    assert stub.extra_info["queued_rounds"] == 1.0
    stub, _ = _bench_on(fake, clock, lambda: fake.run(3e-3, 2e-5))  # a round of 1 ms or more: one repetition
    assert stub.extra_info["reps"] == 1


def _process(before: bool, settle: bool = True):
    """One pytest process on a fake GPU: benchmark B (an 18 us kernel), alone or after benchmark A, which
    compiles B's kernel (B's first call then skips the 0.2 s JIT on the host) and leaves 10 ms of dirty L2
    lines for whatever runs next."""
    fake, clock, compiled = FakeGPU(edge_s=1e-6, resolution_s=5e-7), [0.0], set()

    def kernel(name: str, gpu_s: float) -> None:
        fake.run(gpu_s, 2e-5 if name in compiled else 0.2)
        compiled.add(name)

    if before:
        _bench_on(fake, clock, lambda: (kernel("gemm", 4e-3), kernel("norm", 18e-6)), settle=settle)
        fake.dirty_s = 0.01
    return _bench_on(fake, clock, lambda: kernel("norm", 18e-6), settle=settle)


def test_a_benchmarks_warm_up_and_figures_do_not_depend_on_what_ran_before_it():
    """B alone and B after A in one process: the same GPU work in the same order from B's settle on (its warm-up,
    its repetitions, its timed rounds), the same spins from the rounds at its repetitions on (only the first
    warm-up rounds' spins follow a JIT on the host), and the same figures. Without settle's flush, A's dirty
    lines are paid inside B's timed rounds, and B's figure depends on A."""
    (alone, log_alone), (after, log_after) = _process(False), _process(True)
    assert log_alone[0] == log_after[0] == ("settle",)
    assert [op for op in log_alone if op[0] == "run"] == [op for op in log_after if op[0] == "run"]
    spins = [[op[1] for op in log if op[0] == "spin"][1 + WARMUP:] for log in (log_alone, log_after)]
    assert spins[1] == pytest.approx(spins[0], rel=1e-6)  # up to the host clock's float rounding
    assert len(set(spins[0][WARMUP_REPS:])) == 1  # the held spin of the timed rounds
    assert alone.extra_info["reps"] == after.extra_info["reps"] == 64
    assert after.times == pytest.approx(alone.times, rel=1e-3)
    (plain, _), (polluted, _) = _process(False, settle=False), _process(True, settle=False)
    assert statistics.median(polluted.times) > 1.5 * statistics.median(plain.times)


def test_a_repetition_never_accumulates_into_the_previous_ones_gradients():
    """A round's repetitions may reuse an input set: fwd+bwd drops the gradients it would accumulate into, on
    the host, so repeating it leaves what one call leaves."""
    case = component_case(TINY, Run(2, 8, "amp"), "efficient", "mlp", "cpu")
    (inputs, grad), _ = case.setup()
    case.fwd_bwd(inputs, grad)
    once = [p.grad.clone() for p in case.module.parameters()] + [inputs[0].grad.clone()]
    case.fwd_bwd(inputs, grad)
    twice = [p.grad for p in case.module.parameters()] + [inputs[0].grad]
    assert all(torch.equal(a, b) for a, b in zip(once, twice))


def test_repetitions_halve_until_a_round_is_queued():
    """A fake GPU that queues 200 pending kernels: while it spins, the host's 201st launch waits for the spin to
    end, so a round of 64 repetitions of a 10-kernel, 18 us step is never queued behind its spin. bench() halves
    the repetitions to 16 (160 launches a round), whose rounds are all queued, and times the step there."""
    fake, clock = FakeGPU(queue=200), [0.0]

    def step():
        for _ in range(10):
            fake.run(1.8e-6, 5e-6)

    stub, _ = _bench_on(fake, clock, step)
    assert stub.extra_info["reps"] == 16 and stub.extra_info["queued_rounds"] == 1.0
    assert statistics.median(stub.times) == pytest.approx(18e-6)
