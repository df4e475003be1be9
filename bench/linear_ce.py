"""Fused linear cross-entropy on the GPU: ours (anatomy::linear_cross_entropy) against Liger's
LigerFusedLinearCrossEntropyFunction, forward + backward, bf16 x and an fp32 weight under bf16 autocast
(the model's layout), next to the bf16 matmul ceiling measured in the same process.

    python3 -m bench.linear_ce [--shapes 16384x2048x32000,...] [--chunks 0,2048,8192]
                                            [--reps 20] [--json OUT] [--dry-run]

Per shape (T tokens x H hidden x V vocab) and implementation:
  * ms: median over --reps repeats of one forward + backward between two CUDA events, after a warm-up,
    each repeat on the next of 3 input sets (x, targets; the (V, H) weight is the model's, shared);
    .grad is set to None before each, as a training loop's zero_grad does. A host sync inside the call
    (Liger's .item() and torch.equal) shows here as the GPU idling while the host catches up.
  * steady_ms: the same calls back to back between one pair of events, divided by their count;
  * TFLOP/s over 6·T·H·V (logits, grad_x, grad_w GEMMs) and that as a fraction of the ceiling (20 products
    of 8192³ after idle: a burst); frac_ceiling_sustained: of the same product's rate after 2 s back to back,
    when the power limit holds the clock down, as it does over a CE call's repeats;
  * peak_mib: max_memory_allocated during one call above what was allocated before it (inputs, weight);
    for ours also linear_ce_chunks.peak_bytes beside it (tensor bytes: the allocator's 512-byte rounding
    of its small tensors, ~4 KiB, is not in it);
  * host_syncs: synchronizing CUDA calls in one call, counted by torch.cuda.set_sync_debug_mode("warn"), and
    first_sync_at: where the first is made (the call again under mode "error");
  * ours against Liger: the largest relative difference of the loss and both gradients;
  * ours, --breakdown: each GEMM and the row kernel of one chunk, timed alone, times the chunk count, and
    backward's scale kernels at an incoming gradient of 1 (a plain loss.backward()) and of 1 / T;
    --row-blocks B,...: the row kernel also at each block width B (the width that sets its passes and warps),
    in interleaved rounds (row_block_sweep).
--chunks runs ours with each rows-per-chunk (0: the rule in linear_ce_chunks.chunk_rows), to check the
rule's derivation on the machine. --dry-run runs the same code on CPU at tiny shapes (perf_counter for
events, no Liger unless Triton runs there), to check the script itself.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
import warnings

import torch

from llm_anatomy.kernels.linear_ce import linear_cross_entropy
from llm_anatomy.kernels.linear_ce_chunks import chunk_rows, peak_bytes

BF16 = torch.bfloat16
SHAPES = "16384x2048x32000,16384x2048x128256,65536x512x16000"  # 1B-class at vocab 32k and 128k; the seed
DRY_SHAPES = "96x32x50,64x16x1000"
ROTATE = 3  # input sets


class Clock:
    """CUDA events on the GPU, perf_counter on CPU (--dry-run)."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def timed(clock: Clock, fn, reps: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms of one call, steady ms per call back to back); fn(i) runs repeat i."""
    for i in range(warmup):
        fn(i)
    clock.sync()
    marks = []
    for i in range(reps):
        a = clock.mark()
        fn(i)
        marks.append((a, clock.mark()))
    clock.sync()
    a = clock.mark()
    for i in range(reps):
        fn(i)
    b = clock.mark()
    clock.sync()
    return statistics.median(clock.ms(x, y) for x, y in marks), clock.ms(a, b) / reps


def matmul_ceiling(clock: Clock, n: int, dev) -> float:
    a, b = (torch.randn(n, n, device=dev, dtype=BF16) for _ in range(2))
    ms, _ = timed(clock, lambda i: a @ b, reps=20, warmup=5)
    return 2 * n ** 3 / (ms / 1e3)


