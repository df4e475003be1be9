"""docs/results.md's regression-gate section: what the gate's own check (scripts/gate_check.sh) has shown, per
machine, from llm_anatomy/records.py GATE_CHECK, and what it has not shown yet.

The gate's threshold is the tightest one at which (a) the unmodified tree passes on every fresh machine in the
record, at least MACHINES of them, and (b) a slowdown of 1 + 1.5 x that threshold in every target failed that
target's own benchmarks and no benchmark whose work never called it (docs/benchmarks.md). Whether an
unmodified run passes a threshold follows from its recorded ratios alone (pytest-benchmark's median:X% rule);
a slowdown counts only at the threshold it ran for."""
from __future__ import annotations

import json
import math
import statistics
from itertools import combinations

from llm_anatomy import records

MACHINES = 3  # fresh machines of one kind the threshold must pass on
MAX_THRESHOLD_PCT = 10.0


def _cudnn(v) -> str:
    """torch.backends.cudnn.version()'s integer (91900) as cuDNN's version (9.19.0)."""
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if isinstance(v, int) else str(v)


def _row(label: str, run: str, row: dict, threshold: float) -> str:
    if "error" in row:
        return f"| {label} | {run} | {threshold:g}% | | no report ({row['error']}) | | | |"
    gated = f"{len(row['failed'])} of {row['benchmarks']}" + (f", {len(row['ungated'])} ungated" if row["ungated"] else "")
    top = f"{row['max_ratio']:.3f}" if row.get("max_ratio") is not None else ""
    if run == "unmodified":
        return f"| {label} | unmodified | {threshold:g}% | | {gated} | | | {top} |"
    mine = len(row["own"]) - len(row["own_not_failed"])
    stray = len(row["failed_without_the_kernel"])
    others = f"{len(row['failed']) - mine}" + (f", {stray} never called it" if stray else " (all called it)")
    factor = f"{row['factor']:.3f}x" if row.get("factor") else "?"
    return f"| {label} | `{run}` | {threshold:g}% | {factor} | {gated} | {mine} of {len(row['own'])} | {others} | {top} |"


def _fresh(machines: list[dict]) -> list[dict]:
    """Machines gated against a baseline recorded elsewhere, with an unmodified run."""
    return [m for m in machines if not m["baseline_recorded_here"] and "max_ratio" in m["runs"].get("unmodified", {})]


def _passes(m: dict, threshold: float) -> bool:
    """Does the machine's unmodified run pass median:threshold%? Its ratios decide, whatever threshold it ran
    at, once its tests passed: its exit code counts against it only where no benchmark failed that run's own
    gate (pytest-benchmark's regression check exits 1 after every test has passed), and `tests_failed` (its
    JUnit report), where recorded, must be 0."""
    row = m["runs"].get("unmodified", {})
    tests_ok = (row.get("rc") == 0 or bool(row.get("failed"))) and row.get("tests_failed", 0) == 0
    return (tests_ok and not row.get("ungated") and row.get("max_ratio") is not None
            and (row["max_ratio"] - 1) * 100 <= threshold)


def _unguarded(m: dict, threshold: float) -> list[str]:
    """The slowdown targets' own benchmarks (a kernel's or an optimizer's alone) whose unmodified run is so far
    under the baseline that a slowdown of 1 + 1.5 x threshold would still pass (ratio x that factor <= 1 +
    threshold): the work got faster since the baseline was recorded, or this machine runs it faster than the
    baseline's did, and the gate does not catch that slowdown there."""
    f, t = 1 + 1.5 * threshold / 100, 1 + threshold / 100
    return sorted(n for n, r in m["runs"].get("unmodified", {}).get("ratio", {}).items()
                  if ("::test_kernel[" in n or "::test_optimizer[" in n) and r * f <= t)


def _caught(machines: list[dict], threshold: float) -> set[str]:
    """The targets whose slowdown, run for this threshold, failed their own benchmarks and no stray one."""
    return {run for m in machines if m["threshold_pct"] == threshold
            for run, row in m["runs"].items() if run != "unmodified" and row.get("ok")}


def _tightest(machines: list[dict]) -> float | None:
    """The smallest whole percent above every fresh machine's unmodified ratio."""
    fresh = _fresh(machines)
    if not fresh:
        return None
    return float(math.floor((max(m["runs"]["unmodified"]["max_ratio"] for m in fresh) - 1) * 100) + 1)


def gate_threshold(doc: dict) -> float | None:
    """The tightest threshold the record proves (module docstring), or None while none is proven."""
    fresh = _fresh(doc["machines"])
    for t in sorted({m["threshold_pct"] for m in doc["machines"]}):
        if (t <= MAX_THRESHOLD_PCT and len(fresh) >= MACHINES and all(_passes(m, t) for m in fresh)
                and set(doc["targets"]) <= _caught(doc["machines"], t)):
            return t
    return None


def _gate_failures(m: dict) -> str:
    """The benchmarks past the machine's own threshold in its unmodified run (its exit 1), as a clause."""
    row = m["runs"].get("unmodified", {})
    if not row.get("failed"):
        return ""
    each = ", ".join(f"`{n.split('::')[-1]}` at {row['ratio'][n]:.3f}" for n in row["failed"])
    return f"; its gate at median:{m['threshold_pct']:g}% failed {each}"


