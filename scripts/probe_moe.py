"""Mixture-of-experts models on a GPU, measured: the memory phases under a forced routing and the step in the
user's own loop, for depth- and width-reduced real families and one full-width model. Measurement only: the
same measurements run live in the GPU suite against the calculator (validations/test_moe_live.py).

    python3 -m scripts.probe_moe --out $OUT/moe.json [--cases qwen3moe-L2 ...] [--budget-s 300]

Per case (cases()) and route (measure/routing.py: "balanced", the calculator's default histogram, and "skewed",
every token on experts 0..k-1):
  phases   measure.memory.measure_phases with fused AdamW (max_memory_allocated and memory_allocated at each
           phase boundary, less what the process held before), in this process;
  step     scripts/user_loop.py's loop (fused AdamW, bf16 autocast over fp32 weights, steps back to back,
           CUDA events; then a profiled pass for the kernels' GPU time), in a process of its own;
  kernels  (asked for by --what) each phase's and component's kernel time and heaviest kernels
           (measure/timeline.py kernel_times), in a process of its own.
A case that fails (an out-of-memory too) records its error and the run goes on; --out is rewritten after each."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.hf_config import from_hf_config

HF = Path(__file__).resolve().parent.parent / "validations" / "data" / "hf_configs"


def cases() -> dict[str, tuple[ModelConfig, Run, tuple[str, ...]]]:
    """{id: (config, run, variants)}: each real family reduced in depth, then in width, Qwen3-30B-A3B at its
    full width 8 layers deep (5.6 B parameters, 90 GB of fp32 weights, gradients and AdamW state), gpt-oss-20b
    two layers deep (its sinks, its window and its expert biases; under amp and on bf16 weights), and
    OLMoE-1B-7B (its whole q/k norms) four layers deep and whole (6.9 B parameters, 111 GiB predicted: an H200's)."""
    qwen, mixtral = from_hf_config(HF / "Qwen3-30B-A3B"), from_hf_config(HF / "Mixtral-8x7B-v0.1")
    gptoss, olmoe = from_hf_config(HF / "gpt-oss-20b"), from_hf_config(HF / "OLMoE-1B-7B-0924")
    both = ("efficient", "baseline")
    return {
        "qwen3moe-L2": (replace(qwen, layers=2), Run(2, 2048), both),
        "qwen3moe-narrow-L4": (replace(qwen, layers=4, hidden=1024, heads=16, kv_heads=4, experts=64,
                                       expert_intermediate=384, vocab=32768), Run(4, 2048), both),
        "mixtral-L1": (replace(mixtral, layers=1), Run(2, 4096), both),
        "mixtral-narrow-L4": (replace(mixtral, layers=4, hidden=1024, heads=8, kv_heads=2, expert_intermediate=3584),
                              Run(4, 2048), both),
        "qwen3moe-L8": (replace(qwen, layers=8), Run(2, 2048), ("efficient",)),
        "gptoss-L2": (replace(gptoss, layers=2), Run(2, 2048), both),  # a window layer, then a full one
        # bf16 weights (FSDP2's bf16 gathers compute so): the expert biases added after the grouped GEMMs
        "gptoss-L2-bf16": (replace(gptoss, layers=2), Run(2, 2048, "bf16"), ("efficient",)),
        "olmoe-L4": (replace(olmoe, layers=4), Run(4, 2048), both),
        "olmoe": (olmoe, Run(4, 2048), ("efficient",)),
    }


def phases_row(cfg, run, variant, route) -> dict:
    from llm_anatomy.measure.memory import measure_phases
    from llm_anatomy.measure.routing import force

    return dict(phases=measure_phases(cfg, run, variant, "adamw", prepare=force(route)))


def step_row(cfg, run, variant, route) -> dict:
    """The user's loop in a process of its own (its profiler would slow every later launch of this one)."""
    return _apart("_step", cfg, run, variant, route)


def kernels_row(cfg, run, variant, route) -> dict:
    """Each phase's and component's GPU kernel time, its heaviest kernels by name (measure/timeline.py
    kernel_times), in a process of its own."""
    return _apart("_kernels", cfg, run, variant, route)


def _apart(fn: str, cfg, run, variant, route) -> dict:
    code = ("import json, sys; from scripts import probe_moe; "
            f"print(json.dumps(probe_moe.{fn}(json.loads(sys.argv[1]))))")
    arg = dict(cfg=cfg.to_dict(), batch=run.batch, seq=run.seq, variant=variant, route=route)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], capture_output=True, text=True, timeout=300,
                         cwd=HF.parents[2])
    if out.returncode != 0:
        return dict(error=(out.stderr.strip().splitlines() or ["no output"])[-1][:300])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _step(arg: dict) -> dict:
    from llm_anatomy.measure.routing import force
    from scripts import user_loop

    cfg, run = ModelConfig(**arg["cfg"]), Run(arg["batch"], arg["seq"])
    model, opt, ids, targets = user_loop.setup(cfg, run, arg["variant"])
    force(arg["route"])(model)
    for _ in range(user_loop.WARMUP):
        user_loop.step(model, opt, ids, targets)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    smi = user_loop.Smi()
    w = user_loop.wall(model, opt, ids, targets)
    clocks = smi.stop()
    k = user_loop.profiled(model, opt, ids, targets)
    return dict(wall=w, clocks=clocks, kernels=k, gpu_busy=k["step_ms"] / w["step_ms"],
                max_allocated=torch.cuda.max_memory_allocated())


