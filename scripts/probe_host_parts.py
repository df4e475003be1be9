"""Where does a host-bound step's host time go? (issue 5: drawn 2-layer rows ran 1.6-1.9x their predicted host)

Three measurements, each in one process, conditions interleaved block by block:
  steps   the probe's unmarked steps (timeline._plain_steps: CUDA events around forward + backward,
          AdamW after) of one architecture at its probed size and at a tiny batch with the same
          Liger chunk count. Host cost per op does not depend on tensor sizes, so if the host bounds
          both, both take the same time; a gap is what the probed size adds (the GPU's share, or
          host work that grows with size).
  liger   Liger's fused linear CE as the efficient model calls it (bf16 autocast, fp32 weight),
          forward + backward: host issue time (perf_counter, the GPU drained first) and GPU span
          (CUDA events), at chunk counts 1 and 16, tiny and probed sizes: the host cost per chunk.
  op      host µs per eager op (x * 1.0 recording autograd) with the GPU idle, and queued behind a
          sleeping kernel (does a busy GPU slow the launch path?).

  PYTHONPATH=. python3 scripts/probe_host_parts.py --out reports/h200/<session>/host_parts.json
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import write_json  # noqa: E402

from anatomy.config import ModelConfig, Run  # noqa: E402
from anatomy.measure.memory import setup_step  # noqa: E402
from anatomy.measure.timeline import _Clock, _plain_steps  # noqa: E402

# session8d's drawn row train25 (fb 12.8 ms measured, 8.2 predicted, host-bound) and calibrate's host step
ROW = ModelConfig(name="train25", hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2560, vocab=16000,
                  mlp="gpt-oss")
TINY = ModelConfig(name="host-step", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=2048)
STEPS = ((ROW, 2, 4096), (ROW, 1, 128), (ROW, 1, 2048), (TINY, 2, 64))
# (H, V, T): chunks = ceil(T / next_pow2(ceil(T / ceil(V / H))))
LIGER = ((256, 256, 128), (256, 4096, 128), (1024, 1024, 8192), (1024, 16000, 8192), (1024, 16000, 128))


def _steps(blocks: int, n: int) -> list[dict]:
    setups = []
    for cfg, b, s in STEPS:
        run = Run(b, s, "amp")
        model, ids, targets, opt = setup_step(cfg, run, "efficient", "adamw", "cuda")
        _plain_steps(model, ids, targets, opt, run, 4, _Clock("cuda"), "cuda")
        setups.append((cfg, run, model, ids, targets, opt, []))
    clock = _Clock("cuda")
    for _ in range(blocks):
        for cfg, run, model, ids, targets, opt, fb in setups:
            torch.cuda.synchronize()
            stamps = _plain_steps(model, ids, targets, opt, run, n, clock, "cuda")
            clock.sync()
            fb.extend(clock.ms(a, m) for a, m, _ in stamps)
    rows = []
    for cfg, run, *_, fb in setups:
        rows.append(dict(config=cfg.name, cfg=asdict(cfg), batch=run.batch,
                         seq=run.seq, median_ms=statistics.median(fb), min_ms=min(fb), steps_ms=fb))
        print(f"steps {cfg.name} B{run.batch}S{run.seq}: median {rows[-1]['median_ms']:.2f} ms min {min(fb):.2f}", flush=True)
    del setups
    torch.cuda.empty_cache()
    return rows


def _liger(reps: int) -> list[dict]:
    from anatomy.efficient.loss import chunk_rows, fused_linear_cross_entropy

    rows = []
    for H, V, T in LIGER:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(V, H, device="cuda") * 0.02).requires_grad_()
        t = torch.randint(0, V, (T,), device="cuda")
        host, gpu = [], []
        for i in range(reps + 3):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fused_linear_cross_entropy(x, w, t)
            loss.backward()
            b.record()
            h = time.perf_counter() - t0
            torch.cuda.synchronize()
            if i >= 3:
                host.append(h * 1e6)
                gpu.append(a.elapsed_time(b) * 1e3)
            x.grad = w.grad = None
        c = chunk_rows(T, H, V)
        rows.append(dict(hidden=H, vocab=V, tokens=T, chunks=-(-T // c), chunk_rows=c,
                         host_us=statistics.median(host), span_us=statistics.median(gpu)))
        print(f"liger H{H} V{V} T{T}: {rows[-1]['chunks']} chunks, host {rows[-1]['host_us']:.0f} us, "
              f"span {rows[-1]['span_us']:.0f} us", flush=True)
    return rows


def _op(n: int = 400) -> dict:
    x = torch.randn(8, device="cuda", requires_grad=True)
    out = {}
    for busy in (False, True, False, True):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(200_000_000)  # ~100 ms: every op below queues behind it
        t0 = time.perf_counter()
        for _ in range(n):
            x * 1.0
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        out.setdefault("busy" if busy else "idle", []).append(us)
    print(f"op: idle {out['idle']} us, busy {out['busy']} us", flush=True)
    return out


def _cpu_profile(top: int = 40) -> list[dict]:
    """CPU-only torch.profiler (no CUPTI) of 2 steps of ROW at its probed size and at the tiny batch: the
    ops whose host time differs. Runs last: any profiler session may change what follows it."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for cfg, b, s in STEPS[:2]:
        run = Run(b, s, "amp")
        model, ids, targets, opt = setup_step(cfg, run, "efficient", "adamw", "cuda")
        clock = _Clock("cuda")
        _plain_steps(model, ids, targets, opt, run, 3, clock, "cuda")
        clock.sync()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            _plain_steps(model, ids, targets, opt, run, 2, clock, "cuda")
            clock.sync()
        ev = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        out.append(dict(config=cfg.name, batch=b, seq=s, ops=[dict(name=e.key, calls=e.count, self_us=e.self_cpu_time_total / 2,
                                                                    total_us=e.cpu_time_total / 2) for e in ev]))
        print(f"cpu profile {cfg.name} B{b}S{s}: " + ", ".join(f"{o['name']} {o['self_us']:.0f}" for o in out[-1]["ops"][:12]),
              flush=True)
        del model, opt, ids, targets
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host_parts")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_parts: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = dict(op=_op(), liger=_liger(10))
    out["steps"] = _steps(a.blocks, a.steps)
    write_json("probe_host_parts", a.out, **out)
    out["cpu_profile"] = _cpu_profile()
    write_json("probe_host_parts", a.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
