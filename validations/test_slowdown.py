"""ANATOMY_SLOWDOWN (validations/slowdown.py): the strict parser, the usage error, the calibrated spin
on a fake GPU, and the wrapping of every target (CPU)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from validations.bench_harness import WARMUP_REPS, bench
from validations.bench_kernels import KERNEL_PHASES
from validations.fake_gpu import REFS, BenchStub, FakeGPU
from validations.slowdown import ENV, TARGETS, Slowdown, parse

ROOT = Path(__file__).resolve().parent.parent
TINY = {"t": dict(M=64, N=32, I=48, B=2, S=16, H=4, KV=2, D=8, T=64, V=100)}


def test_slowdown_parser_is_strict():
    assert parse("") == {} and parse("  ") == {}
    assert parse("rms_norm=1.15, attention=1.075") == {"rms_norm": 1.15, "attention": 1.075}
    for bad in ("rms_norm", "rms_norm:1.2", "rmsnorm=1.2", "norm=1.2", "rms_norm=1", "rms_norm=0.9",
                "rms_norm=x", "rms_norm=inf", "rms_norm=nan", "rms_norm=1.1,,swiglu=1.1", "rms_norm=1.1,rms_norm=1.2"):
        with pytest.raises(ValueError, match=ENV):
            parse(bad)


@pytest.mark.slow  # ~6 s: one pytest start-up (torch and the conftest)
def test_bad_slowdown_is_a_one_line_usage_error():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "validations/test_benchmarks.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **{ENV: "rms_norm=1.2,flash=1.2"}))
    assert r.returncode == 4, r.stdout[-800:] + r.stderr[-800:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ENV in ln]
    assert len(lines) == 1 and "bad item 'flash=1.2'" in lines[0] and "Traceback" not in r.stderr


def test_slowdown_adds_its_factor_of_the_kernels_own_gpu_time():
    """A target that costs 1 ms of GPU time per call, called twice a round beside 3 ms of other work:
    the spin after each call adds (factor - 1) x 1 ms (the extra launch included), so the round grows by
    exactly 2 x 0.3 ms and the recorded injected fraction is factor - 1; before calibrate() nothing is
    timed or added, and a call shape not seen in calibration is an error, not a silent pass."""
    from types import SimpleNamespace

    fake, clock = FakeGPU(launch_s=2e-5), [0.0]
    ns = SimpleNamespace(kernel=lambda x: fake.run(0.001, 1e-5))
    orig = ns.kernel
    sd = Slowdown({"rms_norm": 1.3}, rate=fake.rate, launch_s=fake.launch_s, event=fake.event, sleep=fake.sleep)
    sd._wrap(ns, "kernel", [("rms_norm", None)])
    x = torch.zeros(4, 8)

    def work():
        ns.kernel(x)
        fake.run(0.003)
        ns.kernel(x)

    medians = {}
    ns.kernel(x)  # as a component's capture forward does before its benchmark
    for name, s in (("plain", None), ("slowed", sd)):
        stub = BenchStub(lambda: clock[0])
        bench(stub, work, lambda: ((), {}), refs=dict(REFS, sleep_cycles_per_s=fake.rate), rounds=5, warmup=2,
              slowdown=s, make_round=lambda w: fake.round(w, clock), sync=lambda: None, settle=fake.settle)
        medians[name] = statistics.median(stub.times)
    assert medians["plain"] == pytest.approx(0.005) and medians["slowed"] == pytest.approx(0.0056)
    assert stub.extra_info["slowdown_injected"] == {"rms_norm": [pytest.approx(0.3)]}
    # calls inside the work, 2 a round: warm-up, warm-up at the chosen repetitions, calibration and timed rounds
    # (recorded before the wall rounds); the call outside the work, before bench(), is not counted
    assert stub.extra_info["slowdown_calls"] == {"rms_norm": 2 * (2 + WARMUP_REPS + Slowdown.ROUNDS + 5)}
    with pytest.raises(RuntimeError, match="not seen while calibrating"):
        ns.kernel(torch.zeros(2, 8))
    sd.uninstall()
    assert ns.kernel is orig


def test_every_slowdown_target_wraps_and_restores_and_times_sdpas_backward():
    """install() wraps each target's callables where the kernels' modules look them up, uninstall()
    restores them; SDPA's backward, which autograd runs, is timed through hooks on its node."""
    import importlib

    fake = FakeGPU()
    before = {}
    for target, spots in TARGETS.items():
        for mod, attr, _ in spots:
            owner = importlib.import_module(mod)
            for p in attr.split(".")[:-1]:
                owner = getattr(owner, p)
            before[(mod, attr)] = (owner, attr.split(".")[-1], getattr(owner, attr.split(".")[-1]))
    sd = Slowdown({t: 1.2 for t in TARGETS}, rate=fake.rate, launch_s=0.0, event=fake.event, sleep=fake.sleep).install()
    try:
        for owner, name, orig in before.values():
            assert getattr(owner, name) is not orig and getattr(owner, name).__wrapped__ is orig
        sd.calibrate()
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        assert {key[0] for key, pairs in sd.samples.items() if pairs} == {"attention", "attention.bwd"}
    finally:
        sd.uninstall()
    for owner, name, orig in before.values():
        assert getattr(owner, name) is orig


