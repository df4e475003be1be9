"""anatomy calibrate's host figures: what the CPU spends issuing a step's work (no calculator import).

  host_op_us      CPU µs per eager op recording autograd (1-element tensors: the GPU is idle)
  host_custom_us  CPU µs per call of our custom ops (rms_norm, swiglu, rope_qkv), fwd and bwd, and of
                  Liger's fused linear CE as the efficient model calls it: per call (forward, backward)
                  and per chunk of its Python loop (liger_ce.chunk)
  host_step       a tiny training step of each variant, so small that the host's issue time bounds it,
                  timed as scripts/probe_timing.py times its unmarked steps (timeline._plain_steps: CUDA
                  events around forward + backward, AdamW between steps): what an op costs the host
                  inside a model.
  optimizer_host  the compiled AdEMAMix step (FusedAdEMAMix(compile=True)) at several tensor counts, host
                  sync to host sync less its kernels' GPU time: the host time the GPU waits for, before the
                  step's first kernel (the step's Python per parameter, Dynamo's guards over every tensor
                  argument, AOTAutograd's and Inductor's wrappers). The calculator fits call + tensor x n to
                  it (timing/fit.py: optimizer_host_fit).

Why Liger's loop is measured in place: its per-chunk Python (slices, an autocast matmul, a Triton
launch with 25 keyword arguments, two more matmuls and a copy) cost 137-170 µs a chunk on the H200
host and its fixed part ~0.9 ms a call, against 6 and 9 eager ops (57 and 85 µs) in the op-count
model (scripts/probe_host_parts.py).
"""
from __future__ import annotations

import math
import statistics
import time

from llm_anatomy.kernel_shapes import chunk_rows

# loss_impl: the efficient model's default loss, which setup_step builds (the calculator rebuilds the step's
# kernels from this record: timing.host_scale)
HOST_STEP = dict(cfg=dict(name="host-step", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=2048),
                 batch=2, seq=64, dtype="amp", loss_impl="anatomy")
# Liger's chunk count is ceil(V / H) here (tokens 128, hidden 256: liger_chunks), GPU time ~µs
LIGER_HOST = dict(tokens=128, hidden=256, vocabs=(256, 2048, 4096, 8192))  # 1, 8, 16 and 32 chunks


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, n: int) -> float:
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    wall = time.perf_counter() - t
    torch.cuda.synchronize()
    return wall / n * 1e6


def measure_host() -> tuple[float, dict]:
    """CPU µs per eager op (recording autograd) and per custom-op call, fwd and bwd, on tensors so
    small that the GPU finishes each kernel before the CPU issues the next."""
    import torch

    from llm_anatomy.kernels import rms_norm, rope_qkv, swiglu

    x = torch.randn(8, device="cuda", requires_grad=True)
    op_us = _host_us(lambda: x * 1.0, 2000)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    H, nh, hd = 512, 8, 64
    xs = torch.randn(8, H, **bf, requires_grad=True)
    w = torch.ones(H, **bf, requires_grad=True)
    g_, u_ = (torch.randn(8, 1024, **bf, requires_grad=True) for _ in range(2))
    qkv = torch.randn(1, 8, 3 * H, **bf, requires_grad=True)
    cos, sin = torch.ones(8, hd, device="cuda"), torch.zeros(8, hd, device="cuda")
    calls = {"rms_norm": lambda: rms_norm(xs, w, 1e-5), "swiglu": lambda: swiglu(g_, u_, "swiglu", False),
             "rope_qkv": lambda: rope_qkv(qkv, cos, sin, nh, nh)}
    n = 32  # calls per graph: one backward() over all of them, as a step's one backward runs many nodes
    out = {}
    for name, f0 in calls.items():
        def f(f0=f0):  # as in the training step: under bf16 autocast (its dispatch layer costs host time)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = [f0() for _ in range(n)]
            return [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]

        fwd = _host_us(f, 20) / n
        grads = [torch.ones_like(t) for t in f()]

        def both():
            torch.autograd.backward(f(), grads)
        both_us = _host_us(both, 20) / n
        out[name] = dict(forward=fwd, backward=both_us - fwd)  # not positive: drop_unmeasured drops it
    out["source"] = ("measured by anatomy calibrate (CPU time per call, tiny tensors; our ops: 32 calls per graph and "
                     "one backward over them, bwd = fwd+bwd - fwd; liger_ce: whole calls at 1, 8, 16 and 32 chunks, "
                     "in blocks beside the tiny host step, as the median of their ratios to it (measure_host_step))")
    return op_us, out


