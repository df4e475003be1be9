"""Memory of the efficient model with our fused linear CE, on the GPU: the step's phases and peak, and the loss
op's own saved and peak bytes, at the issue's configs. One JSON per config under --out (default $OUT).

    python3 -m bench.loss_memory [--out DIR] [--configs seed,tinyllama,llama3.2]

Per config (autocast bf16 over fp32 weights, no optimizer: forward + backward as bench/step.py runs it):
  step:  llm_anatomy.measure.memory.measure_phases (allocated after forward / backward, the peak inside each)
         and max_memory_allocated over one more step after warm-up;
  loss:  the op alone on the same shapes (x (T, H) bf16 and the fp32 head weight, both leaves):
         forward peak and what stays after forward, over what was live before it, the bytes of the
         tensors autograd saved (grad_fn.saved_tensors), and the peak of its backward.
Expandable segments are set (as the memory probe's ±1% claim is measured) unless the caller set an
allocator config. The record holds measurements only; the calculator's figures for the same run are printed
beside them for the operator (the claim tests predict again from the recorded config and run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

CONFIGS = {"seed": ("seed", 16, 4096), "tinyllama": ("tinyllama-1.1b", 8, 2048), "llama3.2": ("llama3.2-1b", 4, 4096)}


def _loss_alone(cfg, run, impl: str) -> dict:
    import torch

    from llm_anatomy.efficient.loss import linear_ce

    T, H, V = run.tokens, cfg.hidden, cfg.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    out = {}
    for i in range(2):  # the first call warms up (Triton compiles, cuBLAS picks its kernels)
        x.grad = w.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_ce(x, w, t, impl=impl)
        torch.cuda.synchronize()
        fwd_peak, after = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
        saved = sum(s.untyped_storage().nbytes() for s in loss.grad_fn.saved_tensors)
        torch.cuda.reset_peak_memory_stats()
        mid = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        out = dict(forward_peak=fwd_peak, after_forward=after, saved=saved,
                   backward_peak_over_start=torch.cuda.max_memory_allocated() - mid,
                   after_backward=torch.cuda.memory_allocated() - before, loss=float(loss))
        del loss
    return out


def _predicted(cfg, run) -> dict:
    from llm_anatomy.calculator import estimate
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.kernel_shapes import lce_peak_bytes

    ph = phases(cfg, run, "efficient", optimizer=None)
    saved = sum(s.bytes for s in estimate(cfg, run, "efficient").components["loss"].saved)
    T, H, V = run.tokens, cfg.hidden, cfg.vocab
    return dict(forward_end=ph["forward_end"], forward_peak=ph["forward_peak"], backward_peak=ph["backward_peak"],
                backward_peak_at=ph["backward_peak_at"], backward_end=ph["backward_end"],
                step_peak=max(ph["forward_peak"] or 0, ph["backward_peak"]),
                loss_saved=saved,
                loss_op_peak_unrounded=lce_peak_bytes(T, H, V) if run.loss_impl == "anatomy" else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--configs", default=",".join(CONFIGS))
    a = p.parse_args(argv)
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad or not a.out:
        p.error(f"unknown config {bad[0]!r}; choose from {', '.join(CONFIGS)}" if bad else "--out or $OUT is needed")
    import torch

    from llm_anatomy.config import ConfigError, ModelConfig, Run
    from llm_anatomy.io import write_atomic
    from llm_anatomy.measure.memory import allocator_conf, measure_phases

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    for n in names:
        preset, B, S = CONFIGS[n]
        try:
            cfg, run = ModelConfig.from_name(preset), Run(B, S, "amp")  # measure_phases builds our loss
        except ConfigError as e:
            p.error(str(e))
        rec = dict(config=n, preset=preset, batch=B, seq=S, dtype="amp", loss_impl=run.loss_impl, variant="efficient",
                   gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                   allocator=allocator_conf(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   command="python3 -m bench.loss_memory " + " ".join(argv if argv is not None else sys.argv[1:]))
        t0 = time.perf_counter()
        rec["phases"] = measure_phases(cfg, run, "efficient", optimizer=None)
        rec["step_peak"] = max(ph["peak"] for ph in rec["phases"] if ph["name"] in ("forward", "backward"))
        torch.cuda.empty_cache()
        rec["loss_alone"] = _loss_alone(cfg, run, run.loss_impl)
        torch.cuda.empty_cache()
        rec["seconds"] = time.perf_counter() - t0
        path = os.path.join(a.out, f"loss-memory-{n}.json")
        write_atomic(path, json.dumps(rec, indent=1))
        pr = _predicted(cfg, run)
        print(f"{n:10s} step peak {rec['step_peak'] / 2**30:7.3f} GiB (predicted {pr['step_peak'] / 2**30:7.3f}, "
              f"{(pr['step_peak'] - rec['step_peak']) / rec['step_peak']:+.2%}); loss saved "
              f"{rec['loss_alone']['saved']:,} B (predicted {pr['loss_saved']:,}); loss forward peak "
              f"{rec['loss_alone']['forward_peak']:,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
