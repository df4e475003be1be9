"""anatomy calibrate's host figures on CPU: Liger's per-chunk cost is timed on Liger's loop (a fake clock and a
fake loss, not a measurement), a figure that is not a time > 0 is left out of the profile loudly, and a profile
that fails its check leaves one line and the measurements, never a silent absence."""
from __future__ import annotations

import inspect
import json
import types

import pytest

from anatomy.calculator import timing
from anatomy.calculator.timing import fit, profile
from anatomy.config import ConfigError, ModelConfig, Run
from anatomy.measure import calibrate, calibrate_host
from validations.test_calibrate import _fake_measurements

FIXED_US, CHUNK_US, BACKWARD_US = 900.0, 150.0, 470.0  # fake host costs of one call (not measured)


class _FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _fake_linear_ce(clock: _FakeClock, calls: list):
    """A stand-in for anatomy.efficient.loss.linear_ce whose host time is FIXED_US + CHUNK_US per chunk of the
    loop it runs: Liger's (liger_chunks) with impl="liger", ours (one chunk of up to 4,096 rows) otherwise."""
    def linear_ce(x, w, t, reduction="mean", impl="anatomy"):
        T, H, V = x.shape[0], x.shape[1], w.shape[0]
        calls.append(impl)
        n = calibrate_host.liger_chunks(T, H, V) if impl == "liger" else 1
        clock.t += (FIXED_US + CHUNK_US * n) * 1e-6

        def backward():
            clock.t += BACKWARD_US * 1e-6
        return types.SimpleNamespace(backward=backward)
    return linear_ce


def test_liger_host_times_liger_loop_per_chunk(monkeypatch):
    """measure_liger_host calls Liger's loss (impl="liger"), whose chunk count grows with V / H: the slope is the
    per-chunk cost and the rest the fixed call. Called through the model's default (ours, one chunk at these
    tiny rows) the calls cost the same at every vocab, the slope is 0, and calibrate wrote chunk = 0.0, which
    the profile check rejects (the H200 run of 2026-12-01)."""
    from anatomy.efficient import loss

    clock, calls = _FakeClock(), []
    monkeypatch.setattr(calibrate_host, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(loss, "linear_ce", _fake_linear_ce(clock, calls))
    assert [calibrate_host.liger_chunks(128, 256, V) for V in calibrate_host.LIGER_HOST["vocabs"]] == [1, 8, 16, 32]
    got = calibrate_host.measure_liger_host(reps=2, device="cpu")
    assert set(calls) == {"liger"}
    assert got["chunk"] == pytest.approx(CHUNK_US) and got["forward"] == pytest.approx(FIXED_US)
    assert got["backward"] == pytest.approx(BACKWARD_US)
    # the failure mode: calls that do not run Liger's loop (ours, 1 chunk) give a zero slope
    flat = calibrate_host.liger_fit([1, 8, 16, 32], [FIXED_US + CHUNK_US] * 4, [BACKWARD_US] * 4)
    assert flat["chunk"] == pytest.approx(0.0, abs=1e-9)
    data = dict(name="h200-measured", base="h200-sxm", kind="measured", provenance={},
                measurements=dict(_fake_measurements(), host_custom_us=dict(liger_ce=dict(flat, chunk=0.0))))
    with pytest.raises(ConfigError, match=r"host_custom_us\.liger_ce\.chunk must be a finite number > 0, got 0\.0"):
        profile.check_measured(data, "calibrated profile")


def test_a_figure_that_is_not_a_time_is_left_out_loudly_and_the_model_counts_eager_ops():
    """drop_unmeasured removes liger_ce.chunk = 0.0 and a negative backward (fwd+bwd - fwd under noise), one line
    each; the profile then builds, and Liger's loop is counted as eager ops per chunk (liger_loss's host_ops)."""
    hc = dict(rms_norm=dict(forward=90.0, backward=-3.0), source="fake",
              liger_ce=dict(forward=1000.0, chunk=0.0, backward=470.0, calls_us={"1": 1050.0}))
    lines = calibrate_host.drop_unmeasured(hc)
    assert len(lines) == 2 and any("liger_ce.chunk measured 0 us" in s for s in lines)
    assert hc["liger_ce"] == dict(forward=1000.0, backward=470.0, calls_us={"1": 1050.0})
    assert hc["rms_norm"] == dict(forward=90.0)
    assert calibrate_host.drop_unmeasured(hc) == []
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), host_custom_us=hc), {}, "h200-sxm"))
    cfg = ModelConfig(name="v", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=18042)
    run = Run(2, 2048, loss_impl="liger")  # 16 chunks
    r = timing.estimate_time(cfg, run, "efficient", p, optimizer=None, with_kernels=True)
    chunk = next(k for k in r["kernels"] if k["name"] == "loss.logits")
    assert chunk["host_s"] == pytest.approx(16 * (4 + 2) * p["host_op_s"])  # 6 eager ops a chunk under amp