def _suites(machines: list[dict]) -> str:
    """The gate's whole GPU suite (and --quick) as run on these machines, from their claims reports."""
    out = []
    for quick in (False, True):
        runs = [(m, s) for m in machines for s in m.get("suites", []) if ("--quick" in s["command"]) == quick]
        if not runs:
            continue
        each = "; ".join(f"{m['label']}: {s['outcome']['passed']} passed, {s['outcome']['failed']} failed, "
                         f"{s['outcome']['error']} errors"
                         + (f", {s['outcome']['skipped']} skipped" if s["outcome"].get("skipped") else "")
                         + f" in {s['seconds']:.0f} s"
                         + "".join(f" (failed: `{t.split('::')[-1]}`)" for t in s.get("failed_claims", []))
                         + _gate_failures(m) for m, s in runs)
        what = ("`--quick` (the subset without the time claims and the slow tests)" if quick else
                "The gate's command over the whole GPU suite (`-m gpu`: every claim, every benchmark gated)")
        out.append(f"{what}: {each}.")
    return " ".join(out)


def _spread(machines: list[dict]) -> str:
    """How far one benchmark's GPU median moves between machines of one kind on one commit: absolute, and
    over each run's own GEMM and copy references (rel_gemm, rel_copy)."""
    pairs = [(a, b) for a, b in combinations([m for m in machines if m["runs"].get("unmodified", {}).get("refs")], 2)
             if a["commit"] == b["commit"] and all(a[k] == b[k] for k in ("gpu", "driver", "torch", "cuda", "triton"))]
    if not pairs:
        return "no two machines in the record ran one commit, so that spread is not measured yet"
    dev = {"absolute": [], "over the GEMM reference": [], "over the copy reference": []}
    for a, b in pairs:
        ra, rb = a["runs"]["unmodified"], b["runs"]["unmodified"]
        for n in ra["ratio"].keys() & rb["ratio"].keys():
            q = ra["ratio"][n] / rb["ratio"][n]
            dev["absolute"].append(abs(q - 1))
            dev["over the GEMM reference"].append(abs(q * rb["refs"]["gemm_s"] / ra["refs"]["gemm_s"] - 1))
            dev["over the copy reference"].append(abs(q * rb["refs"]["copy_s"] / ra["refs"]["copy_s"] - 1))
    names = ", ".join(f"{a['label']} and {b['label']}" for a, b in pairs)
    figs = "; ".join(f"{k} {100 * statistics.median(v):.2f}% (largest {100 * max(v):.2f}%)" for k, v in dev.items())
    best = min(dev, key=lambda k: statistics.median(dev[k]))
    verdict = ("dividing by a reference does not narrow it, so the gate compares absolute GPU time and its "
               "threshold covers that spread" if best == "absolute" else
               f"the median {best} is the narrowest: a candidate for the gate's figure")
    return (f"on one commit ({names}), a benchmark's GPU median differs between two machines by a median of: "
            f"{figs}; {verdict}")


def current(doc: dict, baseline: str | None = None) -> dict:
    """The record with only the machines whose runs compared against `baseline` (a SHA-256; default the
    committed baselines.json's): a gate verdict holds for one baseline, and a re-recorded one starts anew."""
    baseline = baseline or records.sha256(records.BASELINE)
    return dict(doc, machines=[m for m in doc["machines"] if m.get("baseline_sha256") == baseline])


