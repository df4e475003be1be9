"""The wheel stands alone: built from the package's sources, installed in a fresh venv outside the checkout, it
runs every command from a folder outside the checkout, and `anatomy report` rebuilds a copy of the checkout's
documents byte-identically twice.

The venv is fresh (`python -m venv`, then torch==2.13.0, the lock file's pins where requirements.lock exists,
then the wheel with its dependencies and its `train` extra) where pip can reach a package index or the local wheels; where it cannot,
it sees the system's packages (`--system-site-packages`) and gets the wheel alone (`--no-deps`). Either way the
test asserts that the venv's own copy of llm_anatomy is what runs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_anatomy import records

pytestmark = pytest.mark.slow

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--intermediate", "172", "--vocab", "1024"]
# what `anatomy report` reads or rewrites in a checkout: the documents, the records, and the sources its claim
# index links to (docs/claims.md names each claim's code and test)
REPORT_NEEDS = ("README.md", "docs", "reports", "baselines.json", "llm_anatomy", "validations", "bench", "scripts")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.egg-info")


def _run(cmd, cwd, env, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


def _pip(venv: Path, *args) -> bool:
    # without PYTHONPATH: a checkout on it shows pip this package's egg-info as installed, and pip skips the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", *args],
                          capture_output=True, text=True, timeout=900, env=env).returncode == 0


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(venv folder, environment without this checkout on PYTHONPATH, how it was made) with the wheel in it."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"  # the package's sources alone: the build writes nothing into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(records.ROOT / name, src / name)
    shutil.copytree(records.ROOT / "llm_anatomy", src / "llm_anatomy", ignore=_IGNORE)
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src],
         cwd=base, env=os.environ)
    wheel = next(dist.glob("*.whl"))
    t0 = time.monotonic()
    fresh = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", fresh], check=True, timeout=300)
    lock = records.ROOT / "requirements.lock"
    ok = _pip(fresh, "torch==2.13.0") and (not lock.exists() or _pip(fresh, "--no-deps", "-r", lock)) \
        and _pip(fresh, f"{wheel}[train]")
    how = "fresh"
    if not ok:  # no index reachable: the system's packages, and the wheel alone
        shutil.rmtree(fresh)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", fresh], check=True, timeout=300)
        assert _pip(fresh, "--no-deps", wheel), "the wheel does not install with --no-deps"
        how = "--system-site-packages"
    print(f"test_wheel: venv {how}, made in {time.monotonic() - t0:.0f} s")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ANATOMY_ROOT")}
    env.update(PATH=f"{fresh / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(fresh),
               MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    return fresh, env, how


def test_the_venv_runs_its_own_copy(venv, tmp_path):
    fresh, env, _ = venv
    p = _run([fresh / "bin" / "python", "-c", "import llm_anatomy; print(llm_anatomy.__file__)"], tmp_path, env)
    where = Path(p.stdout.strip()).resolve()
    assert where.is_relative_to(fresh.resolve()), where
    assert not where.is_relative_to(records.ROOT), where


@pytest.mark.parametrize("argv", [
    ["estimate"],
    ["plan", "--preset", "llama3-8b", "--gpu", "H100", "--gpus", "8"],
    ["compare", *TINY, "--batch", "2", "--seq", "32", "--device", "cpu"],
    ["sweep", "--preset", "seed", "--batch", "1", "2", "--seq", "64", "--device", "cpu", "--quiet", "--out", "s.json"],
    ["train", *TINY, "--batch", "2", "--seq", "32", "--steps", "3", "--dtype", "fp32", "--device", "cpu",
     "--ckpt-dir", "ckpt"],
], ids=lambda a: a[0])
def test_each_command_runs_outside_the_checkout(venv, tmp_path, argv):
    fresh, env, _ = venv
    _run([fresh / "bin" / "anatomy", *argv], tmp_path, env)
    if argv[0] == "train":
        assert any((tmp_path / "ckpt").iterdir())


def test_report_rebuilds_a_copy_byte_identically_twice(venv, tmp_path):
    """`anatomy report` from a folder outside the copy (--root) and from inside it (the current directory):
    docs/results.md, the README and docs/claims.md are the same bytes after each run, with no absolute path."""
    fresh, env, _ = venv
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in REPORT_NEEDS:
        if (records.ROOT / name).is_dir():
            shutil.copytree(records.ROOT / name, copy / name, ignore=_IGNORE)
        else:
            shutil.copy(records.ROOT / name, copy / name)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    docs = ("docs/results.md", "README.md", "docs/claims.md")
    _run([fresh / "bin" / "anatomy", "report", "--root", copy], outside, env)
    first = {d: (copy / d).read_bytes() for d in docs}
    _run([fresh / "bin" / "anatomy", "report"], copy, env)
    assert {d: (copy / d).read_bytes() for d in docs} == first
    for d, raw in first.items():
        for path in (str(copy), str(tmp_path), str(records.ROOT), str(fresh)):
            assert path not in raw.decode(), (d, path)
    assert sorted(p.name for p in outside.iterdir()) == []