def test_host_step_records_the_loss_it_runs():
    """The tiny host step runs the efficient model's default loss (setup_step builds the model with it); the
    record says so, or the calculator would rebuild its kernels with Liger's (Run.from_record's default)."""
    from anatomy.efficient.transformer import Transformer

    default = inspect.signature(Transformer.__init__).parameters["loss_impl"].default
    assert calibrate_host.HOST_STEP["loss_impl"] == default == Run(1, 1).loss_impl
    assert Run.from_record(calibrate_host.HOST_STEP).loss_impl == default


def _fake_calibrate(monkeypatch, measurements: dict, host_step: dict) -> None:
    """calibrate.main with every measurement replaced by fake numbers (not a measurement) on a fake H200."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    m = measurements
    fakes = dict(measure_copy=lambda: m["copy_tbps"], measure_launch=lambda: m["launch_us"],
                 measure_host=lambda: (m["host_op_us"], dict(m["host_custom_us"])),
                 measure_host_step=lambda **_: json.loads(json.dumps(host_step)),
                 measure_attention=lambda _d: (m["attention"], []), measure_matmuls=lambda _g, _d: m["matmul_bf16"],
                 measure_gemms_in_step=lambda _g, _d: [], measure_fused=lambda _d: [],
                 measure_vocab_matmuls=lambda _g, _d: [], measure_sdpa_kernels=lambda _d: [],
                 measure_kernel_gap=lambda: None, measure_sustained=lambda _w: None,
                 _env=lambda argv: dict(gpu="fake", command="anatomy calibrate (fake)"))
    for name, f in fakes.items():
        monkeypatch.setattr(calibrate, name, f)


def test_calibrate_writes_the_profile_without_a_zero_chunk_and_says_so(tmp_path, monkeypatch, capsys):
    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0), baseline=dict(forward_backward_ms=7.0),
              liger_ce=dict(forward=1000.0, chunk=0.0, backward=470.0))
    _fake_calibrate(monkeypatch, _fake_measurements(), hs)
    out = tmp_path / "h200.json"
    assert calibrate.main(["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "WARNING: host_custom_us.liger_ce.chunk measured 0 us" in err
    data = json.loads(out.read_text())
    assert "chunk" not in data["measurements"]["host_custom_us"]["liger_ce"]
    assert len(data["provenance"]["dropped"]) == 1 and not calibrate.rejected_path(out).exists()


def test_calibrate_that_cannot_build_a_profile_fails_in_one_line_and_keeps_the_measurements(tmp_path, monkeypatch,
                                                                                           capsys):
    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0))
    _fake_calibrate(monkeypatch, dict(_fake_measurements(), copy_tbps=0.0), hs)  # a copy rate of 0: no profile
    out = tmp_path / "h200.json"
    assert calibrate.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FAILED, no profile written" in err and "copy_tbps" in err
    assert not out.exists()
    kept = json.loads(calibrate.rejected_path(out).read_text())
    assert kept["measurements"]["copy_tbps"] == 0.0 and "copy_tbps" in kept["error"]
