"""validations/progress.py (CPU): a line per test file, with the part's index and size and the run's progress,
printed by itself when every selected test is gpu-marked, on request (--parts) otherwise, and never in between."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "validations.progress", "-p", "no:cacheprovider",
                          "-p", "no:randomly", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return [ln for ln in out.stdout.splitlines() if ln.startswith("-- part")]


def test_a_line_per_part(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "test_a.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_1(): pass\n\n"
                                        "@pytest.mark.gpu\n@pytest.mark.parametrize('i', [1, 2])\ndef test_2(i): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_3(): pass\n\ndef test_cpu(): pass\n")
    lines = _run(tmp_path, "-m", "gpu")  # every selected test is gpu-marked: on by itself
    assert [ln.split(" (")[0] for ln in lines] == ["-- part 1/2 test_a.py: 3 tests", "-- part 2/2 test_b.py: 1 test"]
    assert "(0 of 4 done, " in lines[0] and "(3 of 4 done, " in lines[1]
    assert _run(tmp_path) == []  # a CPU test among them: off
    lines = _run(tmp_path, "--parts", "-k", "test_2 or test_cpu")
    assert [ln.split(" (")[0] for ln in lines] == ["-- part 1/2 test_a.py: 2 tests", "-- part 2/2 test_b.py: 1 test"]
