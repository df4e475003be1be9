"""Calibrate's in-step measurements: GEMMs and our fused kernels as a training step runs them.

Two things a loop of one op back to back gets wrong about a step (docs/timing.md):
  * A GEMM in a step follows the kernel that wrote its activation operand (a norm, an activation,
    the previous matmul): the tensor cores are not under sustained load and part of the operand may
    still be in L2. A loop of the same GEMM runs the MLP's shapes well below their in-step rate
    (560-700 against up to 781 TFLOP/s on the H200).
  * A fused kernel of ours at a narrow row (hidden 512) is issued slower by the host than the GPU
    runs it, so a back-to-back loop times the host; and at any width a Triton kernel moves its
    bytes below the copy bandwidth by an amount that depends on the row width.

The same rows time two kernels that are not ours but hold a step's time where a copy-roofline
guess misses: the fp32 + bf16 residual add (ATen runs mixed dtypes unvectorized) and Liger's CE
kernel (two passes over each logits row).

So every op here is timed on the GPU alone: the host enqueues all repeats while the GPU spins in a
sleep kernel, each repeat between its own pair of CUDA events, and each GEMM repeat is preceded
(untimed) by a copy that writes its activation operand, as the producing kernel of a step does.
The rows record shapes and milliseconds only; the calculator turns them into rates and
efficiencies (calculator/timing/fit.py, registry.py), never the other way round.
"""
from __future__ import annotations

import itertools
import statistics
import time

from llm_anatomy.measure.calibrate_aten import (EAGER_CE_ROWS, EAGER_CE_VOCABS, EMBEDDING_ROWS, EMBEDDING_VOCAB,
                                            EMBEDDING_WIDTHS, ROPE_HEAD_DIMS, ROPE_ROWS, SXS_OPS, SXS_ROWS, SXS_SEQS,
                                            _sets, eager_case, eager_rope_case, embedding_case, sxs_case)

SLEEP_CYCLES = 100_000_000  # ~50 ms at H200 clocks: longer than the host takes to enqueue a row's repeats
RMS_WIDTHS = (512, 1024, 2048, 3072, 4096, 8192)  # hidden
SWIGLU_WIDTHS = (1024, 2816, 5632, 8192, 11008, 14336)  # intermediate
ROPE_HEADS = ((8, 8, 64), (16, 16, 128), (32, 8, 128), (24, 8, 128))  # (heads, kv_heads, head_dim)
FUSED_TOKENS = 16384


def queued_ms(fn, pre=None, reps: int = 20, warmup: int = 3) -> tuple[float, bool]:
    """(median GPU ms of fn(), queued): every repeat between two events, all enqueued behind a sleep
    kernel so the host's issue time never shows. queued is False when the host took longer to
    enqueue than the sleep lasted (the figure may then include waits for the host)."""
    import torch

    for _ in range(warmup):
        if pre is not None:
            pre()
        fn()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    before, start = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for a, b in evs:
        if pre is not None:
            pre()
        a.record()
        fn()
        b.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    # every repeat was enqueued before the GPU woke: nothing it ran could wait for the host
    queued = host_ms < before.elapsed_time(start)
    return statistics.median(a.elapsed_time(b) for a, b in evs), queued


def measure_gemms_in_step(shapes, deadline: float) -> list[dict]:
    """(m, n, k) GEMMs, each repeat preceded by a copy that writes its A operand (m, k)."""
    import torch

    rows = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for m, n, k in shapes:
        if time.monotonic() > deadline:
            break
        sets = [(torch.randn(m, k, **bf), torch.randn(k, n, **bf), torch.empty(m, n, **bf))
                for _ in range(_sets((m * k + k * n + m * n) * 2))]
        src = torch.randn(m, k, **bf)
        it = itertools.cycle(sets)
        cur = [sets[0]]

        def pre():
            cur[0] = next(it)
            cur[0][0].copy_(src)  # the producer: writes A as a norm or an activation would

        ms, queued = queued_ms(lambda: torch.matmul(cur[0][0], cur[0][1], out=cur[0][2]), pre)
        rows.append(dict(m=m, n=n, k=k, ms=ms, tflops=2 * m * n * k / (ms * 1e-3) / 1e12, queued=queued))
    torch.cuda.empty_cache()
    return rows


# Liger's CE at one- and two-pass widths (16384, 32768, 65536 lanes; 131072), at vocabs that are multiples
# of 16 and vocabs that are not (16004, 32001, 55960: Triton's loads lose their alignment), as
# registry.efficiency reads them (op "linear_ce", impl liger)
LIGER_VOCABS = (16000, 16004, 32000, 32001, 55960, 64000, 128256)
LIGER_ROWS = 2048  # one chunk of Liger's fused linear CE at these vocabs and hidden 2048-4096
# and a chunk of 512 rows (8k tokens at vocab/hidden 16-32): one program per row, so a short chunk leaves
# SMs idle (on the H200, 37% of copy bandwidth at 512 rows against 79% at 2048, V 34732)
LIGER_CHUNK_ROWS = (512, LIGER_ROWS)


