"""Loss curves of several training runs (train_log.json files) on one plot, plus a JSON summary."""
from __future__ import annotations

import json
from pathlib import Path

from llm_anatomy.io import write_atomic
from llm_anatomy.report.plots import png_bytes


def compare(logs: list[Path], png: Path, out_json: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in logs]
    fig, ax = plt.subplots(figsize=(7, 4))
    summary = []
    for r in runs:
        steps = [s["step"] for s in r["steps"]]
        loss = [s["loss"] for s in r["steps"]]
        tps = sorted(s["tokens_per_s"] for s in r["steps"][1:])  # step 1 includes warm-up
        ax.plot(steps, loss, label=f"{r['variant']} ({tps[len(tps) // 2] / 1e3:,.0f}k tok/s)")
        summary.append(dict(variant=r["variant"], device=r["device"], final_loss=loss[-1],
                            eval=r["eval"], median_tokens_per_s=tps[len(tps) // 2], steps=len(steps)))
    base = runs[0]["steps"]
    for r, s in zip(runs[1:], summary[1:]):
        s["max_abs_loss_diff_vs_first"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(base, r["steps"]))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{runs[0]['config'].get('name', '')} · B={runs[0]['run']['batch']} S={runs[0]['run']['seq']} "
                 f"{runs[0]['run']['dtype']} · {runs[0]['device']}")
    ax.legend()
    fig.tight_layout()
    write_atomic(png, png_bytes(fig))
    plt.close(fig)
    out = dict(runs=summary, sources=[Path(p).name for p in logs])  # names only: no machine's absolute path
    write_atomic(out_json, json.dumps(out, indent=1))
    return out
