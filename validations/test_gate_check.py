"""scripts/gate_check.sh and its summary (CPU): the verdict rules on synthetic runs, the script's syntax
and its one-line refusal without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from gate_check_summary import main, summarize  # noqa: E402

F = "validations/test_bench_kernels.py::"
M = "validations/test_benchmarks.py::"


def _b(name: str, median: float, calls: dict | None = None) -> dict:
    return dict(fullname=name, stats=dict(median=median), extra_info=dict(slowdown_calls=calls or {}))


BASE = {n: _b(n, 1.0) for n in (F + "test_kernel[rms_norm/seed/fwd]", F + "test_kernel[rms_norm/seed/bwd]",
                                 F + "test_kernel[swiglu/seed/fwd]", M + "test_model[x/efficient/model/fwd]",
                                 M + "test_model[x/baseline/model/fwd]")}


def _run(ratios: dict, calls: dict) -> dict:
    return {n: _b(n, r, {"rms_norm": calls.get(n, 0)} if calls.get(n) else {}) for n, r in ratios.items()}


def test_the_verdict_rules():
    """unmodified: nothing over the threshold; a slowdown: every own benchmark over it, and nothing over
    it that never called the kernel (a benchmark that called it may fail or not)."""
    names = list(BASE)
    good = _run({names[0]: 1.08, names[1]: 1.07, names[2]: 1.01, names[3]: 1.06, names[4]: 0.99},
                {names[0]: 5, names[1]: 5, names[3]: 50})
    s = summarize(BASE, {"unmodified": (_run({n: 1.02 for n in names}, {}), 0), "rms_norm": (good, 1)}, 5.0)
    assert s["ok"] and s["runs"]["rms_norm"]["failed"] == sorted(names[:2] + [names[3]])
    missed = dict(good, **_run({names[1]: 1.04}, {names[1]: 5}))  # an own benchmark under the threshold
    stray = dict(good, **_run({names[4]: 1.06}, {}))  # a baseline-model benchmark failed without rms_norm
    crashed = {n: b for n, b in good.items() if n != names[1]}  # an own benchmark that wrote no figure
    for bad in (missed, stray, crashed):
        assert not summarize(BASE, {"rms_norm": (bad, 1)}, 5.0)["ok"]
    assert not summarize(BASE, {"unmodified": (_run({n: 1.051 for n in names}, {}), 1)}, 5.0)["ok"]
    assert not summarize(BASE, {"unmodified": (None, 1)}, 5.0)["ok"]


def test_main_writes_the_summary(tmp_path):
    base, cur = tmp_path / "base.json", tmp_path / "cur.json"
    base.write_text(json.dumps(dict(benchmarks=list(BASE.values()))))
    cur.write_text(json.dumps(dict(benchmarks=list(BASE.values()))))
    assert main([str(base), "5", str(tmp_path / "s.json"), f"unmodified={cur}:0"]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["runs"]["unmodified"]["max_ratio"] == 1.0
    assert main([str(tmp_path / "missing.json"), "5", str(tmp_path / "s.json"), f"unmodified={cur}:0"]) == 2
    # with the run's JUnit report, its row keeps the tests that failed or errored, over every testsuite
    junit = tmp_path / "u.xml"
    junit.write_text('<testsuites><testsuite failures="1" errors="1" tests="5"/><testsuite failures="0" errors="0"/>'
                     '</testsuites>')
    assert main([str(base), "5", str(tmp_path / "s.json"), f"unmodified={cur}:1:{junit}"]) == 1
    assert json.loads((tmp_path / "s.json").read_text())["runs"]["unmodified"]["tests_failed"] == 2
    junit.write_text("<testsuite")
    assert main([str(base), "5", str(tmp_path / "s.json"), f"unmodified={cur}:1:{junit}"]) == 2


def test_gate_check_refuses_without_a_gpu():
    r = subprocess.run(["bash", "scripts/gate_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "gate_check: error: needs a CUDA GPU; this machine has none"


def test_gate_check_runs_the_benchmark_files_in_the_suites_order():
    """gate_check.sh's default SELECT lists its files in the order the whole suite runs them (pytest collects
    validations/ by file name): a benchmark's GPU time depends on what ran before it in its process
    (docs/benchmarks.md, "Order in the process"), so the slowdown runs match the baseline's order."""
    import re

    text = (ROOT / "scripts/gate_check.sh").read_text()
    files = re.search(r'SELECT:-([^}"]+)', text).group(1).split()
    paths = [f.split("::")[0] for f in files]
    assert paths == sorted(paths) and all((ROOT / p).is_file() for p in paths)
    assert {"validations/test_bench_kernels.py", "validations/test_benchmarks.py"} <= set(paths)


