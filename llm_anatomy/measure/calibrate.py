"""anatomy calibrate: measure this GPU's timing profile (what llm_anatomy/calculator/timing.py needs) in
under two minutes, and write it as JSON, atomically.

    anatomy calibrate [--out PATH] [--base h200-sxm] [--budget-s 100]

What is measured (CUDA events after warm-up, median of several batches; operands rotated so no
timing reuses one L2-resident input):
  matmul_bf16     the GEMMs this model family launches: for the seed, anchor-1b and llama2-7b
                  shapes at 16,384 tokens, the forward (T, out, in), grad-input (T, in, out) and
                  grad-weight (out, in, T) of qkv, o, gate_up, down, and Liger's chunk GEMMs; plus
                  8192³ (the ANCHORS ceiling) and 4096³. The profile fits a rate and k_half to them.
  matmul_vocab    the LM head's three GEMMs as the model writes them (x @ W.t(), g @ W, g.t() @ x)
                  and Liger's fp32-accumulating addmm (grad_weight_acc; also at few-row chunks,
                  ACC_CHUNKS and ACC_MISALIGNED, where its epilogue or a fallback kernel bounds it),
                  at a vocab that is a multiple of 8 and at vocabs that are not (32001, 32002, 32004):
                  a bf16 row whose length is not a multiple of 8 is not 16-byte aligned, and cuBLAS
                  leaves its fastest kernels for it. The profile keeps the slowdown per case.
  attention       causal SDPA fwd and fwd+bwd per backend (cudnn, flash, memory-efficient) at head
                  dim 64 (B=16, 8 heads, S=4096: the seed) and 128 (B=4, 16 heads: anchor-1b); cuDNN
                  also at S = 1024 and 2048 (same tokens)
  attention_masked  cuDNN SDPA under an additive mask as gpt-oss calls it (calibrate_sdpa.MASKED_SHAPES)
  copy_tbps       a 2 GiB device copy, bytes read + written
  upcast_tbps     a bf16 -> fp32 cast of 1 GiB (torch's unrolled cast kernel), bytes read + written
  launch_us       GPU time per tiny kernel on a full queue (queued behind a long kernel: no host cost)
  kernel_gap      the idle time between two dependent kernels of real size (a profiled GEMM/copy chain;
                  timed last, as the profiler leaves every later launch slower)
  sustained       one GEMM, causal SDPA fwd+bwd and copy in a burst and again after a warm-up of GEMMs back
                  to back that drives the GPU to its power-limited clock, with the SM clock and power of
                  each regime and the warm-up's trace (calibrate_sustained.py; ~16 s, timed last)
  host_op_us, host_custom_us, host_step   the host's side (calibrate_host.py): CPU time per eager op,
                  per call of our custom ops and of Liger's fused linear CE (per call and per chunk),
                  and a tiny host-bound training step of each variant timed as the probe times steps
  optimizer_host  the host time the compiled AdEMAMix step exposes (wall less its kernels' GPU time) at 8,
                  32 and 128 tensors (calibrate_host.measure_optimizer_host; each count compiles, tens of
                  seconds)
  matmul_bf16_in_step  the same GEMM grid as a step runs it: each call after a copy that writes its
                  activation operand, GPU time only (calibrate_kernels.py says why); the profile
                  fits its GEMM rate to these when present
  fused           GPU time per call of our fused ops (rms_norm, swiglu, rope_qkv; fwd and bwd), the
                  fp32 + bf16 residual add, Liger's CE kernel (at 512- and 2048-row chunks, vocabs aligned
                  to 16 and not) and the eager baseline's S x S ops (scale, mask add, casts, softmax and
                  its backward, at S 1024-4096), at 16,384 rows (65,536 for widths <= 2048; 32,768 rows
                  of S for the S x S ops) and several widths; torch's fused AdamW and the compiled AdEMAMix
                  step, the eager baseline's norm, loss, SwiGLU and clamp chains, and ATen's embedding backward
                  (2048-65536 ids): the calculator turns them into bandwidth efficiencies
  grouped_mm      torch._grouped_mm at real MoE families' expert shapes (Qwen3-MoE, Mixtral, OLMoE, gpt-oss;
                  balanced routing, and Qwen3's skewed), forward and backward, GPU time only
                  (calibrate_grouped.py): the grouped kernel's fraction of the dense GEMM rate
Measurements never read the calculator; the profile is only *loaded* by it (timing/profile.py, fit.py).
On a machine without CUDA it prints one line and exits 2.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

from llm_anatomy import io
from llm_anatomy.calculator import gpus
from llm_anatomy.calculator.timing import fit, lookup, profile
from llm_anatomy.cli_args import Parser
from llm_anatomy.config import PRESETS, ConfigError
from llm_anatomy.kernel_shapes import chunk_rows
from llm_anatomy.measure.calibrate_host import drop_unmeasured, measure_host, measure_host_step, measure_optimizer_host
from llm_anatomy.measure.calibrate_grouped import measure_grouped
from llm_anatomy.measure.calibrate_kernels import measure_fused, measure_gemms_in_step, measure_kernel_gap
from llm_anatomy.measure.calibrate_sdpa import MASKED_S, measure_masked_attention, measure_sdpa_kernels, schedule_shapes
from llm_anatomy.measure.calibrate_sustained import measure_sustained

GRID_PRESETS = ("seed", "anchor-1b", "llama2-7b")
GRID_TOKENS = 16384
ATTENTION_SHAPES = ((16, 8, 4096, 64), (4, 16, 4096, 128))  # (B, heads, S, head_dim)
# the default backend again at shorter sequences, the same tokens: its rate falls with S
SEQ_SHAPES = ((64, 8, 1024, 64), (32, 8, 2048, 64), (16, 16, 1024, 128), (8, 16, 2048, 128))
BACKENDS = ("cudnn", "flash", "memory-efficient")
L2_ROTATE_BYTES = 256 * 2**20  # rotate enough operand sets to exceed the L2 (50-60 MB) several times


# ---- pure parts (unit-tested on CPU) ---------------------------------------------------------------
def gemm_grid(presets=GRID_PRESETS, tokens: int = GRID_TOKENS) -> list[tuple[int, int, int]]:
    """(m, n, k) of every GEMM a training step of these presets launches, at `tokens` tokens."""
    shapes = {(8192, 8192, 8192), (4096, 4096, 4096)}
    for name in presets:
        c = PRESETS[name]
        H, I, V = c.hidden, c.intermediate, c.vocab
        for n_out, k_in in ((H + 2 * c.kv_dim, H), (H, H), (2 * I, H), (H, I)):
            shapes |= {(tokens, n_out, k_in), (tokens, k_in, n_out), (n_out, k_in, tokens)}
        C = chunk_rows(tokens, H, V)
        shapes |= {(C, V, H), (C, H, V), (V, H, C)}
    return sorted(shapes)


VOCAB_ALIGNED, VOCAB_MISALIGNED = 32000, (32001, 32002, 32004)
VOCAB_SHAPES = ((16384, 512), (16384, 2048), (2048, 2048))  # (rows, hidden): full steps and a Liger chunk
# Liger's grad_weight at a chunk of few rows: the GEMM's K is the chunk, so its epilogue (read, add and
# write the (V, H) fp32 accumulator) is nearly all of it. Its bandwidth is not the copy's (llama3.2-1b's
# 128-row chunks move 2.1 GB per call at ~62% of it on the H200), so it is measured here.
ACC_CHUNKS = ((128, 2048), (256, 1024), (512, 2048))  # (rows, hidden) at the aligned vocab
# ... and at a misaligned vocab, where cuBLAS falls back to a slow kernel whose rate, not the epilogue,
# bounds it (V 34732, 512-row chunks: 150 TFLOP/s on the H200)
ACC_MISALIGNED = (512, 2048)
SDPA_KERNELS_S = 30.0  # seconds for SDPA's kernel schedule (14 grids, one profiled pass: a few seconds)


def vocab_grid() -> list[tuple[str, int, int, int]]:
    """(op, rows, hidden, vocab) of the head GEMMs calibrate times: forward, grad_input, grad_weight and
    Liger's fp32-accumulating grad_weight_acc."""
    return [(op, T, H, V) for T, H in VOCAB_SHAPES for V in (VOCAB_ALIGNED, *VOCAB_MISALIGNED)
            for op in ("forward", "grad_input", "grad_weight", "grad_weight_acc")] + [
        ("grad_weight_acc", T, H, VOCAB_ALIGNED) for T, H in ACC_CHUNKS] + [
        ("grad_weight_acc", *ACC_MISALIGNED, V) for V in VOCAB_MISALIGNED]