def liger_chunks(tokens: int, hidden: int, vocab: int) -> int:
    """The chunks of Liger's forward loop (kernel_shapes.chunk_rows: Liger's own chunk rule)."""
    return -(-tokens // chunk_rows(tokens, hidden, vocab))


def liger_fit(chunks: list[int], fwd_us: list[float], bwd_us: list[float]) -> dict:
    """Liger's host figures from the median call at each chunk count: chunk, the least-squares slope of the
    forward call over the chunk count; forward, the median call less its chunks; backward, the mean. No
    figure is clamped: a slope <= 0 says the calls did not run Liger's loop, and drop_unmeasured keeps it
    out of the profile, loudly."""
    chunk = statistics.linear_regression(chunks, fwd_us).slope
    return dict(forward=statistics.median(f - n * chunk for f, n in zip(fwd_us, chunks)), chunk=chunk,
                backward=statistics.mean(bwd_us), calls_us=dict(zip(map(str, chunks), fwd_us)))


def measure_liger_host(reps: int = 20, vocabs: tuple[int, ...] = LIGER_HOST["vocabs"],
                       device: str = "cuda") -> dict | None:
    """Liger's fused linear CE through llm_anatomy.efficient.loss as the model calls it with loss_impl="liger" (bf16
    autocast, bf16 input, fp32 weight), at 1, 8, 16 and 32 chunks of tiny rows: liger_fit's {forward, chunk,
    backward} µs. Each call starts on a drained GPU and is timed on the host clock until it returns (its own
    .item() and torch.equal syncs wait for µs of GPU work). None without liger-kernel."""
    import importlib.util

    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from llm_anatomy.efficient import loss

    T, H = LIGER_HOST["tokens"], LIGER_HOST["hidden"]
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, min(vocabs), (T,), device=device)
    ws = [(torch.randn(V, H, device=device) * 0.02).requires_grad_() for V in vocabs]
    f_us, b_us = [[] for _ in ws], [[] for _ in ws]
    for i in range(reps + 3):  # the chunk counts alternate, so a drift of the host falls on all of them
        for j, w in enumerate(ws):
            _sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16):
                out = loss.linear_ce(x, w, t, impl="liger")  # Liger's, not the default (ours: no chunk loop here)
            t1 = time.perf_counter()
            out.backward()
            t2 = time.perf_counter()
            _sync(device)
            if i >= 3:
                f_us[j].append((t1 - t0) * 1e6)
                b_us[j].append((t2 - t1) * 1e6)
            x.grad = w.grad = None
    return liger_fit([liger_chunks(T, H, V) for V in vocabs], [statistics.median(f) for f in f_us],
                     [statistics.median(b) for b in b_us])


def drop_unmeasured(host_custom_us: dict) -> list[str]:
    """Remove, in place, every per-call figure that is not a finite time > 0 (a backward measured as the
    difference of two noisy times, a per-chunk slope that saw no loop) and return one line per figure
    removed. The calculator counts a missing figure as eager ops (timing/host.py: host_seconds), so a profile
    without it is complete; calibrate prints each line and keeps them in the provenance."""
    out = []
    for op, v in host_custom_us.items():
        if not isinstance(v, dict):
            continue
        for ph in [ph for ph, us in v.items() if isinstance(us, (int, float))]:
            if not (math.isfinite(v[ph]) and v[ph] > 0):
                out.append(f"host_custom_us.{op}.{ph} measured {v.pop(ph):.3g} us, not a time > 0: left out of the "
                           "profile (the calculator counts that part as eager ops)")
    return out