@pytest.mark.parametrize("kernel,phase", [(k, p) for k, phs in KERNEL_PHASES.items() for p in phs] +
                         [(o, "step") for o in ("adamw", "fused_ademamix")])
def test_each_targets_wrapper_sits_on_its_benchmarks_path(kernel, phase):
    """The Triton launchers run on CPU under the interpreter (triton_on_cpu), so the real kernel paths
    reach the wrappers here as they do on CUDA: each kernel's own benchmark calls its target, in the
    timed work of its phase (a bwd round calls the backward launcher), and no other target."""
    from llm_anatomy.kernels import triton_on_cpu
    from validations.bench_kernels import kernel_case, optimizer_case

    fake = FakeGPU()
    sd = Slowdown({t: 1.2 for t in TARGETS}, rate=fake.rate, launch_s=0.0, event=fake.event, sleep=fake.sleep).install()
    try:
        with triton_on_cpu():
            if phase == "step":
                import validations.bench_kernels as bk

                shapes, bk._param_shapes = bk._param_shapes, lambda shape: [(8, 4), (4,)]
                try:
                    setup, work, _ = optimizer_case(kernel, "seed", "cpu")
                finally:
                    bk._param_shapes = shapes
            else:
                setup, work, _ = kernel_case(kernel, "t", phase, "cpu", shapes=TINY)
            args, kw = setup()
            before = dict(sd.calls)
            work(*args, **kw)
    finally:
        sd.uninstall()
    during = {t: n - before.get(t, 0) for t, n in sd.calls.items() if n - before.get(t, 0)}
    assert set(during) == {kernel}


def test_the_efficient_model_calls_every_kernel_target_and_the_baseline_none_of_ours():
    """Through the real model paths (Triton launchers under the interpreter): the efficient step calls
    every fused kernel's target and the AdamW step; the baseline step calls none of the fused kernels."""
    from llm_anatomy.config import Run
    from llm_anatomy.kernels import triton_on_cpu
    from validations.bench_harness import model_case
    from validations.configs import NAMED

    seen = {}
    for variant in ("efficient", "baseline"):
        fake = FakeGPU()
        sd = Slowdown({t: 1.2 for t in TARGETS}, rate=fake.rate, launch_s=0.0, event=fake.event,
                      sleep=fake.sleep).install()
        try:
            with triton_on_cpu():
                case = model_case(NAMED["tiny-gqa"], Run(2, 16, "amp"), variant, "cpu", optimizer=True)
                args, kw = case.setup()
                case.step(*args, **kw)
        finally:
            sd.uninstall()
        seen[variant] = set(sd.calls)
    assert {"rms_norm", "swiglu", "rope_qkv", "linear_ce", "attention", "adamw"} <= seen["efficient"]
    assert not seen["baseline"] & {"rms_norm", "swiglu", "gpt_oss", "rope_qkv", "linear_ce"}
