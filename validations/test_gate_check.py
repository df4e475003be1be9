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
from scripts.gate_check_summary import main, summarize  # noqa: E402

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
    one = json.loads((ROOT / "baselines.json").read_text())["benchmarks"][0]
    wall = dict(machine_info={}, benchmarks=[dict(one, options=dict(one["options"], timer="perf_counter"))])
    gpu = dict(machine_info={}, benchmarks=[one])
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
