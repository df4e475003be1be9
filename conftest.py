"""Markers, device fixtures, hypothesis profiles and the claims-report plugin.

Nothing here queries CUDA at import: the GPU check happens when a gpu-marked test runs.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path

import pytest

# Triton kernels run on CPU under the interpreter. The switch is read when a kernel module is
# imported, so it is set here, before any test imports one; a machine with an NVIDIA driver
# keeps compiled kernels. (nvidia-smi on PATH is the check: it does not initialise CUDA.)
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=50, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=20, **_common)
settings.register_profile("thorough", max_examples=250, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# a progress line per part of the GPU suite (or with --parts); the regression gate's flags and verdict
pytest_plugins = ["validations.progress", "validations.bench_gate"]


def pytest_addoption(parser):
    parser.addoption("--claims-report", default=".anatomy/claims.json",
                     help="where the claim rows (predicted vs measured) are written as JSON")
    parser.addoption("--quick", action="store_true",
                     help="the quick subset: leave out tests marked slow (on a GPU: the seed config's benchmarks at "
                          "B=16 S=4096, the compiled optimizer's, the sustained clock) and the time claims that need "
                          "this GPU's calibration (fixture suite_profile, about two minutes on a machine without one)")
    parser.addoption("--live-n", type=int, default=30,
                     help="how many configs validations/test_live_claims.py draws and measures on the GPU (default 30)")
    parser.addoption("--live-seed", type=int, default=2026,
                     help="the seed those configs, and the live real-depth cases, are drawn with (default 2026)")
    parser.addoption("--live-real-depth", type=int, default=3,
                     help="how many real-depth cases validations/test_real_depth_live.py draws and times in the "
                          "user's loop on the GPU (default 3)")


def pytest_configure(config):
    # ANATOMY_SLOWDOWN (validations/slowdown.py) is checked before anything runs: a typo is a usage error
    # (one line, exit code 4), never a gate check that silently slowed nothing
    from validations.slowdown import from_env

    try:
        from_env()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        out = lambda it: "slow" in it.keywords or "suite_profile" in getattr(it, "fixturenames", ())  # noqa: E731
        config.hook.pytest_deselected(items=[it for it in items if out(it)])
        items[:] = [it for it in items if not out(it)]


def pytest_runtest_setup(item):
    if "gpu" in item.keywords:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU; this machine has none")


@pytest.fixture(scope="session")
def cuda_device():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    return torch.device("cuda")


# ---- benchmarks: the session's GPU references and the injected slowdown ----------------------------
@pytest.fixture(scope="session")
def gpu_refs(cuda_device):
    """The reference GEMM and copy, the spin kernel's rate and one launch's GPU time, measured once per
    session (validations/gpu_clock.references): every benchmark's extra_info divides by them."""
    from validations.gpu_clock import references

    return references()


@pytest.fixture(scope="session")
def gpu_profile(cuda_device):
    """This GPU's calibrated profile (`anatomy calibrate`), measured once per machine and cached on disk as
    JSON, keyed by GPU, driver, CUDA, torch and triton (validations/profile_cache.py)."""
    from validations.profile_cache import cached_profile, calibrate_with_anatomy, machine_key

    try:
        return cached_profile(machine_key(), calibrate_with_anatomy)[0]
    except (RuntimeError, ValueError) as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def suite_profile(request):
    """(profile, label): what the GPU suite's time claims predict with. $ANATOMY_GPU_PROFILE (a name or a
    path) where set; else this GPU's own calibration (gpu_profile), so the suite re-proves its time claims
    on whatever GPU it runs on, an H200 or not."""
    name = os.environ.get("ANATOMY_GPU_PROFILE")
    if name:
        return name, name
    return request.getfixturevalue("gpu_profile"), "this GPU's calibration (validations/profile_cache.py)"


@pytest.fixture
def free_cuda():
    """After a benchmark: drop its tensors and give the allocator's cached blocks back."""
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def slowdown(request):
    """None, or the ANATOMY_SLOWDOWN wrappers installed for this test (validations/slowdown.py)."""
    from validations.slowdown import Slowdown, from_env

    factors = from_env()
    if not factors:
        yield None
        return
    refs = request.getfixturevalue("gpu_refs")
    s = Slowdown(factors, rate=refs["sleep_cycles_per_s"], launch_s=refs["extra_launch_s"]).install()
    try:
        yield s
    finally:
        s.uninstall()


# ---- claims report ---------------------------------------------------------------------------
_ROWS: list[dict] = []