def matmul_ceiling_sustained(clock: Clock, n: int, dev, seconds: float) -> float:
    """The same product's rate once the board's power limit holds the clock down: back to back for `seconds`
    first (the controller settles within ~0.1 s on an H200: docs/timing.md), then timed as matmul_ceiling.
    A CE call of tens of ms, repeated, runs in this regime; the burst ceiling's 20 products do not."""
    a, b = (torch.randn(n, n, device=dev, dtype=BF16) for _ in range(2))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        clock.sync()
    ms, _ = timed(clock, lambda i: a @ b, reps=20, warmup=0)
    return 2 * n ** 3 / (ms / 1e3)


def copy_bandwidth(clock: Clock, n: int, dev) -> float:
    x = torch.randn(n, device=dev, dtype=BF16)
    y = torch.empty_like(x)
    ms, _ = timed(clock, lambda i: y.copy_(x), reps=20, warmup=5)
    return 2 * x.numel() * 2 / (ms / 1e3)


def liger_fn():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None
    return lambda x, w, t: LigerFusedLinearCrossEntropyFunction.apply(x, w, t)[0]


def peak_and_syncs(dev, call, clear) -> tuple[float | None, int | None, list[str]]:
    """(MiB allocated at the call's peak above what was allocated before it, synchronizing calls, where the
    first of them was made: the innermost frames of the call again under sync debug mode "error", which
    raises there; empty where that call made none, a sync that did not recur). clear() drops the previous
    call's gradients first, so that their freeing does not hide in the figure."""
    if dev.type != "cuda":
        call()
        return None, None, []
    clear()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    site = []
    if syncs:
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as e:
            frames = traceback.extract_tb(e.__traceback__)[-4:]
            site = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames]
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    return peak, syncs, site


def bench_shape(T, H, V, impls, clock, dev, reps, ceiling, breakdown, row_blocks=()):
    g = torch.Generator(device="cpu").manual_seed(T + V)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev).requires_grad_()  # fp32 master weight
    sets = [(torch.randn(T, H, generator=g).to(dev, BF16).requires_grad_(),
             torch.randint(0, V, (T,), generator=g).to(dev)) for _ in range(ROTATE)]
    sets[0][1][::97] = -100  # a few ignored targets

    def step(fn, i):
        x, t = sets[i % ROTATE]
        x.grad = w.grad = None  # zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=BF16):
            loss = fn(x, w, t)
        loss.backward()
        return loss

    rows, results = [], {}
    flops = 6 * T * H * V
    for name, fn, chunk, align in impls:
        ms, steady = timed(clock, lambda i, fn=fn: step(fn, i), reps)
        peak, syncs, site = peak_and_syncs(dev, lambda fn=fn: step(fn, 0), lambda: setattr(w, "grad", None) or [
            setattr(x, "grad", None) for x, _ in sets])
        loss = step(fn, 0)
        results[name] = (loss.detach().clone(), sets[0][0].grad.clone(), w.grad.clone())
        r = dict(impl=name, T=T, H=H, V=V, chunk=chunk, ms=ms, steady_ms=steady, flops=flops,
                 tflop_s=flops / (ms / 1e3) / 1e12, frac_ceiling=flops / (ms / 1e3) / ceiling,
                 peak_mib=peak, host_syncs=syncs, first_sync_at=site)
        if name.startswith("ours"):
            r["align"] = align
            r["predicted_peak_mib"] = peak_bytes(T, H, V, 2, 4, chunk, align) / 2 ** 20  # backward adds nothing
            if breakdown:
                r["breakdown_ms"] = chunk_breakdown(T, H, V, chunk or chunk_rows(T, H, V), w, sets[0], clock, reps,
                                                    row_blocks)
        rows.append(r)
        print(f"{T}x{H}x{V} {name:14s} {ms:8.3f} ms (steady {steady:8.3f})  {r['tflop_s']:6.1f} TFLOP/s "
              f"{r['frac_ceiling']:6.1%} of ceiling  peak {peak if peak is None else round(peak)} MiB  "
              f"syncs {syncs}", flush=True)
    if "liger" in results:
        ref = results["liger"]
        for r in rows:
            if r["impl"] != "liger":
                r["max_rel_diff_vs_liger"] = {k: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                              for k, a, b in zip(("loss", "grad_x", "grad_w"), results[r["impl"]], ref)}
    return rows