def _kernels(arg: dict) -> dict:
    from llm_anatomy.measure.routing import force
    from llm_anatomy.measure.timeline import kernel_times

    cfg, run = ModelConfig(**arg["cfg"]), Run(arg["batch"], arg["seq"])
    return kernel_times(cfg, run, arg["variant"], "adamw", prepare=force(arg["route"]), top=24)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_moe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", help="case ids (default: all)")
    ap.add_argument("--routes", nargs="*", default=["balanced", "skewed"])
    ap.add_argument("--what", nargs="*", default=["phases", "step"], help="phases, step, kernels")
    ap.add_argument("--budget-s", type=float, default=300.0, help="no case starts after this many seconds")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_moe: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    every = cases()
    unknown = sorted(set(a.cases or []) - set(every))
    if unknown:
        print(f"probe_moe: error: unknown case(s) {', '.join(unknown)}; known: {', '.join(every)}", file=sys.stderr)
        return 2
    t0, out = time.monotonic(), Path(a.out)
    head = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                cuda=torch.version.cuda, command="python3 -m scripts.probe_moe " + " ".join(argv or sys.argv[1:]),
                rows=[])
    # every case's phases, then every case's step under the first route, then under the others
    todo = [("phases", cid, v, r) for cid in (a.cases or every) for v in every[cid][2] for r in a.routes]
    todo += [(w, cid, v, r) for w in ("step", "kernels") for r in a.routes for cid in (a.cases or every)
             for v in every[cid][2]]
    todo = [t for t in todo if t[0] in a.what]
    for i, (what, cid, variant, route) in enumerate(todo):
        if time.monotonic() - t0 > a.budget_s:
            head["cut"] = f"budget {a.budget_s:g} s reached after {i} of {len(todo)}"
            break
        cfg, run, _ = every[cid]
        row = dict(what=what, id=cid, variant=variant, route=route, cfg=cfg.to_dict(), batch=run.batch, seq=run.seq)
        try:
            row.update(dict(phases=phases_row, step=step_row, kernels=kernels_row)[what](cfg, run, variant, route))
        except Exception as e:  # noqa: BLE001 - a probe records what failed (an OOM too) and goes on
            torch.cuda.empty_cache()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        head["rows"].append(row)
        print(f"[{i + 1}/{len(todo)} {time.monotonic() - t0:5.0f}s] {what} {cid} {variant} {route}: "
              f"{row.get('error', 'ok')[:120]}", file=sys.stderr, flush=True)
        out.write_text(json.dumps(head, indent=1))
    head["seconds"] = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