def _show(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


class Claims:
    """Records one row per checked claim, then asserts it. The row is written whether or not it passes."""

    def __init__(self, test_id: str):
        self.test_id = test_id

    def check(self, claim: str, *, component: str, config: str, variant: str, predicted, measured,
              tolerance: float = 0.0, device: str = "cpu", unit: str = "", note: str = "") -> None:
        # prediction error relative to the measurement: (predicted - measured) / measured
        err = float((predicted - measured) / measured) if measured else float(measured != predicted)
        ok = measured == predicted if tolerance == 0 else abs(err) <= tolerance
        num = (lambda v: v if isinstance(v, (int, float)) else float(v))  # e.g. an exact Fraction ratio
        _ROWS.append(dict(test=self.test_id, claim=claim, component=component, config=config, variant=variant,
                          predicted=num(predicted), measured=num(measured), error=err, tolerance=tolerance,
                          unit=unit, device=device, passed=bool(ok), note=note))
        assert ok, (f"{claim} [{component}, {config}, {variant}, {device}]: predicted {_show(predicted)} {unit}, "
                    f"measured {_show(measured)} {unit}, error {err:+.4%} (tolerance {tolerance:.2%})")


    def within(self, claim: str, *, low: float, high: float, measured, component: str, config: str, variant: str,
               device: str = "cpu", unit: str = "", note: str = "") -> None:
        """A range claim (low <= measured <= high): recorded with the range's midpoint as the prediction
        and its half-width, relative to the midpoint, as the tolerance; passed is the range test itself."""
        mid = (low + high) / 2
        err = float((mid - measured) / measured) if measured else None  # None: no relative figure (JSON has no inf)
        ok = low <= measured <= high
        _ROWS.append(dict(test=self.test_id, claim=claim, component=component, config=config, variant=variant,
                          predicted=float(mid), measured=float(measured), error=err,
                          tolerance=float((high - low) / 2 / mid) if mid else 0.0, unit=unit, device=device,
                          kind="range", passed=bool(ok),
                          note=f"range [{_show(low)}, {_show(high)}] {unit}; {note}".rstrip("; ")))
        assert ok, (f"{claim} [{component}, {config}, {variant}, {device}]: measured {_show(measured)} {unit} outside "
                    f"the predicted range [{_show(low)}, {_show(high)}]")


@pytest.fixture
def claims(request) -> Claims:
    return Claims(request.node.nodeid)


# ---- GPU memory: skip a predicted OOM, record an unpredicted one ------------------------------------
_NEED = pytest.StashKey[dict]()


@pytest.fixture
def gpu_fits(request):
    """gpu_fits(cfg, run, variant, optimizer=None): skip the test when the calculator's peak for this
    step (llm_anatomy.calculator.memory.phases: the larger of the forward and backward peaks) exceeds the
    GPU's free memory, quoting both; otherwise remember the prediction, so an out-of-memory error the
    calculator did not predict becomes a failed claim with the prediction beside the limit."""
    def check(cfg, run, variant, optimizer=None):
        import torch

        from llm_anatomy.calculator.memory import phases

        ph = phases(cfg, run, variant, optimizer=optimizer, device="cuda")
        need = max(ph["forward_peak"] or 0, ph["backward_peak"])
        free, total = torch.cuda.mem_get_info()
        request.node.stash[_NEED] = dict(config=f"{cfg.name} B{run.batch}S{run.seq} {run.dtype}", variant=variant,
                                         need=need, free=free, total=total)
        if need > free:
            pytest.skip(f"predicted OOM: the step needs {need / 2**30:,.2f} GiB at its peak "
                        f"({ph['backward_peak_at'] if need == ph['backward_peak'] else 'forward'}); "
                        f"{free / 2**30:,.2f} GiB free of {total / 2**30:,.2f}")
        return need
    return check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.when != "call" or call.excinfo is None or call.excinfo.typename != "OutOfMemoryError":
        return
    need = item.stash.get(_NEED, None)
    _ROWS.append(dict(test=item.nodeid, claim="the step fits in GPU memory", component="model",
                      config=need["config"] if need else "", variant=need["variant"] if need else "",
                      predicted=need["need"] if need else None, measured=need["free"] if need else None,
                      error=None, tolerance=0.0, unit="B", device="cuda", passed=False,
                      note="unpredicted out-of-memory: " + str(call.excinfo.value).splitlines()[0][:200]
                      + ("" if need else " (the test declared no prediction: use the gpu_fits fixture)")))
    rep.longrepr = (f"unpredicted OOM: {str(call.excinfo.value).splitlines()[0][:200]}"
                    + (f"; the calculator predicted {need['need'] / 2**30:,.2f} GiB against "
                       f"{need['free'] / 2**30:,.2f} GiB free" if need else ""))
    try:  # leave the allocator usable for the tests after this one
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _machine() -> dict:
    info = dict(python=platform.python_version(), platform=platform.platform())
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


_T0 = [time.monotonic()]


def pytest_sessionstart(session):
    _T0[0] = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    if not _ROWS:
        return
    path = Path(session.config.getoption("--claims-report"))
    path.parent.mkdir(parents=True, exist_ok=True)
    term = session.config.pluginmanager.get_plugin("terminalreporter")  # its stats: the tests' outcomes so far
    counts = {k: len(term.stats.get(k, [])) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
              } if term else {}
    report = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=_machine(),
                  command="pytest " + " ".join(session.config.invocation_params.args),
                  seconds=round(time.monotonic() - _T0[0], 1), outcome=counts, rows=_ROWS)
    from llm_anatomy.io import write_atomic

    raw = json.dumps(report, separators=(",", ":"), default=str).encode()
    if path.suffix == ".gz":  # the committed CPU report: gzip without a timestamp, so equal reports are equal bytes
        import gzip

        raw = gzip.compress(raw, mtime=0)
    write_atomic(path, raw)  # a reader never sees half a report


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update({f"anatomy_{k}": v for k, v in _machine().items()})


def pytest_terminal_summary(terminalreporter, config):
    """The test order's seed, printed even under -q (which hides the header pytest-randomly prints it in), so
    an order bug seen once is replayed with `-p randomly --randomly-seed=N`."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order: random, --randomly-seed={seed}")
