"""GPU benchmarks of each fused kernel, SDPA and each optimizer step alone, gated on GPU time.

  test_kernel     rms_norm, swiglu, gpt_oss (the gpt-oss swiglu variant), rope_qkv, attention (SDPA,
                  the model's backend choice): forward and backward; linear_ce (our fused linear
                  cross-entropy, whose forward computes the gradients): forward+backward.
  test_optimizer  one step of torch's fused AdamW and of llm_anatomy.optim's AdEMAMix and FusedAdEMAMix.
Each at the seed shape and a wide one (validations/bench_kernels.py). ids: <kernel>/<shape>/<phase>,
e.g. test_kernel[rms_norm/seed/bwd], test_optimizer[fused_ademamix/wide/step]. The harness, the
timer and the slowdown are validations/test_benchmarks.py's; docs/benchmarks.md has the commands.
CPU part: each case runs on CPU at small shapes and does what its phase says.
"""
from __future__ import annotations

import pytest
import torch

from validations.bench_harness import bench
from validations.bench_kernels import KERNEL_PHASES, KERNEL_SHAPES, OPTIMIZERS, kernel_case, optimizer_case
from validations.gpu_clock import gpu_time
from validations.test_benchmarks import env_info

KERNEL_IDS = [pytest.param(k, s, p, id=f"{k}/{s}/{p}") for k, phs in KERNEL_PHASES.items() for s in KERNEL_SHAPES
              for p in phs]
# the compiled step compiles once per shape (~7-25 s on an H200's host): slow, out of --quick
OPTIMIZER_IDS = [pytest.param(o, s, id=f"{o}/{s}/step", marks=[pytest.mark.slow] if o == "fused_ademamix" else [])
                 for o in OPTIMIZERS for s in KERNEL_SHAPES]


@pytest.mark.gpu
@pytest.mark.benchmark(timer=gpu_time)
@pytest.mark.parametrize("kernel,shape,phase", KERNEL_IDS)
def test_kernel(benchmark, free_cuda, gpu_refs, slowdown, kernel, shape, phase):
    setup, work, info = kernel_case(kernel, shape, phase, "cuda")
    benchmark.group = f"kernel/{kernel}/{phase}"
    benchmark.extra_info.update(env_info(), **info)
    bench(benchmark, work, setup, refs=gpu_refs, slowdown=slowdown)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=gpu_time)
@pytest.mark.parametrize("optimizer,shape", OPTIMIZER_IDS)
def test_optimizer(benchmark, free_cuda, gpu_refs, slowdown, optimizer, shape):
    setup, work, info = optimizer_case(optimizer, shape, "cuda")
    benchmark.group = f"optimizer/{shape}/step"
    benchmark.extra_info.update(env_info(), **info)
    bench(benchmark, work, setup, refs=gpu_refs, slowdown=slowdown)


# ---- CPU: the cases run and do what their phase says ------------------------------------------------
TINY = {"t": dict(M=64, N=32, I=48, B=2, S=16, H=4, KV=2, D=8, T=64, V=100)}


@pytest.mark.parametrize("kernel,phase", [(k, p) for k, phs in KERNEL_PHASES.items() for p in phs])
def test_kernel_case_runs(kernel, phase):
    """fwd builds a graph and leaves no gradient; bwd returns a nonzero gradient for every input and
    leaves .grad alone; fwd+bwd leaves a nonzero .grad on every input. Input sets rotate (>= 2)."""
    setup, work, info = kernel_case(kernel, "t", phase, "cpu", shapes=TINY)
    assert info["input_sets"] >= 2
    args, kw = setup()
    out = work(*args, **kw)
    if phase == "bwd":
        outs, xs, _ = args
        assert all(o.grad_fn is not None for o in outs) and len(out) == len(xs)
        assert all(g is not None and g.abs().sum() > 0 for g in out) and all(x.grad is None for x in xs)
    else:
        xs = args[1]
        assert all(o.grad_fn is not None for o in (out if isinstance(out, tuple) else (out,)))
        assert all((x.grad is not None and x.grad.abs().sum() > 0) == (phase == "fwd+bwd") for x in xs)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_case_steps(optimizer, monkeypatch):
    """One step changes every parameter (a real update over fp32 params with random gradients)."""
    import validations.bench_kernels as bk

    monkeypatch.setattr(bk, "_param_shapes", lambda shape: [(8, 4), (4,)])
    setup, work, info = optimizer_case(optimizer, "seed", "cpu")
    params = [p for group in work.__self__.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    args, kw = setup()
    work(*args, **kw)
    assert info["tensors"] == 2 and all(not torch.equal(a, p) for a, p in zip(before, params))


def test_the_optimizer_mode_probe_reads_kernels_and_refuses_without_a_gpu(tmp_path, capsys):
    """scripts/probe_optimizer_modes.py: the kernels of a Chrome trace in start order, their summed duration and
    the GPU's idle time between them; bad arguments and a machine without a GPU are one line each, exit 2."""

    from scripts import probe_optimizer_modes as probe

    trace = {"traceEvents": [dict(cat="kernel", ts=10.0, dur=2.0), dict(cat="cpu_op", ts=0.0, dur=50.0),
                             dict(cat="kernel", ts=0.0, dur=3.0), dict(cat="kernel", ts=5.0, dur=1.0)]}
    ks = probe.kernel_list(trace)
    assert ks == [(0.0, 3.0), (5.0, 1.0), (10.0, 2.0)] and probe.busy_and_idle(ks) == (6.0, 6.0)
    assert probe.busy_and_idle([]) == (0.0, 0.0)
    assert probe.main(["--out", str(tmp_path / "m.json"), "--cases", "0"]) == 2
    assert capsys.readouterr().err.strip() == \
        "probe_optimizer_modes: error: --processes and --cases must be at least 1"
    if not torch.cuda.is_available():
        assert probe.main(["--out", str(tmp_path / "m.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "probe_optimizer_modes: error: needs a CUDA GPU; this machine has none"
