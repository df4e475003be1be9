"""The committed gate check (CPU): the committed baseline gates every benchmark, the record
(reports/h200/gate/check.json) obeys the gate's rules, scripts/gate_check_record.py adds a machine to it, and
the README's gate section and the CI workflow's threshold are what the record proves (llm_anatomy/report/gate.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from validations.test_gate_check import BASE, ROOT, _run, summarize

# ---- the committed baseline and the committed gate check (llm_anatomy/records.py GATE_CHECK) ----------------
def _benchmark_functions() -> set[str]:
    """'<file stem>::<test>' for every test in validations/test_*.py that takes the benchmark fixture."""
    import ast

    out = set()
    for path in sorted((ROOT / "validations").glob("test_*.py")):
        for f in ast.parse(path.read_text()).body:
            if isinstance(f, ast.FunctionDef) and any(a.arg == "benchmark" for a in f.args.args):
                out.add(f"{path.stem}::{f.name}")
    return out


def test_the_committed_baseline_gates_every_benchmark():
    """baselines.json is on GPU time, names exactly the benchmarks that the design card's command runs
    (`pytest validations -m gpu`, collected here), carries no host name or absolute path, and the design
    card's flags accept it (conftest refuses a baseline on another timer)."""
    text = (ROOT / "baselines.json").read_text()
    base = json.loads(text)
    assert {b["options"]["timer"] for b in base["benchmarks"]} == {"gpu_time"}
    assert all(b["stats"]["median"] > 0 for b in base["benchmarks"])
    assert "node" not in base["machine_info"] and '"/' not in text and "\\\\" not in text
    r = subprocess.run([sys.executable, "-m", "pytest", "validations", "-m", "gpu", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "--benchmark-enable", "--benchmark-compare=baselines.json",
                        "--benchmark-compare-fail=median:5%"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-800:] + r.stderr[-800:]
    fns = _benchmark_functions()
    ran = {ln for ln in r.stdout.splitlines()
           if "::" in ln and f"{Path(ln.split('::')[0]).stem}::{ln.split('::')[1].split('[')[0]}" in fns}
    assert ran == {b["fullname"] for b in base["benchmarks"]}


def _gate_record() -> dict:
    from llm_anatomy import records

    return json.loads(records.GATE_CHECK.read_text())


def test_the_gate_check_record_obeys_the_gates_rules():
    """Each machine of the committed gate check, read against the committed baseline: the threshold is at
    most 10%; each run gated every benchmark; the unmodified run, where there is one, failed none (exit 0,
    its largest ratio under the threshold) or failed the gate alone (exit 1, a ratio past it); each slowdown (1 + 1.5 x threshold)
    failed every benchmark of the target's own and only benchmarks whose work called it. Each run's failures
    are recomputed from its ratios."""
    from scripts.gate_check_summary import own

    doc = _gate_record()
    names = {b["fullname"] for b in json.loads((ROOT / "baselines.json").read_text())["benchmarks"]}
    assert doc["machines"] and set(doc["targets"]) == set(__import__("validations.slowdown").slowdown.TARGETS)
    for m in doc["machines"]:
        thr = m["threshold_pct"]
        assert 0 < thr <= 10 and m["gpu"] and m["driver"] and m["torch"] and m["date"]
        assert all(not c.startswith("/") and " /" not in c for c in m["commands"])
        # a slowed run is judged within itself (its own benchmarks and the others, in one process), so a
        # machine may hold slowed runs without an unmodified one; only machines with one count as fresh
        assert m["runs"] and set(m["runs"]) <= {"unmodified", *doc["targets"]}
        for run, row in m["runs"].items():
            assert set(row["ratio"]) == names and row["benchmarks"] == len(names) and not row["ungated"]
            assert row["failed"] == sorted(n for n, r in row["ratio"].items() if (r - 1) * 100 > thr)
            assert row["max_ratio"] == pytest.approx(max(row["ratio"].values()), abs=5e-5)
            if run == "unmodified":  # clean, or exit 1 from the gate alone (a benchmark past the threshold)
                assert (row["rc"] == 0) == (not row["failed"]) == ((row["max_ratio"] - 1) * 100 <= thr)
                assert row["rc"] in (0, 1) and row["ok"] == (row["rc"] == 0)
                continue
            mine = sorted(n for n in names if own(n, run))
            assert row["factor"] == pytest.approx(1 + 1.5 * thr / 100)
            assert row["rc"] == 1 and mine and row["own"] == mine and set(mine) <= set(row["called"])
            assert row["own_not_failed"] == sorted(set(mine) - set(row["failed"]))
            assert row["failed_without_the_kernel"] == sorted(set(row["failed"]) - set(row["called"]))
            assert min(row["injected_fraction"]) >= row["factor"] - 1 - 1e-3
            assert row["ok"] == (not row["own_not_failed"] and not row["failed_without_the_kernel"])
        assert m["ok"] == all(row["ok"] for row in m["runs"].values())
        # a run that broke the rules stays in the record (the gate counts only the runs that held: gate.py
        # _caught), and its machine says why in a note
        assert m["ok"] or m.get("note")


def test_gate_check_record_adds_a_machine(tmp_path):
    """scripts/gate_check_record.py: the summary's runs gain `called` and `factor` from the run reports; the
    GPU's facts come from env.json or the baseline plus --driver; a label is replaced, not repeated; an
    absolute path in a command is cut to out/<name>; without a driver, or with neither a baseline nor a run
    report to name the tree, it is a one-line error, exit 2."""
    from scripts.gate_check_record import main as record

    from llm_anatomy import records

    names = list(BASE)
    work = tmp_path / "w"
    work.mkdir()
    base = dict(benchmarks=[dict(b, extra_info=dict(gpu="G", torch="t", cuda="c", cudnn=1, triton="tr"))
                            for b in BASE.values()], datetime="2026-12-01T21:50:52", commit_info=dict(id="abc"))
    (work / "baseline.json").write_text(json.dumps(base))
    slow = _run({n: 1.0 for n in names}, {names[0]: 3, names[3]: 9})
    for b in slow.values():
        b["extra_info"]["slowdown"] = {"rms_norm": 1.075}
    (work / "rms_norm.json").write_text(json.dumps(dict(benchmarks=list(slow.values()))))
    s = summarize(BASE, {"unmodified": (BASE, 0), "rms_norm": (slow, 0)}, 5.0)
    for row in s["runs"].values():
        row.pop("called", None), row.pop("factor", None)  # a summary from before the rows carried them
    (work / "gate_check.json").write_text(json.dumps(s))
    rec = tmp_path / "gate" / "check.json"
    bare = tmp_path / "bare"  # a summary and env.json whose run reports did not come back
    bare.mkdir()
    (bare / "gate_check.json").write_text(json.dumps(dict(s, runs={"unmodified": s["runs"]["unmodified"]})))
    (bare / "env.json").write_text(json.dumps(dict(gpu="H", driver="590", torch="t", cuda="c", cudnn=2, triton="tr",
                                                   date="2026-12-03 00:00:00 UTC")))
    assert record([str(rec), str(bare), "--command", "x"]) == 2 and not rec.exists()
    argv = [str(rec), str(work), "--command", f"OUT={tmp_path}/out bash scripts/gate_check.sh"]
    assert record(argv) == 2 and not rec.exists()  # no env.json, no --driver
    assert record(argv + ["--driver", "580"]) == 0 and record(argv + ["--driver", "580"]) == 0
    doc = json.loads(rec.read_text())
    assert [m["label"] for m in doc["machines"]] == ["machine 1", "machine 2"]
    m = doc["machines"][0]
    assert (m["gpu"], m["driver"], m["date"], m["commit"]) == ("G", "580", "2026-12-01", "abc")
    assert m["baseline_sha256"] == records.sha256(work / "baseline.json")  # the baseline its runs compared against
    assert m["commands"] == ["OUT=out/out bash scripts/gate_check.sh"]
    assert m["runs"]["rms_norm"]["called"] == sorted([names[0], names[3]]) and m["runs"]["rms_norm"]["factor"] == 1.075
    (work / "env.json").write_text(json.dumps(dict(gpu="H", driver="590", torch="t2", cuda="c2", cudnn=2,
                                                   triton="tr2", date="2026-12-02 01:00:00 UTC")))
    (work / "unmodified.json").write_text(json.dumps(dict(benchmarks=[
        dict(b, extra_info=dict(ref_gemm_s=0.5, ref_copy_s=0.25)) for b in BASE.values()])))
    claims = tmp_path / "claims-gpu.json"
    claims.write_text(json.dumps(dict(command=f"pytest validations -m gpu --claims-report {tmp_path}/c.json",
                                      seconds=481.6, outcome=dict(passed=3, failed=0, error=0), date="d")))
    assert record([str(rec), str(work), "--command", "x", "--label", "machine 1", "--suite", str(claims)]) == 0
    m = json.loads(rec.read_text())["machines"][-1]
    assert m["runs"]["unmodified"]["refs"] == dict(gemm_s=0.5, copy_s=0.25)
    assert m["suites"] == [dict(command="pytest validations -m gpu --claims-report out/c.json", seconds=481.6,
                                outcome=dict(passed=3, failed=0, error=0), date="d")]
    claims.write_text(json.dumps(dict(command="x", date="d")))  # not a whole run's report
    assert record([str(rec), str(work), "--command", "x", "--label", "machine 1", "--suite", str(claims)]) == 2
    doc = json.loads(rec.read_text())
    assert [(m["label"], m["driver"], m["date"]) for m in doc["machines"]] == [("machine 2", "580", "2026-12-01"),
                                                                                ("machine 1", "590", "2026-12-02")]


def test_the_results_gate_section_is_rendered_from_the_record():
    """docs/results.md's gate-h200 section is what `anatomy report` renders from the committed record (its
    links as written from docs/)."""
    import re

    from llm_anatomy.report.gate import summary
    from llm_anatomy.report.regenerate import from_docs

    text = (ROOT / "docs" / "results.md").read_text()
    block = re.search(r"<!-- gate-h200:start -->\n(.*?)\n<!-- gate-h200:end -->", text, re.S)
    assert block and block.group(1) == from_docs(summary())


def test_the_gate_section_says_what_is_not_shown(tmp_path, monkeypatch):
    """On a synthetic record: a slowdown that failed a benchmark which never called the kernel is shown as
    such and not as caught; missing targets and fresh machines are named; a threshold counts as the gate only
    where every fresh machine passes and every target was caught at it; the tighter thresholds' missing
    slowdowns are named; three fresh machines with every target caught at the tightest whole percent leave
    nothing unshown."""
    from llm_anatomy import records
    from llm_anatomy.report import gate

    names = list(BASE)
    good = summarize(BASE, {"unmodified": (_run({n: 1.0 for n in names}, {}), 0),
                            "rms_norm": (_run({names[0]: 1.08, names[1]: 1.08}, {names[0]: 1, names[1]: 1}), 1)}, 5.0)
    stray = summarize(BASE, {"rms_norm": (_run({names[0]: 1.08, names[1]: 1.08, names[4]: 1.06},
                                               {names[0]: 1, names[1]: 1}), 1)}, 5.0)
    good["runs"]["rms_norm"]["factor"] = stray["runs"]["rms_norm"]["factor"] = 1.075
    facts = dict(gpu="G", driver="d", torch="t", cuda="c", cudnn=91900, triton="tr", date="2026-12-01", commands=["x"],
                 threshold_pct=5.0, commit="abc", baseline_sha256=records.sha256(records.BASELINE))
    m1 = dict(facts, label="machine 1", baseline_recorded_here=True, runs=dict(good["runs"], **stray["runs"]), ok=False)
    path = tmp_path / "check.json"
    layout = records._layout  # records' names resolve through it on every read: patched, GATE_CHECK is `path`
    monkeypatch.setattr(records, "_layout", lambda root: dict(layout(root), GATE_CHECK=path))
    doc = dict(targets=["rms_norm", "swiglu"], machines=[m1])
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert "1 never called it" in text and "the slowdowns" not in text.split("**Shown:**")[1].split("\n")[0]
    todo = text.split("**Not yet shown:**")[1].split("\n")[0]
    assert "`swiglu`" in todo and "`rms_norm`" in todo  # never run; run, but it failed a benchmark that never called it
    assert "3 more fresh machines" in todo and "CI gates at median:10%" in todo and "cuDNN 9.19.0" in text
    assert gate.gate_threshold(doc) is None and "not measured yet" in text

    def fresh(ratio: float, threshold: float, caught: tuple[str, ...], label: str, failed: int = 0) -> dict:
        runs = {"unmodified": dict(good["runs"]["unmodified"], max_ratio=ratio,
                                   ratio={n: ratio for n in names}, refs=dict(gemm_s=1.0, copy_s=2.0))}
        runs.update({k: dict(good["runs"]["rms_norm"]) for k in caught})
        suite = dict(command="pytest validations -m gpu --benchmark-compare=baselines.json", seconds=400.0,
                     outcome=dict(passed=9, failed=failed, error=0), date="2026-12-01",
                     **({"failed_claims": ["validations/test_x.py::test_claim[a]"]} if failed else {}))
        return dict(facts, label=label, baseline_recorded_here=False, ok=True, runs=runs, threshold_pct=threshold,
                    suites=[suite])

    # three fresh machines, all caught at 5%, unmodified ratio 1.0: 5% is the gate, 1..4% left to show
    doc = dict(targets=["rms_norm", "swiglu"], machines=[fresh(1.0, 5.0, ("rms_norm", "swiglu"), f"m{i}") for i in (1, 2, 3)])
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert gate.gate_threshold(doc) == 5.0 and "**The gate:** median:5%" in text
    assert "every slowdown at one threshold from median:1% to median:4%" in text
    assert "passed on 3 of 3 fresh machines" in text and "absolute 0.00%" in text
    # one more fresh machine whose unmodified run passes only 6%: 5% is no longer proven
    doc["machines"].append(fresh(1.055, 5.0, (), "m4"))
    path.write_text(json.dumps(doc))
    assert gate.gate_threshold(doc) is None and "CI gates at median:10%" in gate.summary()
    # the tightest whole percent above 1.041 is 5%: with every target caught there, nothing is left
    doc["machines"] = [fresh(1.041, 5.0, ("rms_norm", "swiglu"), f"m{i}") for i in (1, 2, 3)]
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert "**Not yet shown:** nothing the gate's check covers." in text and "passed on 3 of 3" in text
    # the same, but one machine's whole suite failed a claim: it is named, and a clean third is still to show
    doc["machines"][2] = fresh(1.041, 5.0, ("rms_norm", "swiglu"), "m3", failed=1)
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert gate.gate_threshold(doc) == 5.0 and "(failed: `test_claim[a]`)" in text
    assert ("**Not yet shown:** the whole GPU suite clean on 1 more fresh machine (clean so far: m1, m2; with "
            "failures or skips: m3).") in text
    # a run that skipped claims did not re-prove them: not clean either, and its skips are shown
    doc["machines"][2] = fresh(1.041, 5.0, ("rms_norm", "swiglu"), "m3")
    doc["machines"][2]["suites"][0]["outcome"]["skipped"] = 2
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert "m3: 9 passed, 0 failed, 0 errors, 2 skipped in 400 s" in text and "with failures or skips: m3" in text
    # the newest machine runs a kernel's own benchmark 5% under the baseline: there a 1.075x slowdown would pass
    # median:5%, so the baseline no longer guards it; a model benchmark as far under is not a slowdown's own
    doc["machines"][2] = fresh(1.041, 5.0, ("rms_norm", "swiglu"), "m3")
    kernel, model = names[0], names[3]
    doc["machines"][2]["runs"]["unmodified"]["ratio"].update({kernel: 0.95, model: 0.95})
    path.write_text(json.dumps(doc))
    todo = gate.summary().split("**Not yet shown:**")[1].split("\n")[0]
    assert "on m3, the newest record, 1 kernel or optimizer benchmark ran so far under" in todo
    assert kernel.split("::")[-1] in todo and model.split("::")[-1] not in todo
    doc["machines"][2]["runs"]["unmodified"]["ratio"][kernel] = 0.98  # 0.98 x 1.075 > 1.05: still caught
    path.write_text(json.dumps(doc))
    assert "guards the newest tree" not in gate.summary()
    # a machine gated against another baseline (one re-recorded since) counts for nothing here, and is named
    doc["machines"][0] = dict(doc["machines"][0], baseline_sha256="0" * 64)
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert "Left out, gated against an earlier baseline: m1." in text and "| m1 |" not in text
    assert "1 more fresh machine" in text and gate.gate_threshold(gate.current(doc)) is None
    # an unmodified run that exited 1 on its own gate (median:4%, ratio 1.042) passes 5% by its ratios; one that
    # exited 1 with no benchmark past its gate had a failed test, and passes no threshold
    doc["machines"] = [fresh(1.02, 5.0, ("rms_norm", "swiglu"), f"m{i}") for i in (1, 2)]
    doc["machines"].append(fresh(1.042, 4.0, (), "m3"))
    doc["machines"][2]["runs"]["unmodified"].update(rc=1, failed=[names[0]], ok=False)
    path.write_text(json.dumps(doc))
    assert gate.gate_threshold(doc) == 5.0
    assert f"m3: 9 passed, 0 failed, 0 errors in 400 s; its gate at median:4% failed `{names[0].split('::')[-1]}` at " \
           "1.042" in gate.summary()
    doc["machines"][2]["runs"]["unmodified"].update(tests_failed=1)  # its JUnit report: a test failed too
    assert gate.gate_threshold(doc) is None
    doc["machines"][2]["runs"]["unmodified"].update(rc=1, failed=[], max_ratio=1.01, tests_failed=0)
    assert gate.gate_threshold(doc) is None  # exit 1 with nothing past its gate: not the gate's exit
    # a slowdown shown at 4% counts at 4% only: with swiglu missing there, the gate stays at 5%
    doc["machines"] = [fresh(1.02, 5.0, ("rms_norm", "swiglu"), f"m{i}") for i in (1, 2)] + [fresh(1.02, 4.0, ("rms_norm",), "m3")]
    path.write_text(json.dumps(doc))
    text = gate.summary()
    assert gate.gate_threshold(doc) == 5.0 and "at median:4%, the slowdowns of `swiglu`" in text


def test_the_ci_workflow_gates_at_the_recorded_threshold():
    """.github/workflows/gpu.yml runs the design card's command at the threshold the committed record proves
    for the committed baseline, or at the 10% ceiling while none is proven (the README's gate section says so)."""
    from llm_anatomy.report import gate

    t = gate.gate_threshold(gate.current(_gate_record()))
    t = gate.MAX_THRESHOLD_PCT if t is None else t  # unproven for this baseline: the provisional ceiling
    assert f"--benchmark-compare-fail=median:{t:g}%" in (ROOT / ".github/workflows/gpu.yml").read_text()


def test_the_recorded_suite_runs_are_gated_and_their_failures_named():
    """Each GPU-suite run kept in the record (its claims report's outcome) was gated against the committed
    baseline, and a run with failures names the tests whose claims failed (the README's gate section shows
    them); each fresh machine's unmodified row keeps its session's reference times."""
    doc = _gate_record()
    runs = [s for m in doc["machines"] for s in m.get("suites", [])]
    assert runs and all(s["outcome"]["passed"] > 0 and s["seconds"] > 0 for s in runs)
    assert all("--benchmark-compare=baselines.json" in s["command"] for s in runs)
    for s in runs:
        failed = s["outcome"]["failed"] + s["outcome"]["error"]
        assert bool(s.get("failed_claims")) == (failed > 0), s
        assert len(s.get("failed_claims", [])) <= failed, s
    from llm_anatomy.report.gate import current, summary

    section = summary()  # the section shows the machines gated against the committed baseline
    shown = [s for m in current(doc)["machines"] for s in m.get("suites", [])]
    for t in (t for s in shown for t in s.get("failed_claims", [])):
        assert f"(failed: `{t.split('::')[-1]}`)" in section
    assert all(m["runs"]["unmodified"]["refs"]["gemm_s"] > 0 for m in doc["machines"] if "unmodified" in m["runs"])
