"""Add one machine's gate check (scripts/gate_check.sh) to the committed record, llm_anatomy/records.py GATE_CHECK.

    python3 -m scripts.gate_check_record RECORD WORK [WORK ...] --command CMD [--command CMD ...]
        [--suite CLAIMS_JSON ...] [--label NAME] [--driver VERSION] [--date YYYY-MM-DD] [--commit SHA]
        [--note TEXT]

Each WORK is a copy of gate_check.sh's folder (its OUT) from one machine: gate_check.json, each run's report
(<run>.json), baseline.json and env.json. The summary is the last WORK's gate_check.json (gate_check.sh writes
it over every run in its folder); the run reports, the baseline and env.json are looked up in every WORK, in
order. The GPU's facts come from env.json, else from the baseline's extra_info with --driver and --date. The
entry names the baseline its runs compared against by SHA-256 (WORK's baseline.json, else the committed
baselines.json): llm_anatomy/report/gate.py counts only the runs against the committed one.
Each slowed run's row gains, when its summary lacks them, `called` (the benchmarks whose work called the
target: extra_info["slowdown_calls"]) and `factor`, so the record alone shows which failures the gate's rules
allow; the unmodified row gains the session's reference times (`refs`). Each --suite is the claims report
(claims-gpu.json) of a GPU-suite run on the same machine: its command, seconds and outcome are kept under
`suites`. The entry named --label (default "machine <n>") is replaced if present. Commands are stored with
absolute paths cut to out/<name> (llm_anatomy.records.command). Exit 2 on unreadable input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from llm_anatomy import records  # noqa: E402
from scripts.gate_check_summary import _load, refs  # noqa: E402

ENV_KEYS = ("gpu", "driver", "torch", "cuda", "cudnn", "triton")
# every slowdown target of validations/slowdown.py, as gate_check.sh's ALL_TARGETS runs them
TARGETS = ("rms_norm", "swiglu", "gpt_oss", "rope_qkv", "linear_ce", "attention", "adamw", "fused_ademamix")


def _find(works: list[Path], name: str) -> Path | None:
    hits = [w / name for w in works if (w / name).is_file()]
    return hits[-1] if hits else None


def suite_row(path: Path) -> dict:
    """One GPU-suite run on this machine, from the claims report it wrote (validations/conftest.py
    --claims-report): its command, wall seconds and outcome, and the tests whose claims failed."""
    rep = json.loads(path.read_text())
    if not isinstance(rep.get("seconds"), (int, float)) or not isinstance(rep.get("outcome"), dict):
        raise ValueError(f"{path}: no seconds or outcome: not a claims report of a whole run")
    failed = sorted({r["test"] for r in rep.get("rows", []) if r.get("passed") is False})
    return dict(command=records.command(rep["command"]), seconds=rep["seconds"], outcome=rep["outcome"],
                date=rep["date"], **({"failed_claims": failed} if failed else {}))


def machine_entry(works: list[Path], commands: list[str], label: str, driver: str | None, date: str | None,
                  suites: list[Path] = ()) -> dict:
    """One machine's entry: the GPU's facts, the commands, the summary's runs with `called` and `factor` (and
    the unmodified run's `refs`), and the GPU-suite runs of that machine (`suites`, from their claims reports)."""
    summary = json.loads((works[-1] / "gate_check.json").read_text())
    base_path = _find(works, "baseline.json")
    base = json.loads(base_path.read_text()) if base_path else {}
    env_path = _find(works, "env.json")
    env = json.loads(env_path.read_text()) if env_path else {}
    info = base["benchmarks"][0]["extra_info"] if base.get("benchmarks") else {}
    facts = {k: env.get(k, info.get(k)) for k in ENV_KEYS}
    facts["driver"] = facts["driver"] or driver
    facts["date"] = (env.get("date") or date or base.get("datetime", ""))[:10]
    missing = [k for k, v in facts.items() if not v]
    if missing:
        raise ValueError(f"no {', '.join(missing)}: give --driver / --date, or a WORK with env.json")
    runs = summary["runs"]
    unmodified = _find(works, "unmodified.json")
    if "unmodified" in runs and not runs["unmodified"].get("refs") and unmodified:
        runs["unmodified"]["refs"] = refs(_load(str(unmodified)))
    for run, row in runs.items():
        if run == "unmodified" or "error" in row or ("called" in row and "factor" in row):
            continue
        report = _find(works, f"{run}.json")
        if report is None:
            raise ValueError(f"no {run}.json in {', '.join(map(str, works))}")
        cur = {b["fullname"]: b.get("extra_info", {}) for b in json.loads(report.read_text())["benchmarks"]}
        row["called"] = sorted(n for n, x in cur.items() if x.get("slowdown_calls", {}).get(run))
        factors = {x.get("slowdown", {}).get(run) for n, x in cur.items() if n in row["own"]} - {None}
        row["factor"] = factors.pop() if len(factors) == 1 else None
    # the tree that ran: the baseline's commit where it was recorded here, else the first run report found
    reports = [r for r in (_find(works, f"{run}.json") for run in runs) if r is not None]
    if not base and not reports:
        raise ValueError(f"no run report (<run>.json) in {', '.join(map(str, works))}")
    tree = base or json.loads(reports[0].read_text())
    return dict(label=label, **facts, commit=tree.get("commit_info", {}).get("id"),
                baseline_recorded_here=_find(works, "record.log") is not None,
                baseline_sha256=records.sha256(base_path or records.BASELINE),
                commands=[records.command(c) for c in commands], threshold_pct=summary["threshold_pct"],
                runs=runs, ok=summary["ok"], suites=[suite_row(p) for p in suites])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gate_check_record.py", description=__doc__.splitlines()[0])
    p.add_argument("record", type=Path)
    p.add_argument("work", type=Path, nargs="+")
    p.add_argument("--command", action="append", required=True, help="a command that made WORK, in order")
    p.add_argument("--suite", type=Path, action="append", default=[],
                   help="a claims report (claims-gpu.json) of a GPU-suite run on this machine")
    p.add_argument("--label")
    p.add_argument("--driver")
    p.add_argument("--date")
    p.add_argument("--commit", help="the commit whose tree ran, where the report's git facts name another (a "
                   "copied working tree keeps the .git of an older HEAD: commit_info.dirty)")
    p.add_argument("--note", help="what the run's outcome does not say (why its skipped tests skipped), rendered "
                   "after its commands")
    a = p.parse_args(argv)
    try:
        doc = json.loads(a.record.read_text()) if a.record.exists() else dict(targets=list(TARGETS), machines=[])
        label = a.label or f"machine {len(doc['machines']) + 1}"
        entry = machine_entry(a.work, a.command, label, a.driver, a.date, a.suite)
        entry["commit"] = a.commit or entry["commit"]
        if a.note:
            entry["note"] = a.note
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"gate_check_record: error: {e}", file=sys.stderr)
        return 2
    doc["machines"] = [m for m in doc["machines"] if m["label"] != label] + [entry]
    a.record.parent.mkdir(parents=True, exist_ok=True)
    a.record.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{records.rel(a.record)}: {label}, {entry['gpu']}, {entry['date']}, runs {', '.join(entry['runs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
