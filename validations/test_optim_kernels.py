"""The optimizer step's kernels as the timing model counts them (llm_anatomy/calculator/timing/kernels.py:
optimizer_kernels), against AdEMAMix's loop and foreach form run op by op on CPU, and its compiled form as
Inductor writes it (one kernel launch per tensor group, one pass); the compiled step's rate is calibrated
(calibrate_kernels.ademamix_case), not the copy bandwidth."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.models import build_model
from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix

tk = importlib.import_module("llm_anatomy.calculator.timing.kernels")  # the module, not timing's kernels()


class _OpBytes(TorchDispatchMode):
    """The ops that touch a tensor of at least `big` elements, and the bytes each reads and writes: its
    tensor arguments, and what it writes (an in-place op's first argument, else its outputs; copy_
    writes its destination without reading it). Small tensors (the per-step scalars) are left out."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.ops, self.bytes = big, 0, 0

    def _big(self, xs):
        return [t for t in tree_flatten(xs)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.big]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        read = self._big((args[1:], kwargs) if name in ("copy_", "_foreach_copy_") else (args, kwargs))
        if read:
            self.ops += 1
            self.bytes += sum(t.nbytes for t in read + self._big(args[0] if name.endswith("_") else out))
        return out


@pytest.mark.parametrize("impl", ["ademamix-loop", "ademamix-foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_eager_step_ops_and_bytes_match_the_timing_model(impl, dtype, variant, claims):
    """A step after the first of AdEMAMix's loop (AdEMAMix) and its foreach form (FusedAdEMAMix, eager)
    over a model's parameters: the ops the timing model launches (calculator/timing/kernels.py:
    optimizer_kernels; a foreach op counted once, its CUDA launches per list aside) and the bytes it
    moves (optimizer_step_bytes), exactly."""
    cfg = ModelConfig(name="opt", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=128)
    run = Run(2, 16, "bf16" if dtype == torch.bfloat16 else "fp32")
    params = list(build_model(cfg, variant, dtype=dtype).parameters())
    opt = AdEMAMix(params, weight_decay=0.1) if impl == "ademamix-loop" else FusedAdEMAMix(params, weight_decay=0.1,
                                                                                           compile=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step makes the state
    sizes = tk.param_sizes(cfg, variant)
    with _OpBytes(min(sizes)) as seen:
        opt.step()
    ks = tk.optimizer_kernels(cfg, run, variant, impl)
    if impl == "ademamix-foreach":  # the list's foreach ops, each once on CPU; then bf16's per-tensor casts
        assert seen.ops == ks[0].count // tk.foreach_launches(sizes) + sum(k.count for k in ks[1:])
    else:
        assert seen.ops == sum(k.count for k in ks)
    pb = dtype.itemsize
    claims.check("optimizer step bytes", component="optimizer", config="opt", variant=f"{impl}-{variant}-{pb}B",
                 predicted=sum(n * tk.optimizer_step_bytes(impl, numel, pb) for numel, n in sizes.items()),
                 measured=seen.bytes, tolerance=0.0, unit="B")


def _impl_optimizer(impl: str, params):
    if impl == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    if impl == "ademamix-loop":
        return AdEMAMix(params, lr=1e-4, weight_decay=0.1, T_alpha_beta3=10_000)
    return FusedAdEMAMix(params, lr=1e-4, weight_decay=0.1, T_alpha_beta3=10_000, compile=impl == "ademamix-compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["adamw", "ademamix-loop", "ademamix-foreach", "ademamix-compiled"])
def test_optimizer_step_time_on_this_gpu(cuda_device, suite_profile, gpu_refs, impl, claims):
    """One optimizer step of anchor-1b's parameters (fp32, amp's master weights) on an idle GPU, host sync to
    host sync, against estimate_time's optimizer segment for the same implementation on this GPU's own
    calibration (the session's gpu_profile: `anatomy calibrate` here, cached per GPU and software versions):
    ±15%, the per-component bound of the timing claims.

    Where the profile measured the step's call (the compiled step: a host-only wait ahead of its kernels,
    calibrate_host.measure_optimizer_host), that wait is host noise of about ±50% between machines of one
    kind and between lists in one process (docs/timing.md), so the claim is the physical pair: the kernels'
    GPU time (queued behind a spin) ±15%, and the step's wall time between the kernels' time and the kernels'
    plus the calibrated wait, each side 15% wide."""
    import statistics
    import time

    from llm_anatomy.calculator.timing import estimate_time, get
    from validations.gpu_clock import queued_median

    cfg, run = ModelConfig.from_name("anchor-1b"), Run(1, 1024)
    variant = "baseline" if impl == "ademamix-loop" else "efficient"  # the model each runs with in training
    params = list(build_model(cfg, variant, device="cuda", dtype=torch.float32).parameters())
    for p in params:
        p.grad = torch.randn_like(p)  # never time zeros
    opt = _impl_optimizer(impl, params)
    for _ in range(3):  # the state, and the compile, outside any timing
        opt.step()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    measured = statistics.median(times)
    profile, label = suite_profile
    res = estimate_time(cfg, run, variant, profile, optimizer=impl, with_kernels=False)
    predicted, kernels_s = res["optimizer_s"], res["phases"]["optimizer"]["gpu_s"]
    where = dict(component="optimizer", config=cfg.name, variant=impl, device="cuda", unit="s")
    note = f"{torch.cuda.get_device_name(0)}, median of 10 steps, profile {label}"
    if not get(profile).optimizer_host.get(impl):
        claims.check("optimizer step time", predicted=predicted, measured=measured, tolerance=0.15, note=note,
                     **where)
        return
    gpu = queued_median(opt.step, 10, cycles_per_s=gpu_refs["sleep_cycles_per_s"])
    claims.check("optimizer step time, its kernels' GPU time", predicted=kernels_s, measured=gpu, tolerance=0.15,
                 note=f"{note}, each queued behind a spin", **where)
    claims.within("optimizer step time, between its kernels and its kernels plus the calibrated wait",
                  low=0.85 * kernels_s, high=1.15 * predicted, measured=measured, note=note, **where)


# ---- the compiled step: one pass over the state, as optimizer_step_bytes counts it ------------------------------
def _kernel_calls(code: str) -> list[set[str]]:
    """The graph inputs (argN_1) each kernel launch of Inductor's wrapper `call()` passes, one set per launch
    (a Triton `name.run(...)` or a C++ `cpp_fused_...(...)`)."""
    import re

    body = code[code.index("def call("):]
    return [set(re.findall(r"\barg\d+_1\b", m.group(2)))
            for m in re.finditer(r"^\s*(\w*(?:triton|cpp_fused)\w*)(?:\.run)?\((.*)\)\s*$", body, re.M)]


def _compiled_step_code(device: str, sizes: list[int]) -> str:
    from torch._inductor.utils import run_and_get_code

    from llm_anatomy.optim.efficient import ademamix_foreach_

    torch._dynamo.reset()
    lists = [[torch.randn(n, device=device) for n in sizes] for _ in range(5)]  # p, g, m1, m2, nu
    scalars = torch.tensor([1e-4, 5.0, 0.999, 1e-3, 0.1, 0.03, 0.1], device=device)
    step = torch.compile(ademamix_foreach_, fullgraph=True, dynamic=False)  # as compiled_ademamix_foreach_
    _, codes = run_and_get_code(step, *lists, scalars, 0.9, 0.999, 1e-8)
    return "\n".join(codes)


def _assert_one_pass(code: str, tensors: int) -> None:
    """Each of the step's 5 x `tensors` tensors in exactly one kernel launch (the (7,) scalars may go to every
    launch), and no intermediate buffer allocated."""
    import re

    scalars = re.search(r"assert_size_stride\((arg\d+_1), \(7, \)", code).group(1)
    seen = [a for c in _kernel_calls(code) for a in c if a != scalars]
    assert len(set(seen)) == 5 * tensors, "a tensor of the step is passed to no kernel"
    assert len(seen) == len(set(seen)), f"{len(seen) - len(set(seen))} tensors passed to more than one kernel"
    assert "empty_strided" not in code[code.index("def call("):], "the compiled step allocates an intermediate"


@pytest.mark.slow  # Inductor compiles C++ (~30 s on 2 cores)
def test_compiled_step_is_one_pass_over_each_tensor():
    """Inductor's code for the compiled AdEMAMix step (FusedAdEMAMix(compile=True)), here on CPU: every
    parameter, gradient and state tensor is passed to one kernel launch and no intermediate buffer is made, so
    the step reads p, g, m1, m2, nu and writes p, m1, m2, nu once: the 36 B per fp32 element that
    optimizer_step_bytes counts for ademamix-compiled (test_compiled_step_is_one_pass_on_this_gpu checks the
    CUDA code)."""
    sizes = [1000 * 64, 64]
    _assert_one_pass(_compiled_step_code("cpu", sizes), len(sizes))
    assert all(tk.optimizer_step_bytes("ademamix-compiled", n) == 36 * n for n in sizes)


@pytest.mark.gpu
@pytest.mark.slow  # Inductor compiles a 99-tensor step (~25 s on an H200's host)
def test_compiled_step_is_one_pass_on_this_gpu(cuda_device):
    """The same on CUDA, over anchor-1b's parameter sizes (99 tensors: Inductor's foreach kernels group them
    into launches of several tensors each, each tensor still in one launch)."""
    sizes = [n for n, k in tk.param_sizes(ModelConfig.from_name("anchor-1b"), "efficient").items() for _ in range(k)]
    _assert_one_pass(_compiled_step_code("cuda", sizes), len(sizes))


def test_compiled_step_takes_its_calibrated_rate():
    """Fake timings (not a measurement) of the compiled step at calibrate's sizes (calibrate_kernels.ademamix_case)
    at 50% of the copy bandwidth: every ademamix-compiled kernel takes its one pass's bytes at that rate, the loop
    and foreach forms (their own ops' bytes) and fused AdamW (not timed here) stay as they were."""
    from llm_anatomy.calculator.timing import estimate_time, fit
    from llm_anatomy.calculator.timing.op_bytes import fused_bytes
    from llm_anatomy.measure import calibrate
    from llm_anatomy.measure.calibrate_kernels import ADAMW_NUMELS, ADAMW_TENSORS, _fused_cases
    from validations.test_calibrate import _fake_measurements

    assert [(op, w) for op, w, *_ in _fused_cases() if op == "optimizer.ademamix"] == \
        [("optimizer.ademamix", n) for n in ADAMW_NUMELS]
    hbm, frac = 4.0e12, 0.5
    fused = [dict(op="optimizer.ademamix", tokens=ADAMW_TENSORS, width=n, queued=True,
                  ms=(sum(fused_bytes("optimizer.ademamix", n, ADAMW_TENSORS)) / hbm / frac + 2.2e-6) * 1e3)
             for n in ADAMW_NUMELS]
    p, p0 = (fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), copy_tbps=hbm / 1e12, **f),
                                                            dict(date="fake"), "h200-sxm")).replace(sustained_ratio={})
             for f in (dict(fused=fused), {}))
    cfg, run = ModelConfig(name="o", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=32000), Run(2, 2048)
    for impl, f in (("ademamix-compiled", frac), ("ademamix-foreach", 1.0), ("adamw", 1.0)):
        a, b = (estimate_time(cfg, run, "efficient", q, optimizer=impl, with_kernels=True) for q in (p, p0))
        ka, kb = ([k for k in r["kernels"] if k["phase"] == "optimizer"] for r in (a, b))
        assert len(ka) == len(kb) > 0
        for x, y in zip(ka, kb):
            assert x["memory_s"] == pytest.approx(y["memory_s"] / f, rel=1e-9), (impl, x["name"])


