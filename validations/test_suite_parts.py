"""scripts/suite_parts.py: the GPU suite's parts (scripts/gpu_suite.sh --part K/N) are the whole suite, each part
of two holds benchmarks (so each carries the gate's flags), --benchmarks names a part's files that hold one (a part
with none runs ungated), and a bad K/N is one line, exit code 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts import suite_parts
from validations.test_gate_record import _benchmark_functions

ROOT = Path(__file__).resolve().parent.parent


def test_the_parts_are_the_gpu_suite_and_each_of_two_holds_benchmarks():
    r = subprocess.run([sys.executable, "-m", "pytest", "validations", "-m", "gpu", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = {ln.split("::")[0] for ln in r.stdout.splitlines() if "::" in ln}
    for n in (1, 2, 3):
        parts = [suite_parts.part(k, n) for k in range(1, n + 1)]
        assert [f for p in parts for f in p] == suite_parts.gpu_files()  # in order, each file once
    assert set(suite_parts.gpu_files()) == collected
    bench_files = {f"validations/{name.split('::')[0]}.py" for name in _benchmark_functions()}
    assert all(set(suite_parts.part(k, 2)) & bench_files for k in (1, 2))
    assert {f for f in suite_parts.gpu_files() if suite_parts.holds_benchmarks(f)} == bench_files


def test_benchmarks_lists_the_part_files_that_hold_one():
    for n in (2, 3):
        for k in range(1, n + 1):
            r = subprocess.run([sys.executable, "-m", "scripts.suite_parts", f"{k}/{n}", "--benchmarks"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == [f for f in suite_parts.part(k, n) if suite_parts.holds_benchmarks(f)]


def test_a_bad_part_is_one_line_exit_2():
    for arg in ("3/2", "0/2", "x", "", "1/2 2/2"):
        r = subprocess.run([sys.executable, "-m", "scripts.suite_parts", *arg.split()], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