class HostStep:
    """HOST_STEP's tiny model of each variant, set up once and warmed: `times(variant, n)` runs n of its
    unmarked steps back to back, timed as the probe times its rows (timeline._plain_steps: CUDA events
    around forward + backward, AdamW between steps), and returns their forward + backward ms. The probe
    keeps one alive and times it beside each row (`host_ref`): the host's speed in that process then."""

    def __init__(self, warmup: int = 4, device: str = "cuda"):
        from llm_anatomy.config import ModelConfig, Run
        from llm_anatomy.measure.memory import setup_step
        from llm_anatomy.measure.timeline import _Clock, _plain_steps

        self.cfg = ModelConfig(**HOST_STEP["cfg"])
        self.run = Run(HOST_STEP["batch"], HOST_STEP["seq"], HOST_STEP["dtype"], loss_impl=HOST_STEP["loss_impl"])
        self.device, self.clock, self._steps = device, _Clock(device), _plain_steps
        self.setups = {v: setup_step(self.cfg, self.run, v, "adamw", device) for v in ("baseline", "efficient")}
        for v in self.setups:
            self._steps(*self.setups[v], self.run, warmup, self.clock, device)

    def times(self, variant: str, n: int) -> list[float]:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        stamps = self._steps(*self.setups[variant], self.run, n, self.clock, self.device)
        self.clock.sync()
        return [self.clock.ms(a, m) for a, m, _ in stamps]

    def reference(self, variant: str, blocks: int = 2, steps: int = 8) -> float:
        """Median forward + backward ms over `blocks` x `steps` steps of `variant`'s tiny model."""
        return statistics.median(t for _ in range(blocks) for t in self.times(variant, steps))

    def close(self) -> None:
        import torch

        self.setups.clear()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def measure_host_step(blocks: int = 4, steps: int = 8, warmup: int = 4, liger_blocks: int = 0) -> dict:
    """HOST_STEP's tiny model, per variant: the forward + backward ms of unmarked steps timed as the
    probe times them (the median over blocks x steps, the variants' blocks interleaved).

    With liger_blocks, also Liger's host figures (out["liger_ce"], measure_liger_host), each block right
    after a block of the efficient tiny step: every figure is the median of its ratios to the step beside
    it, times the efficient step's median. Why: one block's per-chunk figure moves by 2x within one
    process, while its ratio to the step beside it holds to ~10%; a host figure is read at a row's host
    speed as its ratio to this step (timing.at_host_speed), so it is measured as one."""
    hs, out = HostStep(warmup), dict(HOST_STEP)
    fbs = {v: [] for v in hs.setups}
    pairs = []
    for i in range(max(blocks, liger_blocks)):
        for variant, fb in fbs.items():
            t = hs.times(variant, steps)
            if i < blocks:
                fb.extend(t)
            if variant == "efficient" and i < liger_blocks and (lg := measure_liger_host()):
                pairs.append((statistics.median(t), lg))
    for variant, fb in fbs.items():
        out[variant] = dict(forward_backward_ms=statistics.median(fb), p10_ms=sorted(fb)[len(fb) // 10],
                            p90_ms=sorted(fb)[9 * len(fb) // 10])
    if pairs:
        out["liger_ce"] = liger_from_blocks(pairs, out["efficient"]["forward_backward_ms"])
    hs.close()
    return out


def liger_from_blocks(pairs: list[tuple[float, dict]], step_ms: float) -> dict:
    """Liger's host figures from (tiny step ms, measure_liger_host's figures) pairs, one per block: each the
    median of its ratios to the step beside it, times step_ms (the efficient tiny step's median); the blocks
    themselves are kept under "blocks"."""
    keys = ("forward", "chunk", "backward")
    out = {k: statistics.median(lg[k] / ref for ref, lg in pairs) * step_ms for k in keys}
    out["blocks"] = [dict(step_ms=ref, **{k: lg[k] for k in keys}) for ref, lg in pairs]
    return out


# tensor counts of the compiled optimizer step's host time: around a real model's list (anchor-1b: 99 tensors)
OPTIMIZER_HOST_TENSORS = (8, 32, 128)
# elements per tensor there, on a GPU: 36 B each per step is ~36 µs of kernel per tensor on an H200, longer than
# a launch, so the GPU never waits for the launches after the first kernel (128 tensors: 10.7 GB of state)
OPTIMIZER_HOST_NUMEL = 1 << 22


def compiled_ademamix(params):
    """The optimizer `--optimizer ademamix-compiled` runs (llm_anatomy.optim.FusedAdEMAMix(compile=True))."""
    from llm_anatomy.optim import FusedAdEMAMix

    return FusedAdEMAMix(params, lr=1e-4, weight_decay=0.1, T_alpha_beta3=10_000, compile=True)


def _queued_gpu_us(step) -> float:
    """GPU µs of one step(), alone behind a spin that outlasts its host time (a step's host time is ms: back
    to back, later steps would wait for the host)."""
    from llm_anatomy.measure.calibrate_kernels import queued_ms

    return queued_ms(step, reps=1, warmup=0)[0] * 1e3


def measure_optimizer_host(counts: tuple[int, ...] = OPTIMIZER_HOST_TENSORS, reps: int = 30, warmup: int = 3,
                           device: str = "cuda", make=compiled_ademamix, deadline: float | None = None,
                           numel: int | None = None, gpu_us=None) -> dict:
    """{"rows": [{tensors, numel, us, p10_us, p90_us, wall_us, gpu_us}]}: the host time one optimizer step
    (`make(params)`) exposes over `tensors` parameters of `numel` elements each. wall_us: the step on the host
    clock from a drained GPU until the GPU has drained again, as validations/test_optim_kernels.py times it;
    gpu_us: its kernels alone (`gpu_us(step)`; on CUDA by default queued behind a spin, on CPU none); us =
    wall - gpu (medians; p10/p90 of wall less the gpu median). What is left is what the GPU waited for: the
    host's time before the step's first kernel (its Python per parameter, Dynamo's guards, AOTAutograd's and
    Inductor's wrappers). At OPTIMIZER_HOST_NUMEL elements each kernel outlasts the next launch, so the later
    launches run beside the GPU's work, as they do over a model's tensors; at 1 element the GPU also waits
    for every launch, and the figure is the whole call's, as it is on CPU (numel 1, no GPU time). Each count
    compiles its own graph (torch._dynamo.reset() first: one cache entry, as a training process has). Counts
    past `deadline` (time.monotonic()) are left out."""
    import torch

    numel = numel or (OPTIMIZER_HOST_NUMEL if device == "cuda" else 1)
    gpu_us = gpu_us or (_queued_gpu_us if device == "cuda" else None)
    rows = []
    for n in counts:
        if deadline is not None and time.monotonic() > deadline:
            break
        torch._dynamo.reset()
        params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(n)]  # a model's, as guarded
        for p in params:
            p.grad = torch.randn_like(p) if numel > 1 else torch.ones_like(p)  # never step on zeros
        opt = make(params)
        for _ in range(warmup):  # the state, and the compile
            opt.step()
        walls, gpus = [], []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            walls.append((time.perf_counter() - t0) * 1e6)
            if gpu_us is not None:
                gpus.append(gpu_us(opt.step))
        gpu = statistics.median(gpus) if gpus else 0.0
        ts = sorted(w - gpu for w in walls)
        rows.append(dict(tensors=n, numel=numel, us=statistics.median(ts), p10_us=ts[len(ts) // 10],
                         p90_us=ts[9 * len(ts) // 10], wall_us=statistics.median(walls), gpu_us=gpu))
        del opt, params
    torch._dynamo.reset()
    return dict(rows=rows)
