"""The real-depth time claims measured now, on this GPU: the user's own loop on drawn real-depth cases.

test_real_depth.py checks the committed user-loop records (scripts/probe_timing.py --user-loop, 30 drawn cases
and the presets per run); this file re-proves the same claims live, on `--live-real-depth` cases (default 3) of
llm_anatomy/real_depth.py's draw with the seed `--live-seed` (default 2026), so the GPU suite checks the
timing model on 12-32-layer, 0.5-8 B-parameter models on whatever GPU it runs on. Each case runs the loop of
scripts/user_loop.py (measure: fused AdamW, bf16 autocast over fp32 weights, steps back to back, then a
profiled pass) in a process of its own (its profiler leaves CUPTI attached, which would slow every later
launch of this one), and is predicted with the suite's profile (conftest.py suite_profile):
  time.real_depth.gpu.forward_backward, time.real_depth.gpu.step   kernel time within ±10%
  time.real_depth.step        the wall-clock step within ±10% where the model calls the case GPU-bound
The cases are drawn to fit this GPU (its total memory; the H200's where none is present); a case the calculator
does not fit in its free memory (the same 85% rule as the draw's) is skipped,
quoting its peak. The measured rows (clocks and per-component kernel times included) are written beside the
claims report as real-depth-live.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm_anatomy import real_depth

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
_MEASURED: dict[str, dict] = {}  # case id -> its row, measured once for its three claims
LIVE_ROWS = "real-depth-live.json"  # the measured rows, beside the claims report


def pytest_generate_tests(metafunc):
    if "live_case" in metafunc.fixturenames:
        n, seed = metafunc.config.getoption("--live-real-depth"), metafunc.config.getoption("--live-seed")
        cases = real_depth.draw(n, seed, _capacity()) if n > 0 else []
        metafunc.parametrize("live_case", cases, ids=[c.id for c in cases])


def _capacity() -> int:
    """The memory the cases are drawn to fill: this GPU's where one is present (an 80 GB H100 runs cases of its
    own size, not the H200's, which it would skip), else the H200's (the draw a CPU collection lists)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else real_depth.H200_CAPACITY


def _measure(case: real_depth.Case, keep: Path | None = None) -> dict:
    """The case's row as scripts/user_loop.py records it (with its components' kernel times), from a process of
    its own; every row measured so far is written to `keep` (JSON), so a miss can be read after the run."""
    if case.id not in _MEASURED:
        row = dict(id=case.id, cfg=case.cfg.to_dict(), batch=case.run.batch, seq=case.run.seq,
                   recompute=case.run.recompute, variant=case.variant, optimizer="adamw")
        code = ("import json, sys; from scripts import user_loop; "
                "from llm_anatomy.real_depth import case_of; "
                "print(json.dumps(user_loop.measure(case_of(json.loads(sys.argv[1])), True)))")
        out = subprocess.run([sys.executable, "-c", code, json.dumps(row)], capture_output=True, text=True,
                             timeout=300, cwd=SCRIPTS.parent)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.fail(f"{case.id}: the user's loop exited {out.returncode}: {last}", pytrace=False)
        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        _MEASURED[case.id] = row
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_text(json.dumps(dict(rows=list(_MEASURED.values())), indent=1) + "\n")
    return _MEASURED[case.id]


@pytest.mark.gpu
@pytest.mark.parametrize("what", real_depth.QUANTITIES)
def test_real_depth_time_on_this_gpu(live_case, what, claims, cuda_device, suite_profile, request):
    """One drawn real-depth case, measured in the user's loop now, against estimate_time on the suite's profile."""
    import gc

    import torch

    case, (profile, label) = live_case, suite_profile
    if case.id not in _MEASURED:  # the loop's process shares the GPU with this one: hand back the cached blocks
        gc.collect()
        torch.cuda.empty_cache()
    need, (free, total) = real_depth.peak_bytes(case.cfg, case.run, case.variant), torch.cuda.mem_get_info()
    if need > real_depth.HEADROOM * free:
        pytest.skip(f"predicted not to fit: {need / 2**30:,.1f} GiB at the peak with AdamW, over "
                    f"{real_depth.HEADROOM:.0%} of the {free / 2**30:,.1f} GiB free of {total / 2**30:,.1f}")
    row = _measure(case, Path(request.config.getoption("--claims-report")).with_name(LIVE_ROWS))
    c = real_depth.claim(row, what, profile, f"live, profile {label}")
    if isinstance(c, str):
        pytest.skip(c)
    claims.check(c["claim"], component="step", config=f"{case.id} (live)", variant=case.variant,
                 predicted=c["predicted"], measured=c["measured"], tolerance=c["tolerance"], device="cuda", unit="ms",
                 note=c["note"])


# ---- on CPU: the wiring ---------------------------------------------------------------------------------
def test_claims_read_a_user_loop_row_as_the_record_tests_do():
    """real_depth.claim on committed user-loop rows: the predictions and measurements of the quantities."""
    from validations.test_real_depth import ROWS

    rows = [r for r in ROWS if r is not None][:6]
    if not rows:
        pytest.skip("no committed user-loop record")
    for r in rows:
        res = real_depth.predicted(r, r["gpu"])
        fb, st = real_depth.claim(r, "forward_backward", r["gpu"], "x"), real_depth.claim(r, "step", r["gpu"], "x")
        assert fb["predicted"] == pytest.approx((res["phases"]["forward"]["gpu_s"] + res["phases"]["backward"]["gpu_s"]) * 1e3)
        assert (fb["measured"], st["measured"]) == (r["kernels"]["forward_backward_ms"], r["kernels"]["step_ms"])
        assert st["predicted"] == pytest.approx(res["gpu_s"] * 1e3)
        wall = real_depth.claim(r, "wall", r["gpu"], "x")
        assert isinstance(wall, str) == (real_depth.predicted_busy(res) < real_depth.GPU_BOUND_BUSY)


def test_the_loop_process_imports_and_names_its_failure():
    """The measuring process's code runs as far as the GPU: on a machine without one it exits non-zero and the
    test fails with that process's last line, not with an import error of its own."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU test runs the process itself")
    case = real_depth.draw(1, 2026)[0]
    _MEASURED.pop(case.id, None)
    with pytest.raises(pytest.fail.Exception, match=rf"{case.id}: the user's loop exited 1: .*(CUDA|cuda|GPU|NVIDIA)"):
        _measure(case)


def test_the_measured_rows_are_kept_beside_the_claims_report(tmp_path, monkeypatch):
    """_measure writes every row measured so far to `keep` (real-depth-live.json beside the claims report),
    the loop's own figures merged into the case's, so a missed claim can be read after the run."""
    import types

    case = real_depth.draw(1, 2026)[0]
    _MEASURED.pop(case.id, None)
    loop = dict(wall=dict(step_ms=100.0), clocks=dict(sm_mhz=1700.0), kernels=dict(step_ms=99.0))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        returncode=0, stdout="noise\n" + json.dumps(loop) + "\n", stderr=""))
    keep = tmp_path / "out" / LIVE_ROWS
    try:
        row = _measure(case, keep)
    finally:
        _MEASURED.pop(case.id, None)
    kept = json.loads(keep.read_text())["rows"]
    assert kept == [row] and row["id"] == case.id and row["clocks"] == loop["clocks"] and row["variant"] == case.variant
