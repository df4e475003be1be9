"""The package stands alone, `anatomy report` reads the checkout it is pointed at, and reports/ holds only what
something reads, under 10 MB."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from llm_anatomy import records

PACKAGE = Path(records.__file__).resolve().parent
REPO_ONLY = ("validations", "scripts", "bench")  # folders of the checkout that no wheel ships
REPORTS_LIMIT = 10 * 10**6  # bytes tracked under reports/


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, function-local and conditional ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_import_walk_sees_function_local_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef f():\n    if True:\n        from validations import real_depth as rd\n"
                 "    import scripts.probe_common\n")
    assert sorted(m for _, m in _imports(f)) == ["os", "scripts.probe_common", "validations"]


def test_the_package_imports_nothing_from_the_checkout():
    """No module of llm_anatomy imports validations, scripts or bench, at the top or inside a function."""
    bad = [f"{p.relative_to(PACKAGE.parent)}:{line}: {mod}" for p in sorted(PACKAGE.rglob("*.py"))
           for line, mod in _imports(p) if mod.split(".")[0] in REPO_ONLY]
    assert bad == []


@pytest.mark.parametrize("how", ["--root", "cwd"])
def test_report_outside_a_checkout_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, how):
    """`anatomy report` reads the folder it is given (or the current one), never the package's own: a folder
    without reports/ is refused with one line, and nothing is written there."""
    from llm_anatomy.cli import main

    (tmp_path / "README.md").write_text("x")
    if how == "cwd":
        monkeypatch.chdir(tmp_path)
        code = main(["report"])
    else:
        code = main(["report", "--root", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not a checkout" in err[0] and "Traceback" not in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


def test_records_follow_the_checkout_not_the_package(tmp_path):
    """Inside records.at(), every record path is under that checkout; outside, under the suite's own."""
    (tmp_path / "reports").mkdir()
    suite = records.ROOT
    with records.at(tmp_path):
        assert records.ROOT == tmp_path.resolve()
        assert records.GATE_CHECK.is_relative_to(tmp_path.resolve())
        assert records.rel(records.GATE_CHECK) == "reports/h200/gate/check.json"
    assert records.ROOT == suite and records.GATE_CHECK.is_relative_to(suite)
    with pytest.raises(records.NotACheckout, match="no reports/ folder"):
        records.checkout(tmp_path / "reports" / "nothing")


def _tracked_reports() -> list[Path]:
    r = subprocess.run(["git", "ls-files", "-z", "reports"], cwd=records.ROOT, capture_output=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return [records.ROOT / n for n in r.stdout.decode().split("\0") if n]


def _read_by_something() -> set[Path]:
    """Every file the layout names, the step records the step tables show, and the files the real-depth and
    loss-curve sections read beside their record."""
    from llm_anatomy.report.regenerate import MOE_STEPS, STEP_TABLES

    named: set[Path] = set()

    def walk(v):
        if isinstance(v, Path):
            named.add(v)
        elif isinstance(v, dict):
            list(map(walk, v.values()))
        elif isinstance(v, (tuple, list)):
            list(map(walk, v))

    layout = records._layout(records.ROOT)
    walk({k: v for k, v in layout.items() if k not in ("ROOT", "REPORTS", "H200", "STEPS")})
    named |= {p for run in (*STEP_TABLES.values(), MOE_STEPS) for p in records.step_records(run)}
    named |= {p.with_name(n) for p in records.REAL_DEPTH_RUNS for n in ("calibrated.json", "env.json")}
    named.add(records.LOSS_CURVES.with_suffix(".png"))
    return named


def test_reports_hold_only_what_is_read_and_under_10_mb():
    tracked = _tracked_reports()
    size = sum(p.stat().st_size for p in tracked)
    assert size <= REPORTS_LIMIT, f"reports/ tracks {size:,} bytes"
    unread = sorted(records.rel(p) for p in set(tracked) - _read_by_something())
    assert unread == [], "tracked under reports/ but read by nothing (llm_anatomy/records.py names what is read)"
