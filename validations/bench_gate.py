"""The regression gate as pytest hooks (loaded by conftest.py's pytest_plugins): what --benchmark-compare means
here, when a comparison compared nothing, and how a failed gate ends.

- A bare ``--benchmark-compare`` is the committed ``baselines.json`` at the repo root, gated at the threshold
  the committed gate record proves for it (``default_gate``; the rule's 10% ceiling for a baseline it has not
  checked); ``--benchmark-compare-fail=EXPR`` without ``--benchmark-compare`` compares against that file too. Either flag turns the benchmarks on:
  pyproject's addopts disable them, and a comparison of untimed runs gates nothing. pytest-benchmark alone
  reads a bare flag as "the newest run in .benchmarks/", which on a fresh machine is none: a silent pass.
- A comparison that compares nothing is a usage error (one line, exit code 4), never a pass: a target that
  loads no baseline, a baseline timed by another clock than ``gpu_time``, a run whose benchmarks ran on
  another GPU than the baseline's (``machine_info["anatomy_gpu"]``), and a finished run in which no benchmark
  has a baseline (none ran, or every id is new).
- A benchmark past the threshold, or one that ran without a baseline (it would pass ungated), fails the gate:
  the run prints the gate's table (benchmark, baseline, now, ratio) and exits 1, with no traceback.
  pytest-benchmark's own ending raises PerformanceRegression out of the terminal summary; its
  ``check_regressions`` is replaced for this session, and the verdict set as the session's exit status.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BASELINE = "baselines.json"  # the committed baseline, at the repo root (pytest's rootdir)
TIMER = "gpu_time"  # the clock every benchmark here is timed by (validations/gpu_clock.py)


@dataclass
class _Gate:
    target: str = ""  # what --benchmark-compare names, as the user sees it
    gpus: set = field(default_factory=set)  # the GPUs the loaded baselines were recorded on
    rows: list = field(default_factory=list)  # (name, field, baseline, now, ratio or None, failed)
    error: str = ""


_KEY = pytest.StashKey[_Gate]()


def default_gate() -> str:
    """The tightest threshold the committed gate record (reports/h200/gate/check.json) proves for the committed
    baseline, by llm_anatomy/report/gate.py's rule (the README's gate section and the CI workflow follow it), or
    that rule's provisional ceiling while none is proven (a baseline re-recorded, not yet checked)."""
    from llm_anatomy import records
    from llm_anatomy.report import gate

    try:
        t = gate.gate_threshold(gate.current(json.loads(records.GATE_CHECK.read_text())))
    except (OSError, ValueError):
        t = None
    return f"median:{gate.MAX_THRESHOLD_PCT if t is None else t:g}%"