def _liger_ce_kernel():
    try:
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    except ImportError:  # liger-kernel is optional: no row then
        return None
    return liger_cross_entropy_kernel


def liger_ce(V: int, rows: int = LIGER_ROWS):
    """Liger's CE kernel over one (rows, V) bf16 logits chunk, launched with the arguments its fused
    linear CE passes (liger_kernel 0.8.x, ops/fused_linear_cross_entropy.py): mean reduction, no
    weight, no softcap, gradients written in place into the logits (refreshed before each call)."""
    def build():
        import torch
        import triton

        kernel = _liger_ce_kernel()
        bf = dict(device="cuda", dtype=torch.bfloat16)
        sets = [torch.empty(rows, V, **bf) for _ in range(_sets(rows * V * 2))]
        src = torch.randn(rows, V, **bf)
        target = torch.randint(0, V, (rows,), device="cuda")
        loss = torch.zeros(rows, device="cuda", dtype=torch.float32)
        it, cur = itertools.cycle(sets), [sets[0]]

        def pre():
            cur[0] = next(it)
            cur[0].copy_(src)

        def fn():
            kernel[(rows,)](X_ptr=cur[0], X_stride=cur[0].stride(-2), Y_ptr=target, Y_stride=1, weight_ptr=None,
                            loss_ptr=loss, z_loss_ptr=None, loss_stride=1, token_accuracy_ptr=None,
                            token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=V,
                            n_non_ignore=rows, sum_non_ignore_weight=rows, weight_sum=0.0, ignore_index=-100,
                            lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                            RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
                            HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=True,
                            BLOCK_SIZE=min(65536 // 2, triton.next_power_of_2(V)), num_warps=32)
        return pre, fn
    return build


# torch's fused AdamW (the probes' optimizer) over ADAMW_TENSORS fp32 tensors of each size: its kernels run
# ~1.2x the copy-roofline model (multi_tensor_apply's chunked launches, 16 B read and 12 B written per
# element). The sizes span a norm weight to a vocab matrix.
ADAMW_NUMELS = (2**16, 2**20, 2**22, 2**24, 2**26)
ADAMW_TENSORS = 4


def _optimizer_case(numel: int, tensors: int, bytes_per_elem: int, make):
    """A step of `make(params)` over `tensors` fp32 params of `numel` with grads; enough optimizers over
    distinct parameter sets (`bytes_per_elem` of state and params each) that they rotate out of L2."""
    def build():
        import torch

        opts = []
        for _ in range(_sets(tensors * numel * bytes_per_elem)):
            ps = [torch.zeros(numel, device="cuda", requires_grad=True) for _ in range(tensors)]
            for q in ps:
                q.grad = torch.randn_like(q)
            opts.append(make(ps))
        it, cur = itertools.cycle(opts), [opts[0]]
        return (lambda: cur.__setitem__(0, next(it))), (lambda: cur[0].step())
    return build


def adamw_case(numel: int, tensors: int = ADAMW_TENSORS):
    """One fused AdamW step (torch.optim.AdamW(fused=True)), as the probes' training steps run it."""
    def make(ps):
        import torch

        return torch.optim.AdamW(ps, lr=1e-4, fused=True)
    return _optimizer_case(numel, tensors, 16, make)


def ademamix_case(numel: int, tensors: int = ADAMW_TENSORS):
    """One compiled AdEMAMix step (llm_anatomy.optim.FusedAdEMAMix(compile=True): Inductor fuses the step into one
    read-modify-write pass, 20 B read and 16 B written per fp32 element), as `--optimizer ademamix-compiled`
    runs it. The warm-up compiles it once per size (dynamic=False)."""
    def make(ps):
        from llm_anatomy.optim import FusedAdEMAMix

        return FusedAdEMAMix(ps, lr=1e-4, weight_decay=0.1, T_alpha_beta3=10_000, compile=True)
    return _optimizer_case(numel, tensors, 20, make)


def _fused_cases(T: int = FUSED_TOKENS):
    """(op, width, extra, build) with build() -> (pre, fn): the op as the efficient model calls it under amp
    (and the residual add between its modules, and Liger's CE kernel, the loss's one non-GEMM kernel)."""
    import torch

    ops = torch.ops.anatomy
    bf, f32 = dict(device="cuda", dtype=torch.bfloat16), dict(device="cuda", dtype=torch.float32)

    def rms(H, backward):
        def build():
            sets = [(torch.randn(T, H, **f32), torch.randn(T, H, **bf)) for _ in range(_sets(T * H * 6))]
            w, it, cur = torch.rand(H, **f32) + 0.5, itertools.cycle(sets), [sets[0]]
            pre = lambda: cur.__setitem__(0, next(it))  # noqa: E731
            if backward:  # dy (bf16, from the matmul), x (the fp32 residual stream) -> dx fp32, dw
                return pre, lambda: ops.rms_norm_backward(cur[0][1], cur[0][0], w, 1e-5)
            return pre, lambda: ops.rms_norm(cur[0][0], w, 1e-5, torch.bfloat16)
        return build

    def add_rms(H, backward):
        def build():
            sets = [(torch.randn(T, H, **f32), torch.randn(T, H, **bf), torch.randn(T, H, **f32))
                    for _ in range(_sets(T * H * 16))]
            w, it, cur = torch.rand(H, **f32) + 0.5, itertools.cycle(sets), [sets[0]]
            pre = lambda: cur.__setitem__(0, next(it))  # noqa: E731
            if backward:  # d_x_new (fp32, the residual path's), dy (bf16), x_new (fp32) -> d_x, d_branch, dw
                return pre, lambda: ops.add_rms_norm_backward(cur[0][2], cur[0][1], cur[0][0], w, 1e-5,
                                                              torch.bfloat16)
            return pre, lambda: ops.add_rms_norm(cur[0][0], cur[0][1], w, 1e-5, torch.bfloat16)
        return build

    def swiglu(I, backward):
        def build():
            sets = [(torch.randn(T, 2 * I, **bf), torch.randn(T, I, **bf)) for _ in range(_sets(T * I * 6))]
            src, it, cur = torch.randn(T, 2 * I, **bf), itertools.cycle(sets), [sets[0]]
            if backward:  # in place into gate_up, as in the model: refresh it first (untimed)
                def pre():
                    cur[0] = next(it)
                    cur[0][0].copy_(src)
                return pre, lambda: ops.swiglu_backward_(cur[0][1], *cur[0][0].chunk(2, dim=-1), "swiglu")
            return (lambda: cur.__setitem__(0, next(it))), lambda: ops.swiglu_packed(cur[0][0], "swiglu", True)
        return build

    def rope(nh, nkv, hd, backward):
        def build():
            B, S = T // 4096, 4096
            D = (nh + 2 * nkv) * hd
            pos = torch.arange(S, device="cuda", dtype=torch.float32)[:, None]
            ang = pos / 10000 ** (torch.arange(hd, device="cuda") % (hd // 2) * 2 / hd)
            cos, sin = ang.cos(), ang.sin()  # (S, hd) fp32, as the model's tables
            sets = [torch.randn(B, S, D, **bf) for _ in range(_sets(T * D * 4))]
            it, cur = itertools.cycle(sets), [sets[0]]
            pre = lambda: cur.__setitem__(0, next(it))  # noqa: E731
            if backward:
                grads = [ops.rope_qkv(x, cos, sin, nh, nkv) for x in sets]  # dq, dk, dv in the model's layouts
                git, g = itertools.cycle(grads), [grads[0]]
                return (lambda: g.__setitem__(0, next(git))), lambda: ops.rope_qkv_backward(*g[0], cos, sin)
            return pre, lambda: ops.rope_qkv(cur[0], cos, sin, nh, nkv)
        return build

    def residual_add(H):  # x + branch: the fp32 stream plus a bf16 branch (ATen, mixed dtypes)
        def build():
            sets = [(torch.randn(T, H, **f32), torch.randn(T, H, **bf)) for _ in range(_sets(T * H * 10))]
            it, cur = itertools.cycle(sets), [sets[0]]
            return (lambda: cur.__setitem__(0, next(it))), lambda: cur[0][0] + cur[0][1]
        return build

    yield from (("residual_add", H, dict(), residual_add(H)) for H in RMS_WIDTHS)
    yield from ((op, S, dict(rows=SXS_ROWS), sxs_case(op, S)) for op in SXS_OPS for S in SXS_SEQS)
    for V in LIGER_VOCABS:
        if _liger_ce_kernel() is not None:
            yield from (("liger_ce", V, dict(rows=n), liger_ce(V, n)) for n in LIGER_CHUNK_ROWS)
    for bwd in (False, True):
        suffix = ".backward" if bwd else ".forward"
        yield from ((f"rms_norm{suffix}", H, dict(), rms(H, bwd)) for H in RMS_WIDTHS)
        yield from ((f"add_rms_norm{suffix}", H, dict(), add_rms(H, bwd)) for H in RMS_WIDTHS)
        yield from ((f"swiglu{suffix}", I, dict(), swiglu(I, bwd)) for I in SWIGLU_WIDTHS)
        yield from ((f"rope_qkv{suffix}", (nh + 2 * nkv) * hd, dict(heads=nh, kv_heads=nkv, head_dim=hd),
                     rope(nh, nkv, hd, bwd)) for nh, nkv, hd in ROPE_HEADS)
    # the ATen and optimizer cases last: a calibration cut short by its deadline keeps our kernels
    yield from (("optimizer.adamw", n, dict(rows=ADAMW_TENSORS), adamw_case(n)) for n in ADAMW_NUMELS)
    for ph in ("forward", "backward"):
        yield from ((f"eager_norm.{ph}", H, dict(), eager_case(f"eager_norm.{ph}", H, T)) for H in RMS_WIDTHS)
        yield from ((f"eager_ce.{ph}", V, dict(rows=EAGER_CE_ROWS), eager_case(f"eager_ce.{ph}", V, EAGER_CE_ROWS))
                    for V in EAGER_CE_VOCABS)
        yield from ((f"{ch}.{ph}", I, dict(), eager_case(f"{ch}.{ph}", I, T)) for ch in ("eager_mlp", "eager_clamp")
                    for I in SWIGLU_WIDTHS)
    yield from (("embedding.backward", H, dict(rows=n, vocab=EMBEDDING_VOCAB), embedding_case(H, n))
                for n in EMBEDDING_ROWS for H in EMBEDDING_WIDTHS)
    yield from ((f"eager_rope.{ph}", hd, dict(rows=ROPE_ROWS), eager_rope_case(f"eager_rope.{ph}", hd))
                for ph in ("forward", "backward") for hd in ROPE_HEAD_DIMS)
    # last: each size compiles once (seconds), so a calibration cut short by its deadline loses only these
    yield from (("optimizer.ademamix", n, dict(rows=ADAMW_TENSORS), ademamix_case(n)) for n in ADAMW_NUMELS)


NARROW_TOKENS = 65536  # the seed step's rows: at narrow widths the rate still grows with the row count


def measure_fused(deadline: float, tokens: int = FUSED_TOKENS) -> list[dict]:
    """GPU ms per call of each op (forward and backward) at `tokens` rows and several widths, and of
    the narrow widths (<= 2048; Liger's CE excepted) again at NARROW_TOKENS rows."""
    import torch

    import llm_anatomy.kernels  # noqa: F401 - registers torch.ops.anatomy

    rows = []
    cases = [(tokens, c) for c in _fused_cases(tokens)]
    own_rows = ("liger_ce", "sxs.", "optimizer.", "eager_ce", "embedding.", "eager_rope")  # cases that set their own row counts
    cases += [(NARROW_TOKENS, c) for c in _fused_cases(NARROW_TOKENS) if c[1] <= 2048 and not c[0].startswith(own_rows)]
    for T, (op, width, extra, build) in cases:
        if time.monotonic() > deadline:
            break
        pre, fn = build()
        ms, queued = queued_ms(fn, pre)
        rows.append(dict(op=op, tokens=extra.pop("rows", T), width=width, ms=ms, queued=queued, **extra))
        del pre, fn
        torch.cuda.empty_cache()
    return rows


def measure_kernel_gap(pairs: int = 60) -> dict:
    """The GPU's idle time between two dependent kernels of real size: a chain of GEMMs (2048 x 4096 x
    2048) and copies (64 MiB), each reading what the one before wrote, queued behind a sleep kernel
    and traced with torch.profiler; the gap is the median of (start of a kernel - end of the one
    before) over the chain. Tiny kernels on a full queue (launch_us) do not show it: a real kernel's
    first CTAs start only after the previous kernel's last ones have drained."""
    import json
    import tempfile
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile

    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, w = torch.randn(2048, 2048, **bf), torch.randn(2048, 4096, **bf)
    big, c = torch.randn(8192, 4096, **bf), torch.empty(2048, 4096, **bf)

    def chain():
        for _ in range(pairs):
            torch.matmul(a, w, out=c)  # reads a (written by the copy before), writes c
            big[:2048].copy_(c)  # reads c, writes a 16 MiB slice ...
            a.copy_(big[:2048, :2048])  # ... and a: the next GEMM depends on both copies

    chain()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(SLEEP_CYCLES)
        chain()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        evs = json.loads(Path(f.name).read_text())["traceEvents"]
    ks = sorted((e["ts"], e["dur"], e["name"]) for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    ks = [k for k in ks if k[1] < 5000]  # not the sleep kernel (~50 ms)
    gaps = [b[0] - (a_[0] + a_[1]) for a_, b in zip(ks, ks[1:])]
    return dict(gap_us=statistics.median(gaps), kernels=len(ks), pairs=pairs,
                gap_p10_us=sorted(gaps)[len(gaps) // 10], gap_p90_us=sorted(gaps)[9 * len(gaps) // 10])