def summary() -> str:
    """The section's markdown: the runs' table, each machine's facts and commands, then what is shown and
    what is not, stated from the record alone, over the machines gated against the committed baseline."""
    full = json.loads(records.GATE_CHECK.read_text())
    doc = current(full)
    machines, targets = doc["machines"], doc["targets"]
    earlier = [m["label"] for m in full["machines"] if m not in machines]
    lines = [f"The gate's own check (`scripts/gate_check.sh`, [docs/benchmarks.md](docs/benchmarks.md)), from "
             f"`{records.rel(records.GATE_CHECK)}`: each run is the gate's command over every benchmark "
             "against `baselines.json`; a slowed run adds a calibrated spin after every call of one kernel "
             "(`ANATOMY_SLOWDOWN`, 1 + 1.5 x the threshold). \"failed\" is past the threshold; the ratio is "
             "the run's median over the baseline's."
             + (f" Left out, gated against an earlier baseline: {', '.join(earlier)}." if earlier else ""), "",
             "| machine | run | threshold | slowdown | failed of gated | own benchmarks failed | others failed | max ratio |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    lines += [_row(m["label"], run, row, m["threshold_pct"]) for m in machines for run, row in m["runs"].items()]
    lines.append("")
    for m in machines:
        lines.append(f"- {m['label']}: {m['gpu']}, driver {m['driver']}, torch {m['torch']}, CUDA {m['cuda']}, "
                     f"cuDNN {_cudnn(m['cudnn'])}, triton {m['triton']}, {m['date']}, commit {(m.get('commit') or '?')[:7]}"
                     + ("; the baseline was recorded on this machine in the same session (the committed "
                        "`baselines.json`)" if m["baseline_recorded_here"] else "; gated against the committed "
                        "`baselines.json`") + ": " + "; ".join(f"`{c}`" for c in m["commands"]) + "."
                     + (f" {m['note']}" if m.get("note") else ""))
    fresh = _fresh(machines)
    gate = gate_threshold(doc)
    tight = _tightest(machines)
    shown = []
    if fresh:
        worst = max(m["runs"]["unmodified"]["max_ratio"] for m in fresh)
        shown.append(f"the unmodified tree passed on {sum(_passes(m, tight) for m in fresh)} of {len(fresh)} fresh "
                     f"machine{'s' * (len(fresh) > 1)} (gated against a baseline recorded elsewhere; largest ratio "
                     f"{worst:.3f}, so median:{tight:g}% is the tightest whole percent they all pass)")
    for t in sorted({m["threshold_pct"] for m in machines}):
        caught = [k for k in targets if k in _caught(machines, t)]
        if caught:
            shown.append(f"at median:{t:g}%, the slowdowns ({1 + 1.5 * t / 100:.3f}x) of "
                         f"{', '.join(f'`{k}`' for k in caught)} each failed every benchmark of their own and none "
                         "whose work did not call them")
    suites = _suites(machines)
    lines += ["", "**Shown:** " + ("; ".join(shown) + "." if shown else "no unmodified run passed and no slowdown "
                                   "was caught.") + (f" {suites}" if suites else ""), ""]
    todo = []
    if len(fresh) < MACHINES:
        todo.append(f"{MACHINES - len(fresh)} more fresh machine{'s' * (MACHINES - len(fresh) > 1)} (gated against "
                    f"a baseline recorded elsewhere) of the {MACHINES} on which the threshold is chosen")
    never = [k for k in targets if not any(k in _caught(machines, t) for t in {m["threshold_pct"] for m in machines})]
    if never:
        todo.append(f"a slowdown that fails its own benchmarks and no other, for {', '.join(f'`{k}`' for k in never)}")
    if tight is not None:
        bare = []  # thresholds at which no slowdown ran yet
        for t in range(int(tight), int(gate if gate is not None else MAX_THRESHOLD_PCT + 1)):
            left = [k for k in targets if k not in _caught(machines, float(t))]
            if left and len(left) < len(targets):
                todo.append(f"at median:{t}%, the slowdowns of {', '.join(f'`{k}`' for k in left)}")
            elif left:
                bare.append(t)
        if len(bare) == 1:
            todo.append(f"at median:{bare[0]}%, every slowdown")
        elif bare:
            todo.append(f"every slowdown at one threshold from median:{bare[0]}% to median:{bare[-1]}% (the "
                        "tightest at which all are caught is the gate)")
    whole = [(m, s) for m in fresh for s in m.get("suites", []) if "--quick" not in s["command"]]
    # clean: every test passed, none skipped (a skipped claim is one the run did not re-prove), and its
    # benchmarks pass the gate's threshold (while none is proven, the tightest they all pass)
    at = gate if gate is not None else tight
    clean = [m["label"] for m, s in whole if s["outcome"]["failed"] == s["outcome"]["error"] == 0
             and not s["outcome"].get("skipped") and _passes(m, at)]
    if len(clean) < MACHINES:
        dirty = [m["label"] for m, s in whole if m["label"] not in clean]
        todo.append(f"the whole GPU suite clean on {MACHINES - len(clean)} more fresh machine"
                    f"{'s' * (MACHINES - len(clean) > 1)} (clean so far: {', '.join(clean) or 'none'}"
                    + (f"; with failures or skips: {', '.join(dirty)}" if dirty else "") + ")")
    stale = _unguarded(fresh[-1], gate) if fresh and gate is not None else []
    if stale:
        names = ", ".join(f"`{n.split('::')[-1]}`" for n in stale)
        todo.append(f"a baseline that guards the newest tree: on {fresh[-1]['label']}, the newest record, {len(stale)} "
                    f"kernel or optimizer benchmark{'s' * (len(stale) > 1)} ran so far under `baselines.json` that a "
                    f"{1 + 1.5 * gate / 100:.3f}x slowdown would still pass median:{gate:g}% ({names}); re-record "
                    "`baselines.json` on the H200 kind and repeat the checks above against it")
    if gate is not None:
        lines.append(f"**The gate:** median:{gate:g}%, the tightest threshold at which both hold (the CI workflow's "
                     "threshold).")
        lines.append("")
        lines.append(f"**Not yet shown:** {'; '.join(todo)}." if todo else
                     "**Not yet shown:** nothing the gate's check covers.")
    else:
        lines.append(f"**Not yet shown:** {'; '.join(todo) or 'a threshold at which both hold'}. Until then the "
                     f"threshold is provisional and CI gates at median:{MAX_THRESHOLD_PCT:g}%.")
    lines.append("")
    lines.append(f"**Between machines of one kind** (same GPU, driver and versions): {_spread(machines)}. Between "
                 "kinds nothing transfers: record a baseline on the kind the gate runs on.")
    return "\n".join(lines)