def _fail(msg: str) -> None:
    raise pytest.UsageError(f"benchmark gate: {msg}")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Rewrite the comparison flags before pytest-benchmark's own pytest_configure reads them."""
    try:
        compare, fail = config.getoption("benchmark_compare"), config.getoption("benchmark_compare_fail")
    except ValueError:  # pytest-benchmark not loaded
        return
    if not compare and not fail:
        return
    gate = config.stash[_KEY] = _Gate(target=compare if isinstance(compare, str) else BASELINE)
    if compare is True or not compare:
        path = config.rootpath / BASELINE
        if not path.is_file():
            _fail(f"{BASELINE} is missing at {config.rootpath}: there is nothing to compare against "
                  f"(record it: docs/benchmarks.md, 'Record the baseline')")
        config.option.benchmark_compare = str(path)
        if compare is True and not fail:
            from pytest_benchmark.utils import parse_compare_fail

            config.option.benchmark_compare_fail = [parse_compare_fail(default_gate())]
    target = Path(config.option.benchmark_compare)
    if target.is_file():  # before pytest-benchmark loads it: a file it cannot load still names its clock here
        try:
            _check_timer(gate, json.loads(target.read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # unreadable: pytest-benchmark loads nothing from it, and pytest_sessionstart says so
    config.option.benchmark_enable = True


def pytest_sessionstart(session):
    """After every pytest_configure: pytest-benchmark's session has loaded the baseline by now."""
    config = session.config
    gate = config.stash.get(_KEY, None)
    bs = getattr(config, "_benchmarksession", None)
    if gate is None or bs is None:
        return
    if not bs.compared_mapping:
        _fail(f"--benchmark-compare={gate.target} loads no baseline (no such file, and nothing in "
              f"{bs.storage} matches it): there is nothing to compare against")
    bs.check_regressions = lambda: None  # the verdict is this plugin's (pytest_sessionfinish), without a traceback


def pytest_benchmark_compare_machine_info(config, benchmarksession, machine_info, compared_benchmark):
    """Called by pytest-benchmark per loaded baseline: refuse one timed by another clock, and remember the GPU
    it was recorded on (checked against the GPU the benchmarks run on, once they have run)."""
    gate = config.stash.get(_KEY, None)
    if gate is None:
        return
    _check_timer(gate, compared_benchmark)
    gate.gpus.add(compared_benchmark.get("machine_info", {}).get("anatomy_gpu"))


class _Median:  # a plain comparison (no --benchmark-compare-fail): the ratio of medians, never a failure
    field = "median"

    @staticmethod
    def fails(now, base) -> None:
        return None


def _check_timer(gate: _Gate, data: dict) -> None:
    timers = {str(b.get("options", {}).get("timer")) for b in data.get("benchmarks", [])}
    if timers - {TIMER}:
        _fail(f"{gate.target} holds figures timed by {', '.join(sorted(timers - {TIMER}))}, not {TIMER}: the gate "
              f"would compare them with GPU seconds; re-record it (docs/benchmarks.md, 'Record the baseline')")


def _current_gpu(bs) -> str | None:
    info: dict = {}
    bs.config.hook.pytest_benchmark_update_machine_info(config=bs.config, machine_info=info)
    return info.get("anatomy_gpu")


def _verdict(bs, gate: _Gate) -> int:
    """The gate's rows and exit code: 0 passed, 1 a benchmark regressed or ran ungated, 4 nothing was gated."""
    ran = [b for b in bs.benchmarks if b]
    baselines = {}
    for mapping in bs.compared_mapping.values():
        baselines.update(mapping)
    if not ran:
        gate.error = "no benchmark ran (none selected, all skipped, or no GPU): nothing was gated"
        return 4
    if not any(b.fullname in baselines for b in ran):
        gate.error = (f"none of the {len(ran)} benchmarks that ran has a baseline in {gate.target} (ids are node "
                      f"ids from the repo root): nothing was gated")
        return 4
    now_gpu = _current_gpu(bs)
    if gate.gpus != {now_gpu}:
        gate.error = (f"{gate.target} was recorded on {', '.join(sorted(map(str, gate.gpus)))}, these benchmarks ran "
                      f"on {now_gpu}: record a baseline on the GPU kind the gate runs on")
        return 4
    checks = bs.compare_fail or []
    for b in ran:
        base = baselines.get(b.fullname)
        if base is None:  # a gate fails it (it would pass ungated); a plain comparison lists it
            gate.rows.append((b.fullname, "-", None, None, None, bool(checks)))
            continue
        now = b.as_dict(include_data=False, flat=True)
        for check in checks or [_Median()]:
            was, cur = base["stats"][check.field], now[check.field]
            gate.rows.append((b.fullname, check.field, was, cur, cur / was if was else None,
                              bool(check.fails(now, base["stats"]))))
    return 1 if any(r[5] for r in gate.rows) else 0


def pytest_sessionfinish(session, exitstatus):
    """Runs after pytest-benchmark's finish() (a hook wrapper) and before the terminal summary."""
    gate = session.config.stash.get(_KEY, None)
    bs = getattr(session.config, "_benchmarksession", None)
    if gate is None or bs is None or session.config.option.collectonly or exitstatus not in (0, 1, 5):
        return
    code = _verdict(bs, gate)
    if code == 4:
        term = session.config.pluginmanager.get_plugin("terminalreporter")
        if term is not None and term._tw.width_of_current_line:
            term._tw.line()  # the progress line ends first: the error is a line of its own
        print(f"benchmark gate: error: {gate.error}", file=sys.stderr, flush=True)
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
    elif code == 1 and exitstatus in (0, 5):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1e6:,.1f} us" if v < 1e-3 else f"{v * 1e3:,.3f} ms" if v < 1 else f"{v:,.3f} s"


def table(gate: _Gate, checks: str) -> list[str]:
    """The gate's verdict: one summary line, then a row per failed benchmark (all of them when none failed
    would be noise: the summary names the largest ratio)."""
    failed = [r for r in gate.rows if r[5]]
    ratios = [r for r in gate.rows if r[4] is not None]
    top = max(ratios, key=lambda r: r[4], default=None)
    names = {r[0] for r in gate.rows}
    head = (f"benchmark gate {checks} against {gate.target}: "
            + (f"{len({r[0] for r in failed})} of {len(names)} benchmarks failed" if failed
               else f"{len(names)} of {len(names)} benchmarks passed")
            + (f"; largest ratio {top[4]:.3f} ({top[0].split('::')[-1]})" if top else ""))
    if not failed:
        return [head]
    w = max(len(r[0]) for r in failed)
    out = [head, f"  {'benchmark':<{w}}  {'field':<6}  {'baseline':>12}  {'now':>12}  {'ratio':>7}"]
    for name, fld, was, cur, ratio, _ in sorted(failed, key=lambda r: -(r[4] or float("inf"))):
        out.append(f"  {name:<{w}}  {fld:<6}  {_s(was):>12}  {_s(cur):>12}  "
                   + (f"{ratio:>7.3f}" if ratio is not None else "no baseline: not gated"))
    return out


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gate = config.stash.get(_KEY, None)
    if gate is None or gate.error or not gate.rows:
        return
    bs = config._benchmarksession
    checks = ", ".join(f"{c.field}:{c.threshold:g}{'%' if 'Percentage' in type(c).__name__ else ' s'}"
                       for c in bs.compare_fail or []) or "(compare only)"
    failed = any(r[5] for r in gate.rows)
    terminalreporter.ensure_newline()
    for i, line in enumerate(table(gate, checks)):
        terminalreporter.write_line(line, red=failed and i == 0, green=not failed)

