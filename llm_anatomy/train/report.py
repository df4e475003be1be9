"""What a run leaves behind: train_log.json (the source of truth: every step's loss, lr, tokens/s,
and the eval losses) and loss.png drawn from it. Both written by llm_anatomy.io.write_atomic; a write that
fails (a full disk) is one line naming the file (storage.StorageError)."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

from llm_anatomy.io import write_atomic
from llm_anatomy.train.storage import storage_error


def log_dict(summary: dict) -> dict:
    h = summary["history"]
    norms = h.get("grad_norm") or [None] * len(h["loss"])
    steps = [dict(step=i + 1, loss=l, lr=lr, tokens_per_s=t, grad_norm=g)  # the history always starts at step 1
             for i, (l, lr, t, g) in enumerate(zip(h["loss"], h["lr"], h["tokens_per_s"], norms))]
    keep = ("status", "variant", "strategy", "world", "mesh", "device", "config", "run", "optimizer", "seed", "data",
            "options", "start_step", "resumed_from", "changed_on_resume", "checkpoint", "flops_per_step", "peak_flops")
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), **{k: summary.get(k) for k in keep},
                steps=steps, eval=[dict(step=s, loss=l) for s, l in h["eval"]])


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s["step"] for s in log["steps"]], [s["loss"] for s in log["steps"]], lw=1, label="train")
    if log["eval"]:
        ax.plot([e["step"] for e in log["eval"]], [e["loss"] for e in log["eval"]], "o-", ms=4, label="eval")
    cfg, run = log["config"], log["run"]
    ax.set_title(f"{cfg['name']} · {log['variant']} · B={run['batch']} S={run['seq']} {run['dtype']} · "
                 f"{log['optimizer']}", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def write(out: str | Path, summary: dict, plot_png: bool = True) -> dict:
    """Write train_log.json and (plot_png) loss.png under `out`; returns their paths."""
    d = Path(out)
    log = log_dict(summary)
    log_path, png = d / "train_log.json", d / "loss.png"
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(log_path, json.dumps(log, indent=1))
        if not plot_png:
            return dict(log=str(log_path), plot=None)
        plot(log, png)
    except OSError as e:
        raise storage_error(e, f"the run's log in {d}") from None
    return dict(log=str(log_path), plot=str(png))
