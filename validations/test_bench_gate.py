"""The regression gate's flags and verdict (validations/bench_gate.py), on CPU: pytest runs in a subprocess over
synthetic benchmarks timed as the GPU ones are (a GpuRound on pytest-benchmark's gpu_time timer) on a fake GPU,
so each round of test_kernel costs exactly 2 ms x GATE_SLOWDOWN of GPU time.

Each run loads only pytest-benchmark and the gate plugin (0.3-0.5 s); a conftest in the run's folder stands in
for the repo's machine_info (no py-cpuinfo probe; the GPU name from FAKE_GPU_NAME)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from validations.bench_gate import BASELINE, default_gate

ROOT = Path(__file__).resolve().parent.parent

GATE_TEST = '''
import os

import pytest

from validations.fake_gpu import FakeGPU
from validations.gpu_clock import GpuRound, gpu_time

GPU = FakeGPU()

def round_(seconds):
    return GpuRound(lambda: GPU.run(seconds), cycles_per_s=GPU.rate, event=GPU.event, sleep=GPU.sleep)

@pytest.mark.benchmark(timer=gpu_time)
def test_kernel(benchmark):
    f = float(os.environ.get("GATE_SLOWDOWN", "1"))
    benchmark.pedantic(round_(0.002 * f), rounds=15, warmup_rounds=2)

@pytest.mark.benchmark(timer=gpu_time)
def test_other(benchmark):
    benchmark.pedantic(round_(0.002), rounds=15, warmup_rounds=2)
'''
MACHINE = '''
import os

def pytest_benchmark_generate_machine_info(config):
    return {"machine": "fake"}

def pytest_benchmark_update_machine_info(config, machine_info):
    if os.environ.get("FAKE_GPU_NAME"):
        machine_info["anatomy_gpu"] = os.environ["FAKE_GPU_NAME"]
'''


@pytest.fixture
def gate_dir(tmp_path):
    (tmp_path / "test_gate.py").write_text(GATE_TEST)
    (tmp_path / "conftest.py").write_text(MACHINE)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --benchmark-disable\n")  # as pyproject has
    return tmp_path


def pytest_(cwd: Path, *flags, slowdown: str = "1", gpu: str = "NVIDIA H200") -> subprocess.CompletedProcess:
    env = dict(os.environ, GATE_SLOWDOWN=slowdown, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(ROOT),
               FAKE_GPU_NAME=gpu)
    return subprocess.run([sys.executable, "-m", "pytest", "test_gate.py", "-q", "-p", "pytest_benchmark.plugin",
                           "-p", "validations.bench_gate", "-p", "no:cacheprovider", *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _record(cwd: Path) -> dict:
    r = pytest_(cwd, "--benchmark-enable", f"--benchmark-json={BASELINE}")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((cwd / BASELINE).read_text())


def _gate_line(r) -> str:
    return next(ln for ln in r.stdout.splitlines() if ln.startswith("benchmark gate "))


def test_a_bare_compare_gates_against_the_committed_baseline_at_the_proven_threshold(gate_dir):
    """A bare --benchmark-compare (pyproject's --benchmark-disable in force) times the benchmarks, compares them
    with baselines.json at the rootdir and fails past the proven threshold (default_gate(), 6% today), not a
    point under or over it; --benchmark-compare-fail=EXPR alone compares against the same file at its own."""
    gate = default_gate()
    pct = int(gate.removeprefix("median:").removesuffix("%"))
    saved = _record(gate_dir)
    assert all(b["options"]["timer"] == "gpu_time" for b in saved["benchmarks"])
    same = pytest_(gate_dir, "--benchmark-compare")
    assert same.returncode == 0, same.stdout + same.stderr
    assert _gate_line(same) == (f"benchmark gate {gate} against baselines.json: 2 of 2 benchmarks passed; "
                                "largest ratio 1.000 (test_kernel)")
    assert pytest_(gate_dir, "--benchmark-compare", slowdown=f"{1 + (pct - 1) / 100}").returncode == 0
    slow = pytest_(gate_dir, "--benchmark-compare", slowdown=f"{1 + (pct + 1) / 100}")
    assert slow.returncode == 1 and "1 of 2 benchmarks failed" in _gate_line(slow)
    looser = pytest_(gate_dir, f"--benchmark-compare-fail=median:{pct + 4}%", slowdown=f"{1 + (pct + 1) / 100}")
    assert looser.returncode == 0
    assert _gate_line(looser).startswith(f"benchmark gate median:{pct + 4}% against baselines.json")


def test_a_failed_gate_prints_its_table_and_exits_1_without_a_traceback(gate_dir):
    """The slowed benchmark's row (baseline, now, ratio) and only its row; exit code 1, no traceback, the JSON
    report written; a benchmark that ran without a baseline fails the gate too (it would pass ungated)."""
    _record(gate_dir)
    r = pytest_(gate_dir, "--benchmark-compare", "--benchmark-json=current.json", slowdown="1.3")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out and "PerformanceRegression" not in out, out
    lines = r.stdout.splitlines()
    i = lines.index(_gate_line(r))
    assert lines[i].startswith(f"benchmark gate {default_gate()} against baselines.json: 1 of 2 benchmarks failed")
    assert lines[i + 1].split() == ["benchmark", "field", "baseline", "now", "ratio"]
    assert lines[i + 2].split() == ["test_gate.py::test_kernel", "median", "2.000", "ms", "2.600", "ms", "1.300"]
    assert "test_other" not in lines[i + 3] and (gate_dir / "current.json").exists()
    base = json.loads((gate_dir / BASELINE).read_text())
    base["benchmarks"] = [b for b in base["benchmarks"] if b["name"] != "test_other"]
    (gate_dir / BASELINE).write_text(json.dumps(base))
    r = pytest_(gate_dir, "--benchmark-compare")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "test_gate.py::test_other" in r.stdout and "no baseline: not gated" in r.stdout


def _error_line(r) -> str:
    """The one line a refused gate prints (pytest's ERROR: for a usage error, the gate's own at the end)."""
    starts = ("ERROR: benchmark gate:", "benchmark gate: error:")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(starts)]
    assert len(lines) == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


def test_a_gate_with_nothing_to_compare_fails_loudly(gate_dir):
    """Exit code 4 and one line, never a pass: no baselines.json; a target that loads nothing; a run where no
    benchmark ran or none has a baseline; a baseline timed by another clock or recorded on another GPU."""
    r = pytest_(gate_dir, "--benchmark-compare")
    assert r.returncode == 4 and "baselines.json is missing" in _error_line(r)
    r = pytest_(gate_dir, "--benchmark-compare-fail=median:6%")
    assert r.returncode == 4 and "baselines.json is missing" in _error_line(r)
    base = _record(gate_dir)
    r = pytest_(gate_dir, "--benchmark-compare=nothing-here.json")
    assert r.returncode == 4 and "loads no baseline" in _error_line(r)
    r = pytest_(gate_dir, "--benchmark-compare", "-k", "no_such_test")
    assert r.returncode == 4 and "no benchmark ran" in _error_line(r)
    r = pytest_(gate_dir, "--benchmark-compare", gpu="NVIDIA H100 80GB HBM3")
    assert r.returncode == 4
    assert "was recorded on NVIDIA H200, these benchmarks ran on NVIDIA H100 80GB HBM3" in _error_line(r)
    renamed = dict(base, benchmarks=[dict(b, fullname="elsewhere/" + b["fullname"]) for b in base["benchmarks"]])
    (gate_dir / "renamed.json").write_text(json.dumps(renamed))
    r = pytest_(gate_dir, "--benchmark-compare=renamed.json", "--benchmark-compare-fail=median:6%")
    assert r.returncode == 4 and "none of the 2 benchmarks that ran has a baseline" in _error_line(r)
    wall = dict(base, benchmarks=[dict(b, options=dict(b["options"], timer="perf_counter"))
                                  for b in base["benchmarks"]])
    (gate_dir / BASELINE).write_text(json.dumps(wall))
    r = pytest_(gate_dir, "--benchmark-compare")
    assert r.returncode == 4 and "holds figures timed by perf_counter, not gpu_time" in _error_line(r)


def test_a_bare_compare_fail_is_a_usage_error(gate_dir):
    """--benchmark-compare-fail takes one or more EXPR (nargs='+'): with none, argparse refuses the command line
    before any conftest or plugin of the repo loads (exit code 4), so it never gates silently."""
    r = pytest_(gate_dir, "--benchmark-compare-fail")
    assert r.returncode == 4 and "--benchmark-compare-fail: expected at least one argument" in r.stderr


def test_the_default_threshold_is_the_one_the_gate_record_proves(tmp_path, monkeypatch):
    """A bare --benchmark-compare gates at the threshold the CI workflow gates at, which test_gate_record.py
    holds to the tightest one the committed record (reports/h200/gate/check.json) proves for the committed
    baseline; against a baseline the record has not checked, at the rule's provisional ceiling."""
    from llm_anatomy import records

    gate = default_gate()
    ci = (ROOT / ".github/workflows/gpu.yml").read_text()
    assert gate.startswith("median:") and ci.count("--benchmark-compare-fail=median:") == 1
    assert f"--benchmark-compare-fail={gate} " in ci
    other = tmp_path / BASELINE
    other.write_text("{}")  # another file: its SHA-256 is in no machine of the record
    monkeypatch.setattr(records, "BASELINE", other)
    assert default_gate() == "median:10%"