def chunk_breakdown(T, H, V, C, w, inputs, clock, reps, row_blocks=()) -> dict[str, float]:
    """Each part of ours for one full chunk, timed alone, times the chunk count T / C (a fraction for the tail):
    backward_scale as a plain loss.backward() runs it (incoming gradient 1), backward_scale_not_one at 1 / T;
    row_kernel[b] the row kernel at each block width b of row_blocks (0: the op's own)."""
    from llm_anatomy.kernels.linear_ce import accumulate_grad_weight, ce_rows_reference, ce_rows_triton, scale_

    x, t = inputs[0].detach()[:C], inputs[1][:C]
    dev, n = x.device, T / C
    wl = w.detach().to(BF16)
    logits = torch.empty(C, V, dtype=BF16, device=dev)
    gx, gw = torch.empty(C, H, dtype=BF16, device=dev), torch.empty(V, H, dtype=torch.float32, device=dev)
    losses, scale, one = torch.empty(C, device=dev), torch.tensor(1 / T, device=dev), torch.tensor(1.0, device=dev)
    gx_all = torch.empty(T, H, dtype=BF16, device=dev)
    rows = ce_rows_triton if dev.type == "cuda" else ce_rows_reference
    torch.mm(x, wl.t(), out=logits)
    logits_copy = logits.clone()
    parts = {"weight_cast": (lambda i: w.detach().to(BF16), 1),
             "logits_mm": (lambda i: torch.mm(x, wl.t(), out=logits), n),
             "row_kernel": (lambda i: (logits.copy_(logits_copy), rows(logits, t, losses, scale)), n),
             "row_kernel_restore_copy": (lambda i: logits.copy_(logits_copy), n),
             "grad_x_mm": (lambda i: torch.mm(logits, wl, out=gx), n),
             "grad_w_addmm": (lambda i: accumulate_grad_weight(gw, logits.t(), x, i == 0, dev.type == "cuda"), n),
             "backward_scale": (lambda i: (scale_(gx_all, one), scale_(gw, one)), 1),
             "backward_scale_not_one": (lambda i: (scale_(gx_all, scale), scale_(gw, scale)), 1)}
    out = {k: timed(clock, fn, reps)[0] * m for k, (fn, m) in parts.items()}
    out["row_kernel"] -= out.pop("row_kernel_restore_copy")  # the copy restores the logits between repeats
    if row_blocks and (dev.type == "cuda" or _triton_on_cpu()):
        # on CPU (--dry-run, the Triton interpreter) one round: it checks the path, and its figures mean nothing
        sweep = row_block_sweep(logits, t, losses, scale, row_blocks, clock, rounds=7 if dev.type == "cuda" else 1)
        out.update({f"row_kernel[{b}]": ms * n for b, ms in sweep.items()})
    return out


def row_block_sweep(logits, t, losses, scale, blocks, clock, rounds: int = 7, reps: int = 5) -> dict[int, float]:
    """{b: median ms of one row-kernel call over `logits` at block width b (0: the op's own)}. Rounds visit
    every width in turn, so a clock's drift meets each alike; each call rewrites the logits in place, and no
    restoring copy is timed (the kernel's work does not depend on the values it reads)."""
    from llm_anatomy.kernels.linear_ce import ce_rows_triton

    def call(b):
        ce_rows_triton(logits, t, losses, scale, block=b or None)
    for b in blocks:  # compile every width first
        call(b)
    clock.sync()
    seen = {b: [] for b in blocks}
    for _ in range(rounds):
        for b in blocks:
            seen[b].append(timed(clock, lambda i, b=b: call(b), reps, warmup=1)[0])
    return {b: statistics.median(v) for b, v in seen.items()}


