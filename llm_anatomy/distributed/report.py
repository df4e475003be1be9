"""Markdown tables of data-parallel costs, generated from the calculator (pure Python, no torch).

    python -m llm_anatomy.distributed.report            # the llama3-8b tables for docs/distributed.md

The numbers are predictions; validations/test_distributed.py checks them against FSDP2 and DDP
(exactly, at 2 and 4 gloo ranks and at 8, 64 and 1024 fake-process-group ranks).
"""
from __future__ import annotations

from llm_anatomy.calculator import param_count
from llm_anatomy.calculator.comm import estimate_distributed
from llm_anatomy.config import ModelConfig, Run

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
GiB = 2**30


def _g(n: int) -> str:
    return f"{n / GiB:,.3f}"


def memory_table(cfg: ModelConfig | str = "llama3-8b", run: Run | None = None, worlds=WORLDS,
                 optimizer: str = "adamw", rank: int = 0) -> str:
    """Per-rank bytes (GiB = 2**30 B) of params, grads and optimizer state: DDP, then FSDP2 at each world size."""
    cfg = ModelConfig.from_name(cfg) if isinstance(cfg, str) else cfg
    run = run or Run(batch=1, seq=8192, dtype="amp")
    ddp = estimate_distributed(cfg, run, worlds[0], "ddp", optimizer=optimizer, compute_s=_NO_COMPUTE)["memory"]
    lines = [
        f"Per-rank memory of {cfg.name} ({param_count(cfg):,} parameters), {run.dtype} policy "
        f"({'bf16' if run.dtype == 'bf16' else 'fp32'} master weights), {optimizer} state, rank {rank}; "
        "activations and communication buffers not included. GiB = 2^30 bytes.",
        "",
        "| strategy | ranks | params (GiB) | grads (GiB) | optimizer (GiB) | total (GiB) | vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| ddp | any | {_g(ddp['params'])} | {_g(ddp['grads'])} | {_g(ddp['optimizer'])} | {_g(ddp['total'])} | 1.0x |",
    ]
    for w in worlds:
        m = estimate_distributed(cfg, run, w, "fsdp", rank=min(rank, w - 1), optimizer=optimizer,
                                 compute_s=_NO_COMPUTE)["memory"]
        lines.append(f"| fsdp | {w} | {_g(m['params'])} | {_g(m['grads'])} | {_g(m['optimizer'])} | {_g(m['total'])} "
                     f"| {ddp['total'] / m['total']:,.1f}x less |")
    return "\n".join(lines) + "\n"


def comm_table(cfg: ModelConfig | str = "llama3-8b", run: Run | None = None, worlds=WORLDS, gpu: str = "h200-sxm",
               gpus_per_node: int = 8, mfu: float = 0.4) -> str:
    """Per-step collectives, bytes, modelled comm time and exposed time, DDP (steady state) vs FSDP2."""
    cfg = ModelConfig.from_name(cfg) if isinstance(cfg, str) else cfg
    run = run or Run(batch=1, seq=8192, dtype="amp")
    lines = [
        f"Communication per step of {cfg.name}, batch {run.batch} x seq {run.seq} per rank, {run.dtype}; "
        f"{gpu}, {gpus_per_node} GPUs per node, compute at {mfu:.0%} MFU. Calls and bytes are exact "
        "(claimed); times are an alpha-beta model (llm_anatomy/calculator/comm.py), not measured. GB = 1e9 bytes.",
        "",
        "| strategy | ranks | calls | bytes (GB) | comm (ms) | exposed (ms) | link |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in ("ddp", "fsdp"):
        for w in worlds:
            c = estimate_distributed(cfg, run, w, s, gpu=gpu, gpus_per_node=gpus_per_node, mfu=mfu)["comm"]
            lines.append(f"| {s} | {w} | {c['count_total']} | {c['bytes_total'] / 1e9:,.2f} | {c['time_s'] * 1e3:,.1f} "
                         f"| {c['exposed_s'] * 1e3:,.1f} | {c['link']} |")
    return "\n".join(lines) + "\n"


_NO_COMPUTE = {"forward": 0.0, "backward": 0.0}  # memory tables need no timing

if __name__ == "__main__":
    print(memory_table())
    print(comm_table())