def test_a_baseline_on_another_timer_is_refused(tmp_path):
    """--benchmark-compare against figures timed by another clock (wall-clock seconds) is a one-line usage
    error, not a comparison of wall seconds with GPU seconds; a gpu_time file is accepted."""
    wall = dict(benchmarks=[dict(fullname="x", options=dict(timer="perf_counter"), stats=dict(median=1.0))])
    gpu = dict(benchmarks=[dict(fullname="x", options=dict(timer="gpu_time"), stats=dict(median=1.0))])
    for data, rc in ((wall, 4), (gpu, 0)):
        path = tmp_path / f"{rc}.json"
        path.write_text(json.dumps(data))
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "validations/test_gate_check.py", f"--benchmark-compare={path}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == rc, r.stdout[-600:] + r.stderr[-600:]
        assert ("holds figures timed by perf_counter, not gpu_time" in r.stdout + r.stderr) == (rc == 4)


SYNTHETIC = '''
import os

import pytest

from validations.fake_gpu import FakeGPU
from validations.gpu_clock import GpuRound, gpu_time

GPU = FakeGPU()
SLOW = dict(i.split("=") for i in filter(None, os.environ.get("ANATOMY_SLOWDOWN", "").split(",")))

def round_(seconds):
    return GpuRound(lambda: GPU.run(seconds), cycles_per_s=GPU.rate, event=GPU.event, sleep=GPU.sleep)

@pytest.mark.benchmark(timer=gpu_time)
@pytest.mark.parametrize("k", ["rms_norm/seed/fwd", "swiglu/seed/fwd"])
def test_kernel(benchmark, k):
    name = k.split("/")[0]
    benchmark.extra_info["slowdown_calls"] = {name: 1} if name in SLOW else {}
    benchmark.pedantic(round_(0.002 * float(SLOW.get(name, 1))), rounds=5, warmup_rounds=1)

@pytest.mark.benchmark(timer=gpu_time)
def test_model(benchmark):  # 2 ms of other work and 0.1 ms of each kernel
    benchmark.extra_info["slowdown_calls"] = {k: 1 for k in SLOW}
    benchmark.pedantic(round_(0.002 + sum(0.0001 * float(SLOW.get(k, 1)) for k in ("rms_norm", "swiglu"))),
                       rounds=5, warmup_rounds=1)
'''


