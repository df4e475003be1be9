"""The "Plan a run" sections: a plan's own output (the README's example) and the H200 check of plans
(docs/results.md, from scripts/check_plan.py's record)."""
from __future__ import annotations

import contextlib
import io
import json
import shlex

from llm_anatomy import records

# the README's example: Llama-3.1-8B's own config.json on 8 H100s under FSDP
EXAMPLE = ["--hf-config", "validations/data/hf_configs/Llama-3.1-8B/config.json", "--gpu", "H100", "--gpus", "8",
           "--strategy", "fsdp", "--seq", "8192"]


def example() -> str:
    """The command and what it prints, run in-process from the repo root."""
    import os

    from llm_anatomy.plan_cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(records.ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(EXAMPLE)
    finally:
        os.chdir(cwd)
    if code != 0:
        raise ValueError(f"the README's plan example failed: {err.getvalue().strip()}")
    notes = "".join(f"{line}\n" for line in err.getvalue().splitlines())
    return f"```\n$ anatomy plan {shlex.join(EXAMPLE)}\n{notes}{out.getvalue().rstrip()}\n```"


def check_table() -> str:
    """One row per model of the H200 check: the plan's micro-batch and the next, predicted against measured."""
    doc = json.loads(records.PLAN_CHECK.read_text())
    gib = lambda b: f"{b / 2**30:,.2f}"  # noqa: E731
    lines = [f"`anatomy plan --gpu H200` (one GPU, efficient, AdamW) on real Hugging Face configs; each run in a "
             f"plain user loop (fused AdamW, bf16 autocast, {doc['steps']} steps, peak after the first). "
             f"{doc['gpu']}, torch {doc['torch']}, CUDA {doc['cuda']}, {doc['date']}, "
             f"`PYTORCH_CUDA_ALLOC_CONF={doc['alloc_conf'] or '(unset)'}`; `{doc['command']}`.", "",
             "| model | seq | plan: recompute, micro-batch | predicted GiB | measured GiB | error | next micro-batch "
             "| predicted GiB | measured | budget GiB |", "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    from llm_anatomy.config import Run
    from llm_anatomy.hf_config import read_hf_config
    from llm_anatomy.plan import peak_bytes

    for r in doc["rows"]:
        if not r["plan"]:
            lines.append(f"| {r['model']} | {r['seq']:,} | nothing fits | | | | | | | {gib(r['budget'])} |")
            continue
        a, b = r["runs"]
        cfg = read_hf_config(records.ROOT / r["config"]).config
        # predicted now, from the committed config: the record holds measurements only
        pa, pb = (peak_bytes(cfg, Run(batch=x["batch"], seq=r["seq"], recompute=x["recompute"]), "efficient", 1,
                             "single", "adamw") for x in (a, b))
        meas = lambda x: gib(x["peak"]) if x["outcome"] == "ran" else x["outcome"]  # noqa: E731
        err = f"{(pa - a['peak']) / a['peak']:+.2%}" if a["outcome"] == "ran" else ""
        lines.append(f"| {r['model']} | {r['seq']:,} | {r['plan']['recompute']}, {a['batch']} | {gib(pa)} | "
                     f"{meas(a)} | {err} | {b['batch']} | {gib(pb)} | {meas(b)} | {gib(r['budget'])} |")
    return "\n".join(lines)
