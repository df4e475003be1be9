"""The optimizer step's kernels as the timing model counts them (anatomy/calculator/timing/kernels.py:
optimizer_kernels), against AdEMAMix's loop and foreach form run op by op on CPU."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from anatomy.config import ModelConfig, Run
from anatomy.models import build_model
from anatomy.optim import AdEMAMix, FusedAdEMAMix

tk = importlib.import_module("anatomy.calculator.timing.kernels")  # the module, not timing's kernels()


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
def test_optimizer_step_time_on_this_gpu(cuda_device, impl, claims):
    """One optimizer step of anchor-1b's parameters (fp32, amp's master weights) on an idle GPU, host sync to
    host sync, against estimate_time's optimizer segment for the same implementation on the committed H200
    profile (anatomy/calculator/profiles/h200.json): ±15%, the per-component bound of the timing claims."""
    import statistics
    import time

    from anatomy.calculator.timing import estimate_time

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
    predicted = estimate_time(cfg, run, variant, "h200-measured", optimizer=impl, with_kernels=False)["optimizer_s"]
    claims.check("optimizer step time", component="optimizer", config=cfg.name, variant=impl, predicted=predicted,
                 measured=measured, tolerance=0.15, device="cuda", unit="s",
                 note=f"{torch.cuda.get_device_name(0)}, median of 10 steps")