def guess_base(device_name: str) -> str | None:
    """The GPU table entry a CUDA device name belongs to (None if no entry matches)."""
    return gpus.base_for_device(device_name)


def build_profile(measurements: dict, provenance: dict, base: str) -> dict:
    """The profile JSON object; checking and fitting it (profile.check_measured, fit.from_measured) proves it
    complete."""
    data = dict(name=f"{lookup.profile_stem(base)}-measured", base=base, kind="measured", provenance=provenance,
                measurements=measurements)
    fit.from_measured(profile.check_measured(data, "calibrated profile"))  # a ConfigError if anything is malformed
    return data


def rejected_path(out: Path) -> Path:
    """Where calibrate keeps the measurements of a run whose profile failed its check (never read as a profile)."""
    return out.with_name(out.stem + ".rejected.json")


def default_out(base: str) -> Path:
    """The user's cache (`--gpu <stem>-calibrated` reads it back), never the installed package."""
    return lookup.user_profile_dir() / f"{lookup.profile_stem(base)}.json"


# ---- measurements (CUDA) ---------------------------------------------------------------------------
def _median_ms(fn, batches: int = 5, per_batch: int = 10, warmup: int = 3) -> float:
    """Median over batches of the mean CUDA-event time of `per_batch` back-to-back calls."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_batch):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / per_batch)
    return statistics.median(out)


def _rotating_matmul(m: int, n: int, k: int):
    """A closure computing A_i @ B_i over enough (A, B) pairs that their total exceeds the L2, so no
    timing reuses operands still in the cache (pairs already far past it: one pair)."""
    import itertools

    import torch

    sets = max(1, min(8, L2_ROTATE_BYTES // ((m * k + k * n + m * n) * 2)))
    pairs = itertools.cycle([(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                              torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)])
    return lambda: (lambda ab: ab[0] @ ab[1])(next(pairs))


def measure_matmuls(shapes, deadline: float) -> list[dict]:
    import torch

    rows = []
    for m, n, k in shapes:
        if time.monotonic() > deadline:
            break
        ms = _median_ms(_rotating_matmul(m, n, k))
        rows.append(dict(m=m, n=n, k=k, ms=ms, tflops=2 * m * n * k / (ms * 1e-3) / 1e12))
    torch.cuda.empty_cache()
    return rows


def _head_gemm(op: str, x, w, g):
    """x (T, H), w (V, H), g (T, V): the head GEMM `op` as a closure over its operands. grad_weight_acc
    is Liger's form under amp (0.8.x): addmm into the fp32 (V, H) accumulator with out_dtype=fp32, a
    different cuBLAS kernel family (fp32 C and D) from the bf16-out grad_weight."""
    if op == "grad_weight_acc":
        import torch

        acc = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        return lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
    return {"forward": lambda: x @ w.t(), "grad_input": lambda: g @ w, "grad_weight": lambda: g.t() @ x}[op]


def measure_vocab_matmuls(grid, deadline: float) -> list[dict]:
    """The head GEMMs of vocab_grid(), in the layouts the model launches them: logits = x @ W.t()
    (the output's rows are vocab long), grad_input = g @ W (g's rows are), grad_weight = g.t() @ x
    (a transposed view of g)."""
    import torch

    rows = []
    for op, T, H, V in grid:
        if time.monotonic() > deadline:
            break
        bf = dict(device="cuda", dtype=torch.bfloat16)
        try:
            ms = _median_ms(_head_gemm(op, torch.randn(T, H, **bf), torch.randn(V, H, **bf), torch.randn(T, V, **bf)),
                            batches=3, per_batch=5)
        except (TypeError, RuntimeError):  # a torch without addmm(out_dtype=): Liger falls back too
            continue
        rows.append(dict(op=op, rows=T, hidden=H, vocab=V, ms=ms, tflops=2 * T * H * V / (ms * 1e-3) / 1e12))
    torch.cuda.empty_cache()
    return rows


def measure_attention(deadline: float) -> tuple[list[dict], list[str]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "memory-efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows, skipped = [], []
    for B, nh, S, hd in ATTENTION_SHAPES + SEQ_SHAPES:
        q, k, v = (torch.randn(B, nh, S, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(B, nh, S, hd, device="cuda", dtype=torch.bfloat16)
        for name in BACKENDS if (B, nh, S, hd) in ATTENTION_SHAPES else BACKENDS[:1]:
            if time.monotonic() > deadline:
                skipped.append(f"{name} hd{hd}: over the time budget")
                continue
            try:
                with sdpa_kernel([kinds[name]]):
                    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
                    fwd_ms = _median_ms(fwd, batches=5, per_batch=5)
                    # autograd.grad, not .backward: no accumulation kernels into q.grad, k.grad, v.grad
                    fb_ms = _median_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), g), batches=5, per_batch=5)
            except RuntimeError as e:  # this backend does not run this shape/dtype here
                skipped.append(f"{name} hd{hd}: {str(e).splitlines()[0][:120]}")
                continue
            rows.append(dict(backend=name, B=B, heads=nh, S=S, hd=hd, causal=True, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms))
    return rows, skipped


def measure_copy() -> float:
    import torch

    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB: far past the L2
    y = torch.empty_like(x)
    ms = _median_ms(lambda: y.copy_(x), batches=5, per_batch=3)
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e12


def measure_upcast() -> float:
    """A widening cast's rate, bytes read + written: bf16 -> fp32 (what autocast's backward does to each fp32 weight's
    bf16 gradient), which torch runs in its unrolled cast kernel; Profile.upcast_bw is its ratio to measure_copy."""
    import torch

    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB in, 2 GiB out: far past the L2
    y = torch.empty(x.shape, device="cuda", dtype=torch.float32)
    ms = _median_ms(lambda: y.copy_(x), batches=5, per_batch=3)
    return x.numel() * (2 + 4) / (ms * 1e-3) / 1e12


def measure_launch(n: int = 500) -> float:
    """GPU-side µs per kernel on a full eager queue: while the GPU spins in one long kernel, the host
    queues n tiny dependent kernels between two events; the events then time only the GPU running them."""
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(10):
        x.add_(1)
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~0.1 s at H200 clocks: far longer than queueing n ops takes
        a.record()
        for _ in range(n):
            x.add_(1)
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)


def _env(argv) -> dict:
    import torch

    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    return dict(gpu=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                torch=torch.__version__, cuda=torch.version.cuda, triton=tv,
                cudnn=torch.backends.cudnn.version(), host=platform.platform(),
                command="anatomy calibrate " + " ".join(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(prog="anatomy calibrate", description=__doc__.splitlines()[0])  # usage errors: one line
    p.add_argument("--out", help="profile path (default: ~/.cache/anatomy/profiles/<gpu>.json, read back by "
                                        "--gpu <gpu>-calibrated)")
    p.add_argument("--base", help="datasheet profile it refines (default: from the device name)")
    p.add_argument("--budget-s", type=float, default=100.0, help="stop starting new measurements after this")
    p.add_argument("--warmup-s", type=float, default=8.0,
                   help="longest warm-up toward the power-limited clock before the sustained rates (default 8)")
    a = p.parse_args(argv)
    if not 1.0 <= a.warmup_s <= 60.0:
        print(f"anatomy calibrate: --warmup-s must be between 1 and 60 seconds, got {a.warmup_s:g}", file=sys.stderr)
        return 2
    if a.out is not None:  # a device or a FIFO is refused before minutes of measuring, not after
        try:
            io.refuse_special_target(a.out, "--out target")
        except ConfigError as e:
            print(f"anatomy calibrate: error: {e}", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print("anatomy calibrate: no CUDA GPU on this machine; nothing measured", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    base = a.base or guess_base(name)
    if base is None or gpus.key(base) is None:
        print(f"anatomy calibrate: no datasheet profile for {name!r}; pass --base "
              f"({', '.join(gpus.GPUS)})", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    deadline = t0 + a.budget_s
    torch.manual_seed(0)
    m: dict = dict(copy_tbps=measure_copy(), upcast_tbps=measure_upcast(), launch_us=measure_launch())
    m["host_op_us"], m["host_custom_us"] = measure_host()
    m["host_step"] = measure_host_step(liger_blocks=6)  # Liger's loop in blocks beside the tiny step (~6 s)
    if "liger_ce" in m["host_step"]:  # without liger-kernel, none
        m["host_custom_us"]["liger_ce"] = m["host_step"].pop("liger_ce")
    dropped = drop_unmeasured(m["host_custom_us"])  # a figure that is not a time > 0: left out, loudly
    for line in dropped:
        print(f"anatomy calibrate: WARNING: {line}", file=sys.stderr, flush=True)
    # half of what is left for attention, the rest for the GEMM grid (the host figures above take seconds)
    m["attention"], skipped = measure_attention(time.monotonic() + 0.5 * (deadline - time.monotonic()))
    m["attention_masked"], more = measure_masked_attention(time.monotonic() + MASKED_S, _median_ms)
    if skipped.extend(more) or not m["attention_masked"]:
        dropped.append("attention_masked: no masked SDPA row timed (the profile times no sinks or windows)")
        print(f"anatomy calibrate: WARNING: {dropped[-1]}", file=sys.stderr, flush=True)
    m["matmul_bf16"] = measure_matmuls(gemm_grid(), time.monotonic() + 0.5 * (deadline - time.monotonic()))
    m["matmul_bf16_in_step"] = measure_gemms_in_step(gemm_grid(), deadline)
    m["fused"] = measure_fused(deadline + 15)  # 32 short rows, ~5 s
    m["grouped_mm"] = measure_grouped(deadline + 20)  # 10 expert shapes x forward, backward: a few seconds
    m["matmul_vocab"] = measure_vocab_matmuls(vocab_grid(), deadline + 10)  # small: 42 GEMMs, a few seconds
    # before the profiler (it leaves every later launch slower on the host); each tensor count compiles the step
    oh = measure_optimizer_host(deadline=time.monotonic() + 120)
    if len(oh["rows"]) >= 2:  # a line needs two counts; without it the calculator keeps an eager op per launch
        m["optimizer_host"] = {"ademamix-compiled": oh}
    else:
        dropped.append(f"optimizer_host: {len(oh['rows'])} tensor count(s) timed before the deadline, not two: left "
                       "out of the profile (the optimizer's host is one eager op per launch)")
        print(f"anatomy calibrate: WARNING: {dropped[-1]}", file=sys.stderr, flush=True)
    # the profiler from here on: SDPA's main kernel at small to large grids (calibrate_sdpa.py), then
    # last: the profiler leaves CUPTI attached, and every launch after it costs the host more
    # (pytorch/pytorch#144455; scripts/probe_host_noise.py --profiler)
    # its own allowance, not what the budget left: the SDPA kernel-time claims read this schedule
    m["attention_kernels"] = measure_sdpa_kernels(time.monotonic() + SDPA_KERNELS_S)
    if len(m["attention_kernels"]) < len(schedule_shapes()):
        dropped.append(f"attention_kernels: {len(m['attention_kernels'])} of {len(schedule_shapes())} SDPA grids "
                       "timed: the schedule covers those alone (none: SDPA is priced at the full-wave rates)")
        print(f"anatomy calibrate: WARNING: {dropped[-1]}", file=sys.stderr, flush=True)
    m["kernel_gap"] = measure_kernel_gap()
    # last: its warm-up leaves the GPU at its power-limited clock, which no burst figure above may see
    m["sustained"] = measure_sustained(a.warmup_s)
    prov = dict(_env(argv), seconds=round(time.monotonic() - t0, 1), skipped=skipped, dropped=dropped,
                gemm_grid=f"{len(m['matmul_bf16'])} of {len(gemm_grid())} shapes",
                gemm_grid_in_step=f"{len(m['matmul_bf16_in_step'])} of {len(gemm_grid())} shapes")
    out = Path(a.out or default_out(base))
    try:
        data = build_profile(m, prov, base)
    except ConfigError as e:  # no profile: say so in one line and keep what was measured for the post-mortem
        kept = rejected_path(out)
        io.write_atomic(kept, json.dumps(dict(error=str(e), provenance=prov, measurements=m), indent=1) + "\n",
                        parents=True)
        print(f"anatomy calibrate: FAILED, no profile written to {out}: {e} (the measurements: {kept})",
              file=sys.stderr, flush=True)
        return 1
    io.write_atomic(out, json.dumps(data, indent=1) + "\n", parents=True)
    prof = fit.from_measured(data)
    print(f"{name}: bf16 GEMM {prof['matmul_flops']['bfloat16'] / 1e12:.0f} TFLOP/s "
          f"(k_half {prof['matmul_k_half']:.0f}), copy {m['copy_tbps']:.2f} TB/s (bf16 -> fp32 cast {m['upcast_tbps']:.2f}), launch {m['launch_us']:.2f} us, host op {m['host_op_us']:.1f} us, "
          f"{len(m['attention'])} attention rows, {len(m['attention_kernels'])} SDPA kernel grids; sustained/burst "
          f"GEMM {prof['sustained_ratio']['matmul']:.3f}, attention {prof['sustained_ratio']['attention']:.3f}, copy "
          f"{prof['sustained_ratio']['memory']:.3f} (SM {prof['clocks'].get('burst_MHz')} -> "
          f"{prof['clocks'].get('sustained_MHz')} MHz, tau {prof['sustained_tau_s']:.2f} s); {prov['seconds']} s -> {out}")
    return 0


if __name__ == "__main__":
    from llm_anatomy.entry import guarded

    sys.exit(guarded("anatomy calibrate", main))
