"""validations/profile_cache.py on CPU: the cache key, one calibration per key, JSON on disk, and the cases
that measure again (another driver or version, a corrupt or mis-keyed file) or cache nothing (a failure)."""
from __future__ import annotations

import json

import pytest

from validations.profile_cache import KEY, cached_profile, file_name

K = dict(gpu="NVIDIA H200", driver="580.159.04", cuda="13.0", torch="2.11.0+cu130", triton="3.6.0")


class FakeCalibration:
    """Stands in for `anatomy calibrate --out PATH`: writes a profile naming its call, counts calls."""

    def __init__(self, rc: int = 0, write: bool = True):
        self.calls, self.rc, self.write = 0, rc, write

    def __call__(self, out) -> int:
        self.calls += 1
        if self.write:
            out.write_text(json.dumps(dict(name="h200-measured", call=self.calls)))
        return self.rc


def test_the_key_names_every_fact_and_only_them():
    name = file_name(K)
    assert name == "NVIDIA-H200_580.159.04_13.0_2.11.0+cu130_3.6.0.json"
    assert file_name(dict(K, extra="x")) == name  # facts outside KEY do not key the file
    for k in KEY:  # any fact changed: another file
        assert file_name(dict(K, **{k: K[k] + "1"})) != name
    assert "/" not in file_name(dict(K, gpu="a/b c"))
    for k in KEY:
        with pytest.raises(ValueError, match=f"no {k}"):
            file_name(dict(K, **{k: None}))


def test_one_calibration_per_key_cached_as_json(tmp_path):
    cal = FakeCalibration()
    p1, path, fresh = cached_profile(K, cal, tmp_path)
    assert fresh and cal.calls == 1 and path == tmp_path / file_name(K)
    doc = json.loads(path.read_text())  # JSON on disk, with the key it was measured under
    assert doc == dict(key=K, profile=p1) and p1["call"] == 1
    p2, _, fresh = cached_profile(K, cal, tmp_path)
    assert not fresh and cal.calls == 1 and p2 == p1
    p3, path3, fresh = cached_profile(dict(K, driver="590.1"), cal, tmp_path)  # a new driver: measured again
    assert fresh and cal.calls == 2 and path3 != path and p3["call"] == 2
    assert cached_profile(K, cal, tmp_path)[0] == p1 and cal.calls == 2  # the first key's file is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path3.name])  # no temporary left


def test_a_corrupt_or_mis_keyed_file_is_measured_again(tmp_path):
    cal = FakeCalibration()
    path = tmp_path / file_name(K)
    for bad in ("{not json", json.dumps(dict(key=dict(K, torch="2.10"), profile={})), json.dumps([1])):
        path.write_text(bad)
        profile, _, fresh = cached_profile(K, cal, tmp_path)
        assert fresh and profile["call"] == cal.calls and json.loads(path.read_text())["key"] == K


@pytest.mark.parametrize("cal", [FakeCalibration(rc=2), FakeCalibration(write=False)], ids=["exit 2", "no file"])
def test_a_failed_calibration_caches_nothing(tmp_path, cal):
    with pytest.raises(RuntimeError, match="the calibration failed"):
        cached_profile(K, cal, tmp_path)
    assert list(tmp_path.iterdir()) == []
    good = FakeCalibration()
    assert cached_profile(K, good, tmp_path)[2] and good.calls == 1  # the next session measures


def test_the_suite_has_a_session_fixture_for_it():
    """conftest.py's gpu_profile is session-scoped: one calibration (or one cache read) per pytest run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "pytest", "--fixtures", "-p", "no:cacheprovider",
                        "validations/test_profile_cache.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gpu_profile [session scope] -- conftest.py" in r.stdout, r.stdout[-600:]


def test_quick_leaves_out_what_needs_a_calibration_or_is_slow():
    """`--quick` collects no test that requests suite_profile (each would wait for a calibration, about two
    minutes on a fresh machine) and none marked slow; the full selection holds both kinds."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = ["validations/test_timing.py", "validations/test_optim_kernels.py", "validations/test_bench_kernels.py"]

    def ids(*extra):
        r = subprocess.run([sys.executable, "-m", "pytest", *files, "-m", "gpu", "--collect-only", "-q",
                            "-p", "no:cacheprovider", *extra], cwd=root, capture_output=True, text=True, timeout=300)
        return {line for line in r.stdout.splitlines() if "::" in line}

    full, quick = ids(), ids("--quick")
    calibrated = {i for i in full if "step_time_within_10pct_gpu" in i or "optimizer_step_time_on_this_gpu" in i}
    slow = {i for i in full if "fused_ademamix" in i or "compiled_step_is_one_pass_on_this_gpu" in i}
    assert calibrated and slow and quick
    assert quick == full - calibrated - slow