def test_compiled_step_host_is_its_calibrated_call():
    """Fake host figures (not a measurement) for the compiled step's call: one host-only entry before its kernels
    costs call_s + tensor_s x the model's tensors, the GPU waits for it (the optimizer's time grows by exactly
    tensor_s per tensor, at any depth), and its launches cost nothing more. Without the figures (today's
    committed profile) the step is priced as before: an eager op per launch, and the call costs nothing.
    The loop, foreach and AdamW steps do not read the figures."""
    from llm_anatomy.calculator.timing import estimate_time, get

    p0 = get("h200-measured").replace(sustained_ratio={}, optimizer_host={})
    fake = lambda a, b: p0.replace(optimizer_host={"ademamix-compiled": dict(call_s=a, tensor_s=b)})  # noqa: E731
    a, b, db = 1.0e-3, 40e-6, 7e-6
    run = Run(1, 1024)
    for layers in (2, 16):
        cfg = ModelConfig(name="o", hidden=2048, layers=layers, heads=16, kv_heads=8, intermediate=5632, vocab=32000)
        n = sum(tk.param_sizes(cfg, "efficient").values())
        r0, r1, r2 = (estimate_time(cfg, run, "efficient", q, optimizer="ademamix-compiled", with_kernels=True)
                      for q in (p0, fake(a, b), fake(a, b + db)))
        call = [k for k in r1["kernels"] if k["name"] == "optimizer.ademamix_compiled.call"]
        assert len(call) == 1 and call[0]["host_s"] == pytest.approx(a + b * n) and call[0]["time_s"] == 0
        assert r2["optimizer_s"] - r1["optimizer_s"] == pytest.approx(db * n, rel=1e-9)
        assert r1["optimizer_s"] == pytest.approx(a + b * n + r1["phases"]["optimizer"]["gpu_s"], rel=1e-9)
        assert r1["phases"]["optimizer"]["host_s"] == pytest.approx(a + b * n)
        assert r1["phases"]["optimizer"]["kernels"] == r0["phases"]["optimizer"]["kernels"] == n  # a launch per tensor
        launches = [k for k in r0["kernels"] if k["phase"] == "optimizer" and k["name"] != call[0]["name"]]
        assert all(k["host_s"] == pytest.approx(k["count"] * p0.host_op_s) for k in launches)
        assert r0["phases"]["optimizer"]["host_s"] == pytest.approx(n * p0.host_op_s)
        for impl, v in (("adamw", "efficient"), ("ademamix-foreach", "efficient"), ("ademamix-loop", "baseline")):
            x, y = (estimate_time(cfg, run, v, q, optimizer=impl, with_kernels=False)["optimizer_s"]
                    for q in (p0, fake(a, b)))
            assert x == y, impl


def test_host_probe_refuses_without_a_gpu(capsys):
    """scripts/probe_optimizer_host.py (the compiled step's host time against its GPU time, docs/timing.md) says
    in one line that it needs a GPU, exit 2; bad arguments likewise, before any GPU work."""
    from scripts import probe_optimizer_host as probe
    if torch.cuda.is_available():
        assert probe.main(["--reps", "1"]) == 2 and "--reps must be at least 3" in capsys.readouterr().err
        assert probe.main(["--config", "no-such-model"]) == 2
    else:
        assert probe.main([]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs a CUDA GPU" in err
