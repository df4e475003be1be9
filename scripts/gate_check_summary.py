"""Summarise scripts/gate_check.sh's runs: which benchmarks each slowdown failed, and whether the gate
behaved as it must.

    python3 -m scripts.gate_check_summary BASELINE THRESHOLD_PCT OUT_JSON RUN=JSON[:RC[:JUNIT]] ...

A run named "unmodified" must fail nothing (and exit 0). A run named after a slowdown target K (validations/
slowdown.py) must fail every benchmark of K's own (test_kernel[K/...], test_optimizer[K/...]) and no
benchmark whose work never called K (its extra_info["slowdown_calls"] has no K); its row lists the
benchmarks that called K (`called`) and the factor it ran with. The unmodified row keeps the session's
reference GEMM and copy times (`refs`). A benchmark fails
when its median exceeds the baseline's by more than THRESHOLD_PCT, which is
pytest-benchmark's --benchmark-compare-fail=median:X% rule; a benchmark missing from the baseline
is listed as ungated. With the run's JUnit XML (pytest --junitxml), its row keeps `tests_failed`: the tests
that failed or errored, which its exit code alone does not tell apart from the gate's own failure (pytest-
benchmark's regression check exits 1 after every test passed). Exit 0 when every run behaved, 1 when one did
not, 2 on unreadable input.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET


def _load(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {b["fullname"]: b for b in json.load(f)["benchmarks"]}


def own(name: str, target: str) -> bool:
    """Is this benchmark one of the target's own: the kernel or optimizer alone?"""
    return f"::test_kernel[{target}/" in name or f"::test_optimizer[{target}/" in name


def tests_failed(junit: str) -> int:
    """Failures plus errors over every testsuite of a JUnit XML report."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    return sum(int(x.get("failures", 0)) + int(x.get("errors", 0)) for x in suites)


def refs(cur: dict[str, dict]) -> dict | None:
    """The run's reference GEMM and copy times (measured once per session, in every benchmark's extra_info):
    what the README compares between machines beside the absolute medians."""
    for b in cur.values():
        x = b.get("extra_info", {})
        if x.get("ref_gemm_s") and x.get("ref_copy_s"):
            return dict(gemm_s=x["ref_gemm_s"], copy_s=x["ref_copy_s"])
    return None


def summarize(base: dict[str, dict], runs: dict[str, tuple], threshold: float) -> dict:
    """runs: {name: (report's benchmarks or None, exit code[, tests failed])}."""
    out = dict(threshold_pct=threshold, runs={})
    ok_all = True
    for run, (cur, rc, *tests) in runs.items():
        if cur is None:  # the run wrote no report (pytest crashed): see its log
            out["runs"][run] = dict(rc=rc, ok=False, error="no report")
            ok_all = False
            continue
        ratios = {n: b["stats"]["median"] / base[n]["stats"]["median"] for n, b in cur.items() if n in base}
        failed = sorted(n for n, r in ratios.items() if (r - 1) * 100 > threshold)
        row = dict(rc=rc, benchmarks=len(cur), ungated=sorted(set(cur) - set(base)), failed=failed,
                   max_ratio=max(ratios.values(), default=None),
                   ratio={n: round(r, 4) for n, r in sorted(ratios.items())})
        if tests and tests[0] is not None:
            row["tests_failed"] = tests[0]
        if run == "unmodified":
            row["ok"] = not failed and not row["ungated"] and rc == 0
            row["refs"] = refs(cur)
        else:  # the target's own benchmarks, from the baseline: one that crashed counts as not failed
            mine = sorted(n for n in base if own(n, run))
            called = sorted(n for n in cur if cur[n].get("extra_info", {}).get("slowdown_calls", {}).get(run))
            outside = sorted(set(failed) - set(called))
            injected = [f for n in mine if n in cur for f in cur[n].get("extra_info", {}).get("slowdown_injected", {}).get(run, [])]
            factors = {cur[n].get("extra_info", {}).get("slowdown", {}).get(run) for n in mine if n in cur} - {None}
            row.update(own=mine, own_not_failed=sorted(set(mine) - set(failed)), called=called,
                       failed_without_the_kernel=outside, factor=factors.pop() if len(factors) == 1 else None,
                       injected_fraction=[min(injected), max(injected)] if injected else None)
            row["ok"] = bool(mine) and not row["own_not_failed"] and not outside and not row["ungated"]
        ok_all &= row["ok"]
        out["runs"][run] = row
    out["ok"] = ok_all
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        base, threshold = _load(argv[0]), float(argv[1])
        runs = {}
        for spec in argv[3:]:
            name, _, rest = spec.partition("=")
            path, _, rest = rest.partition(":")
            rc, _, junit = rest.partition(":")
            runs[name] = (_load(path) if path else None, int(rc or 0), tests_failed(junit) if junit else None)
    except (OSError, ValueError, KeyError, ET.ParseError) as e:
        print(f"gate_check_summary: error: {e}", file=sys.stderr)
        return 2
    s = summarize(base, runs, threshold)
    with open(argv[2], "w") as f:
        json.dump(s, f, indent=1)
    for run, row in s["runs"].items():
        if "error" in row:
            print(f"{run:15s} BAD {row['error']} (rc={row['rc']})")
            continue
        extra = "" if run == "unmodified" else (f"; own {len(row['own']) - len(row['own_not_failed'])}/{len(row['own'])}"
                                                f" failed, {len(row['failed_without_the_kernel'])} without it failed")
        print(f"{run:15s} {'ok ' if row['ok'] else 'BAD'} {len(row['failed']):3d} of {row['benchmarks']} failed, "
              f"max ratio {row['max_ratio'] or 0:.3f}{extra}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