@pytest.mark.slow  # ~25 s: eight pytest runs
def test_gate_check_end_to_end_on_a_fake_gpu(tmp_path):
    """scripts/gate_check.sh itself, over synthetic benchmarks on a fake GPU (a stand-in torch says CUDA is
    there): given a wall-clock BASELINE it records a GPU-time one, gates the unmodified run and one run per
    slowdown, and its summary passes; at a threshold that the slowdown does not reach, it fails."""
    (tmp_path / "test_gate.py").write_text(SYNTHETIC)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --benchmark-disable\n")
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text("class cuda:\n    is_available = staticmethod(lambda: True)\n")

    wall = tmp_path / "wall.json"
    wall.write_text(json.dumps(dict(benchmarks=[dict(fullname="x", options=dict(timer="perf_counter"),
                                                     stats=dict(median=1.0))])))

    def check(work: str, threshold: str, factor: str):
        env = dict(os.environ, WORK=str(tmp_path / work), BASELINE=str(wall), THRESHOLD=threshold, FACTOR=factor,
                   RUNS="unmodified rms_norm swiglu", SELECT=str(tmp_path / "test_gate.py"),
                   PYTHONPATH=str(tmp_path / "fake"), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", OUT=str(tmp_path / "out"))
        return subprocess.run(["bash", "scripts/gate_check.sh", "-p", "pytest_benchmark.plugin"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    r = check("w1", "5", "1.075")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== record: no GPU-time baseline" in r.stdout and (tmp_path / "w1" / "baseline.json").exists()
    s = json.loads((tmp_path / "w1" / "gate_check.json").read_text())
    assert s["ok"] and set(s["runs"]) == {"unmodified", "rms_norm", "swiglu"}
    assert s["runs"]["rms_norm"]["failed"] == ["test_gate.py::test_kernel[rms_norm/seed/fwd]"]  # the model: +0.4%
    assert all(row["tests_failed"] == 0 for row in s["runs"].values())  # each run's JUnit report
    assert (tmp_path / "out" / "gate_check.json").exists()
    r = check("w2", "10", "1.075")  # a gate looser than the slowdown lets the kernels' own benchmarks pass
    assert r.returncode == 1 and "BAD" in r.stdout, r.stdout + r.stderr


# ---- the committed baseline and the committed gate check (anatomy/records.py GATE_CHECK) ----------------
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
    from anatomy import records

    return json.loads(records.GATE_CHECK.read_text())


def test_the_gate_check_record_obeys_the_gates_rules():
    """Each machine of the committed gate check, read against the committed baseline: the threshold is at
    most 10%; the unmodified run gated every benchmark, and it failed none (exit 0, its largest ratio under
    the threshold) or failed the gate alone (exit 1, a ratio past it); each slowdown (1 + 1.5 x threshold)
    failed every benchmark of the target's own and only benchmarks whose work called it. Each run's failures
    are recomputed from its ratios."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gate_check_summary import own

    doc = _gate_record()
    names = {b["fullname"] for b in json.loads((ROOT / "baselines.json").read_text())["benchmarks"]}
    assert doc["machines"] and set(doc["targets"]) == set(__import__("validations.slowdown").slowdown.TARGETS)
    for m in doc["machines"]:
        thr = m["threshold_pct"]
        assert 0 < thr <= 10 and m["gpu"] and m["driver"] and m["torch"] and m["date"]
        assert all(not c.startswith("/") and " /" not in c for c in m["commands"])
        assert "unmodified" in m["runs"] and set(m["runs"]) <= {"unmodified", *doc["targets"]}
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
    from gate_check_record import main as record

    from anatomy import records

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


def test_the_readme_gate_section_is_rendered_from_the_record():
    """The README's gate-h200 section is what `anatomy report` renders from the committed record."""
    import re

    from anatomy.report.gate import summary

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- gate-h200:start -->\n(.*?)\n<!-- gate-h200:end -->", text, re.S)
    assert block and block.group(1) == summary()


def test_the_gate_section_says_what_is_not_shown(tmp_path, monkeypatch):
    """On a synthetic record: a slowdown that failed a benchmark which never called the kernel is shown as
    such and not as caught; missing targets and fresh machines are named; a threshold counts as the gate only
    where every fresh machine passes and every target was caught at it; the tighter thresholds' missing
    slowdowns are named; three fresh machines with every target caught at the tightest whole percent leave
    nothing unshown."""
    from anatomy import records
    from anatomy.report import gate

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
    monkeypatch.setattr(records, "GATE_CHECK", path)
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
    from anatomy.report import gate

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
    from anatomy.report.gate import current, summary

    section = summary()  # the section shows the machines gated against the committed baseline
    shown = [s for m in current(doc)["machines"] for s in m.get("suites", [])]
    for t in (t for s in shown for t in s.get("failed_claims", [])):
        assert f"(failed: `{t.split('::')[-1]}`)" in section
    assert all(m["runs"]["unmodified"]["refs"]["gemm_s"] > 0 for m in doc["machines"])
