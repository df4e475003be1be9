"""The README's regression-gate section: what the gate's own check (scripts/gate_check.sh) has shown, per
machine, from anatomy/records.py GATE_CHECK, and what it has not shown yet."""
from __future__ import annotations

import json
import math

from anatomy import records

# The gate's threshold is the tightest that passes the unmodified tree on this many fresh machines of one
# kind, at most MAX_THRESHOLD_PCT (docs/benchmarks.md); until the record holds them, the threshold is provisional.
MACHINES = 3
MAX_THRESHOLD_PCT = 10.0


def _cudnn(v) -> str:
    """torch.backends.cudnn.version()'s integer (91900) as cuDNN's version (9.19.0)."""
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if isinstance(v, int) else str(v)


def _row(label: str, run: str, row: dict) -> str:
    if "error" in row:
        return f"| {label} | {run} | | no report ({row['error']}) | | | |"
    gated = f"{len(row['failed'])} of {row['benchmarks']}" + (f", {len(row['ungated'])} ungated" if row["ungated"] else "")
    top = f"{row['max_ratio']:.3f}" if row.get("max_ratio") is not None else ""
    if run == "unmodified":
        return f"| {label} | unmodified | | {gated} | | | {top} |"
    mine = len(row["own"]) - len(row["own_not_failed"])
    stray = len(row["failed_without_the_kernel"])
    others = f"{len(row['failed']) - mine}" + (f", {stray} never called it" if stray else " (all called it)")
    factor = f"{row['factor']:.3f}x" if row.get("factor") else "?"
    return f"| {label} | `{run}` | {factor} | {gated} | {mine} of {len(row['own'])} | {others} | {top} |"


def _tightest(passed: list[dict]) -> float | None:
    """The smallest whole percent above every unmodified ratio of the machines that passed."""
    if not passed:
        return None
    worst = max(m["runs"]["unmodified"]["max_ratio"] for m in passed)
    return float(math.floor((worst - 1) * 100) + 1)


def summary() -> str:
    """The section's markdown: the runs' table, each machine's facts and commands, then what is shown and
    what is not, stated from the record alone."""
    doc = json.loads(records.GATE_CHECK.read_text())
    machines = doc["machines"]
    lines = [f"The gate's own check (`scripts/gate_check.sh`, [docs/benchmarks.md](docs/benchmarks.md)), from "
             f"`{records.rel(records.GATE_CHECK)}`: each run is the design card's command over every benchmark "
             "against `baselines.json`; a slowed run adds a calibrated spin after every call of one kernel "
             "(`ANATOMY_SLOWDOWN`, 1 + 1.5 x the threshold). \"failed\" is past the threshold; the ratio is "
             "the run's median over the baseline's.", "",
             "| machine | run | slowdown | failed of gated | own benchmarks failed | others failed | max ratio |",
             "|---|---|---:|---:|---:|---|---:|"]
    lines += [_row(m["label"], run, row) for m in machines for run, row in m["runs"].items()]
    lines.append("")
    for m in machines:
        lines.append(f"- {m['label']}: {m['gpu']}, driver {m['driver']}, torch {m['torch']}, CUDA {m['cuda']}, "
                     f"cuDNN {_cudnn(m['cudnn'])}, triton {m['triton']}, {m['date']}, median:{m['threshold_pct']:g}%"
                     + ("; the baseline was recorded on this machine in the same session (the committed "
                        "`baselines.json`)" if m["baseline_recorded_here"] else "; gated against the committed "
                        "`baselines.json`") + ": " + "; ".join(f"`{c}`" for c in m["commands"]) + ".")
    fresh = [m for m in machines if not m["baseline_recorded_here"]]
    passed = [m for m in machines if m["runs"].get("unmodified", {}).get("ok")]
    thresholds = sorted({m["threshold_pct"] for m in machines})
    slowed = {run for m in machines for run, row in m["runs"].items() if run != "unmodified" and row.get("ok")}
    missing = [t for t in doc["targets"] if t not in slowed]  # each target's slowdown is shown on one machine
    shown = (f"At median:{'/'.join(f'{t:g}' for t in thresholds)}%, the unmodified tree passed on {len(passed)} of "
             f"{len(machines)} machine{'s' * (len(machines) > 1)} (largest ratio "
             f"{max(m['runs']['unmodified']['max_ratio'] for m in passed):.3f}); " if passed else
             "No unmodified run passed; ")
    shown += (f"the slowdowns of {', '.join(f'`{t}`' for t in doc['targets'] if t in slowed)} each failed every "
              "benchmark of their own and none whose work did not call them." if slowed else "no slowdown was caught.")
    lines += ["", f"**Shown:** {shown}", ""]
    todo = []
    if missing:
        todo.append(f"a slowdown that fails its own benchmarks and no other, for {', '.join(f'`{t}`' for t in missing)}")
    tight = _tightest(passed)
    if tight is not None and len(passed) >= MACHINES and tight < min(thresholds):
        todo.append(f"the slowdowns at 1.5 x median:{tight:g}%, the tightest whole-percent threshold the unmodified tree "
                    f"passes on those machines (until they fail their own benchmarks too, the gate stays at "
                    f"median:{min(thresholds):g}%, where they were shown)")
    if len(machines) < MACHINES:
        todo.append(f"machines {', '.join(str(i) for i in range(len(machines) + 1, MACHINES + 1))} of the {MACHINES} "
                    "fresh ones on which the threshold is chosen")
    if not fresh:
        todo.append("a machine that did not record the baseline itself (every unmodified run above compares a "
                    "machine with its own session: run-to-run noise, not the spread between machines)")
    proven = "" if len(passed) >= MACHINES else ", the gate is not proven across machines,"
    lines.append(f"**Not yet shown:** {'; '.join(todo)}. Until then the threshold is provisional{proven} and CI gates "
                 f"at median:{MAX_THRESHOLD_PCT:g}%." if todo else "**Not yet shown:** nothing the gate's check covers.")
    lines.append("")
    lines.append("**Between machines of one kind** (same GPU, driver and versions), the gate compares absolute GPU "
                 "medians, so it transfers only as far as the machines' clocks agree; that spread is what the "
                 "threshold must cover. Each benchmark also stores its time over a bf16 GEMM and a 1 GiB copy "
                 "measured in the same run (`rel_gemm`, `rel_copy`), which are expected to agree more closely "
                 f"between machines of one kind; with {len(machines)} machine{'s' * (len(machines) > 1)} in the record, "
                 "neither spread is "
                 "measured yet. Between kinds nothing transfers: record a baseline on the kind the gate runs on.")
    return "\n".join(lines)
