"""GPU check of `anatomy plan`: does the plan's boundary sit where the GPU's is? (measurement + the plan)

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m scripts.check_plan \\
        --out $OUT/plan.json [--only llama-3.1-8b,qwen2.5-7b] [--steps 3]

For each real Hugging Face config (validations/hf_configs.py), at its sequence length: `anatomy plan --gpu H200`
(one GPU, the efficient variant, AdamW) picks a recompute policy and a micro-batch b. Each of b and b + 1 then
runs in a process of its own, in the plain loop a user writes (nothing of llm_anatomy.measure): fused AdamW,
bf16 autocast over fp32 weights, `steps` steps back to back, the peak of torch.cuda.max_memory_allocated
over the steps after the first (the first creates the optimizer state), or "oom". The JSON is rewritten
after every run, so a run cut short keeps its rows; validations/test_plan.py reads it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from llm_anatomy.io import write_atomic  # noqa: E402

# each model at a sequence its users train at (its max_position_embeddings allows it)
SEQ = {"default": 4096, "Qwen2.5-0.5B": 2048, "TinyLlama-1.1B-intermediate-step-1431k-3T": 2048,
       "SmolLM2-360M": 2048, "Llama-3.1-8B": 8192}


def user_loop(path: str, batch: int, seq: int, recompute: str, steps: int) -> dict:
    """One run in this process: the peak allocated bytes of the steps after the first, or an OOM."""
    import torch

    from llm_anatomy.hf_config import read_hf_config
    from llm_anatomy.models import build_model

    cfg = read_hf_config(path).config
    free, total = torch.cuda.mem_get_info()
    model = build_model(cfg, "efficient", device="cuda", recompute=recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab, (batch, seq), device="cuda")
    targets = torch.randint(0, cfg.vocab, (batch, seq), device="cuda")
    peak, times = 0, []
    try:
        for i in range(steps):
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        return dict(outcome="oom", free_at_start=free, total=total)
    return dict(outcome="ran", peak=peak, reserved=torch.cuda.max_memory_reserved(), step_s=times[1:],
                free_at_start=free, total=total, loss=float(loss))


def child(argv: list[str]) -> int:
    path, batch, seq, recompute, steps = argv[0], int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    print(json.dumps(user_loop(path, batch, seq, recompute, steps)))
    return 0


def run_one(path: str, batch: int, seq: int, recompute: str, steps: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", path, str(batch), str(seq), recompute, str(steps)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        oom = "OutOfMemoryError" in p.stderr or "out of memory" in p.stderr
        return dict(outcome="oom" if oom else "error", error=tail[0][:300])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(prog="check_plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpu", default="H200")
    a = ap.parse_args()
    import torch

    from llm_anatomy.hf_config import read_hf_config
    from llm_anatomy.plan import peak_bytes, plan
    from validations.hf_configs import HF_CONFIGS

    if not torch.cuda.is_available():
        print("check_plan: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [n for n in a.only.split(",") if n] or list(HF_CONFIGS)
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               command="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m scripts.check_plan "
                       + " ".join(sys.argv[1:]).replace(os.environ.get("OUT", "\0"), "out"),
               steps=a.steps, rows=[])
    for name in names:
        path = str(HF_CONFIGS[name])
        cfg = read_hf_config(path).config
        seq = SEQ.get(name, SEQ["default"])
        pl = plan(cfg, gpu=a.gpu, seq=seq, lean=False)  # user_loop builds the plain efficient block
        best = pl["best"]
        row = dict(model=name, config=os.path.relpath(path, ROOT), seq=seq, budget=pl["budget_bytes"],
                   capacity=pl["capacity_bytes"], margin=pl["margin"], plan=best, runs=[])
        if best is None:
            row["runs"].append(dict(note="the plan says nothing fits"))
        else:
            from llm_anatomy.config import Run

            for b in (best["micro_batch"], best["micro_batch"] + 1):
                run = Run(batch=b, seq=seq, recompute=best["recompute"])
                t0 = time.time()
                m = run_one(path, b, seq, best["recompute"], a.steps)
                m.update(batch=b, recompute=best["recompute"], wall_s=round(time.time() - t0, 1))
                row["runs"].append(m)  # the measurement only: the claim tests and the README predict again
                got = f"{m['peak'] / 2**30:.2f} GiB" if m["outcome"] == "ran" else m["outcome"]
                pred = peak_bytes(cfg, run, "efficient", 1, "single", "adamw")
                print(f"check_plan: {name} S{seq} B{b} {best['recompute']}: predicted {pred / 2**30:.2f} GiB, "
                      f"measured {got} ({m['wall_s']} s)", file=sys.stderr, flush=True)
        doc["rows"].append(row)
        write_atomic(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
