"""docs/results.md's real-depth timing section: the user's loop at real depth (llm_anatomy.records.
REAL_DEPTH_RUNS), one freshly started H200 per run, against the profile calibrated first in that run, the
packaged profile (another machine's) and the datasheet. The comparison is llm_anatomy/real_depth.py's, the functions validations/test_real_depth.py
claims with, so docs/results.md prints the numbers the tests check.

python3 -m llm_anatomy.report.real_depth prints the section.
"""
from __future__ import annotations

import json
from pathlib import Path

from llm_anatomy import records

PACKAGED, DATASHEET = "h200-measured", "h200-sxm"
QUANTITIES = ("GPU time, forward+backward", "GPU time, step", "wall step (GPU-bound)")
SEVEN_B = ("llama2-7b-B1S4096-efficient", "mistral-7b-B1S4096-efficient")  # the 7B-class presets, one step each


def load(record: Path) -> dict:
    """{head, rows (those that ran), profile (this run's, else None)} of one committed run."""
    head = json.loads(record.read_text())
    prof = record.with_name("calibrated.json")
    same = prof.is_file() and head.get("profile") == prof.name
    return dict(head=head, rows=[r for r in head["rows"] if "error" not in r], profile=str(prof) if same else None,
                env=json.loads(record.with_name("env.json").read_text()) if record.with_name("env.json").is_file()
                else {})


def _cell(t: dict, q: str) -> str:
    v = t.get(q)
    return "- | - | -" if v is None else f"{v['within']}/{v['n']} | {v['mape']:.1%} | {v['worst']:+.1%}"


def _components(t: dict) -> dict | None:
    """The components' figures pooled: n, within their ±15%, MAPE, worst."""
    cs = [v for q, v in t.items() if q not in QUANTITIES]
    if not cs:
        return None
    n = sum(v["n"] for v in cs)
    worst = max((v["worst"] for v in cs), key=abs)
    return dict(n=n, within=sum(v["within"] for v in cs), mape=sum(v["mape"] * v["n"] for v in cs) / n, worst=worst)


def table(runs: list[tuple[Path, dict]]) -> str:
    from llm_anatomy import real_depth as rd

    lines = ["| run | variant | quantity (tolerance) | this run's profile: within | MAPE | worst | packaged: within | "
             "MAPE | worst | datasheet: within | MAPE | worst |", "|---|---|---|" + "---:|" * 9]
    for path, run in runs:
        if run["profile"] is None:
            continue
        for variant in rd.VARIANTS:
            rows = [r for r in run["rows"] if r["variant"] == variant]
            if not rows:
                continue
            ts = [rd.error_table(rows, g) for g in (run["profile"], PACKAGED, DATASHEET)]
            for q, tol in [(q, rd.TOL[q]) for q in QUANTITIES] + [("components, forward and backward", rd.COMPONENT_TOL)]:
                cells = [_cell({q: _components(t)} if q.startswith("components") else t, q) for t in ts]
                lines.append(f"| {path.parent.name} | {variant} | {q} (±{tol:.0%}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seven_b_lines(runs: list[tuple[Path, dict]]) -> list[str]:
    """`anatomy estimate --gpu h200-measured --optimizer adamw` (the packaged profile) for the 7B-class presets
    at B1 S4096, efficient, against the wall-clock step measured in each run."""
    from llm_anatomy import real_depth as rd

    out = []
    for path, run in runs:
        for r in run["rows"]:
            if r["id"] in SEVEN_B:
                p = rd.predicted(r, PACKAGED)["steady"]["step_s"] * 1e3
                own = rd.predicted(r, run["profile"])["steady"]["step_s"] * 1e3 if run["profile"] else None
                m = r["wall"]["step_ms"]
                out.append(f"{r['id'].split('-B')[0]} on {path.parent.name}: predicted {p:.1f} ms, measured {m:.1f} ms "
                           f"({p / m - 1:+.1%}" + ("" if own is None else f"; with that run's profile {own / m - 1:+.1%}")
                           + ")")
    return out


def summary(paths: tuple[Path, ...] | None = None) -> str:
    runs = [(p, load(p)) for p in (records.REAL_DEPTH_RUNS if paths is None else paths) if p.is_file()]
    if not runs:
        return "No real-depth run is committed (`ONLY=real-depth REAL_DEPTH_SEED=<new> bash scripts/gpu_records.sh`)."
    n_rows = sum(len(r["rows"]) for _, r in runs)
    out = [f"{n_rows} rows on {len(runs)} freshly started H200s: the named real presets at B1 S4096 and 30 real-depth "
           "configs per run (12-32 layers, 0.5-8 B parameters, GQA and MHA, tied and untied, vocab 32k-128k, sequence "
           "1k-16k, MLP recompute where a plain step does not fit), drawn with a seed chosen after the timing model's "
           "code was final. The loop is a user's: fused AdamW, bf16 autocast over fp32 weights, steps back to back. "
           "Each run calibrates first (`anatomy calibrate`, in its own process), then measures; figures are "
           "(predicted - measured) / measured, as within / n, MAPE and worst. The wall step is claimed where the model "
           "calls the step GPU-bound (busy >= 90%); host-bound rows are left out of that line.", "", table(runs), "",
           "`anatomy estimate --gpu h200-measured --optimizer adamw` (the packaged profile, calibrated on another "
           "machine) for the 7B-class presets, B1 S4096, efficient, against the step measured: "
           + "; ".join(seven_b_lines(runs)) + ".", ""]
    for path, run in runs:
        h, e = run["head"], run["env"]
        out.append(f"- {path.parent.name}: {h['gpu']}, driver {e.get('driver', '?')}, torch {h['torch']}, CUDA "
                   f"{h['cuda']}, cuDNN {h['cudnn']}, triton {e.get('triton', '?')}, {h['date']}, draw seed {h['seed']}: "
                   f"`{records.command(h['command'])}` (`{records.rel(path.parent)}/`).")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary())