def environment(dev) -> dict:
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None
    return dict(gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
                torch=torch.__version__, triton=version("triton"), cuda=torch.version.cuda,
                liger_kernel=version("liger-kernel"),
                date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


def parse_shapes(text: str) -> list[tuple[int, int, int]] | None:
    """TxHxV,... -> [(T, H, V), ...]; None when the text is not that."""
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        return None
    return shapes if shapes and all(len(s) == 3 and min(s) > 0 for s in shapes) else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help=f"TxHxV,... (default {SHAPES}; --dry-run {DRY_SHAPES})")
    p.add_argument("--chunks", default="0", help="rows per chunk for ours, comma-separated; 0 is the rule")
    p.add_argument("--aligns", default="1", help="ours with the vocabulary padded to a multiple of each (comma-"
                   "separated; 1 pads nothing): kernel_shapes.lce_vocab")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-liger", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time each part of one chunk of ours alone")
    p.add_argument("--row-blocks", default="", help="with --breakdown: the row kernel also at these block "
                   "widths (powers of two, comma-separated; 0 is the op's own)")
    p.add_argument("--json", help="write the results here (atomically)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing")
    a = p.parse_args(argv)
    try:
        chunks = [int(c) for c in a.chunks.split(",")]
        aligns = [int(v) for v in a.aligns.split(",")]
        assert all(v >= 1 for v in aligns)
        blocks = [int(b) for b in a.row_blocks.split(",") if b]
        assert all(c >= 0 for c in chunks) and a.reps >= 10 and all(b == 0 or b & (b - 1) == 0 for b in blocks)
    except (ValueError, AssertionError):
        p.exit(2, "bench/linear_ce.py: --chunks wants non-negative ints, --aligns positive ints, --row-blocks 0 or "
                  "powers of two, --reps at least 10\n")
    shapes = parse_shapes(a.shapes or (DRY_SHAPES if a.dry_run else SHAPES))
    if shapes is None:
        p.exit(2, f"bench/linear_ce.py: --shapes wants TxHxV[,TxHxV...] with positive ints, got {a.shapes!r}\n")
    if not a.dry_run and not torch.cuda.is_available():
        p.exit(2, "bench/linear_ce.py: no CUDA GPU here; use --dry-run to check the script on CPU\n")
    dev = torch.device("cpu" if a.dry_run else "cuda")
    clock = Clock(dev)
    ceiling = matmul_ceiling(clock, 256 if a.dry_run else 8192, dev)
    bw = copy_bandwidth(clock, 1 << 16 if a.dry_run else 1 << 30, dev)
    print(f"ceilings: bf16 matmul {ceiling / 1e12:.1f} TFLOP/s, copy {bw / 1e12:.2f} TB/s", flush=True)
    impls = [("ours" + (f"-c{c}" if c else "") + (f"-a{v}" if v != 1 else ""),
              lambda x, w, t, c=c, v=v: linear_cross_entropy(x, w, t, chunk=c, align=v), c, v)
             for v in aligns for c in chunks]
    liger = None if a.no_liger or (a.dry_run and not _triton_on_cpu()) else liger_fn()
    if liger is not None:
        impls.append(("liger", liger, 0, 1))
    elif not a.no_liger and not a.dry_run:
        p.exit(2, "bench/linear_ce.py: liger_kernel is not importable (pip install liger-kernel, or --no-liger)\n")
    rows = []
    for T, H, V in shapes:
        rows += bench_shape(T, H, V, impls, clock, dev, a.reps, ceiling, a.breakdown, blocks)
    sustained = matmul_ceiling_sustained(clock, 256 if a.dry_run else 8192, dev, 0.05 if a.dry_run else 2.0)
    for r in rows:  # the same call against the ceiling of its own regime (the power limit's)
        r["frac_ceiling_sustained"] = r["tflop_s"] * 1e12 / sustained
    print(f"bf16 matmul under the power limit: {sustained / 1e12:.1f} TFLOP/s", flush=True)
    res = dict(environment(dev), matmul_tflop_s=ceiling / 1e12, matmul_tflop_s_sustained=sustained / 1e12,
               matmul_shape="8192^3 bf16" if not a.dry_run else "256^3 bf16 (dry run)",
               copy_tb_s=bw / 1e12, dry_run=a.dry_run, rows=rows,
               command=" ".join(["python3 -m bench.linear_ce",
                                 *(argv if argv is not None else sys.argv[1:])]))
    if a.json:
        from llm_anatomy.io import write_atomic

        write_atomic(a.json, json.dumps(res, indent=1) + "\n")
    return res


def _triton_on_cpu() -> bool:
    from llm_anatomy.kernels import INTERPRET
    return INTERPRET


if __name__ == "__main__":
    main()
