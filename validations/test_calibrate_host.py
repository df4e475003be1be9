"""anatomy calibrate's host figures on CPU: Liger's per-chunk cost is timed on Liger's loop (a fake clock and a
fake loss, not a measurement), a figure that is not a time > 0 is left out of the profile loudly, and a profile
that fails its check leaves one line and the measurements, never a silent absence."""
from __future__ import annotations

import inspect
import json
import types

import pytest

from llm_anatomy import records
from llm_anatomy.calculator import timing
from llm_anatomy.calculator.timing import fit, profile
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.measure import calibrate, calibrate_host
from validations.test_calibrate import _fake_measurements

FIXED_US, CHUNK_US, BACKWARD_US = 900.0, 150.0, 470.0  # fake host costs of one call (not measured)
CALL_US, TENSOR_US = 120.0, 45.0  # fake host cost of the compiled optimizer step: call + per tensor (not measured)
_OPT_HOST = dict(rows=[dict(tensors=n, us=CALL_US + TENSOR_US * n) for n in calibrate_host.OPTIMIZER_HOST_TENSORS])


class _FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _fake_linear_ce(clock: _FakeClock, calls: list):
    """A stand-in for llm_anatomy.efficient.loss.linear_ce whose host time is FIXED_US + CHUNK_US per chunk of the
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
    tiny rows) the calls cost the same at every vocab, the slope is 0, and calibrate would write chunk = 0.0,
    which the profile check rejects."""
    from llm_anatomy.efficient import loss

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
    from llm_anatomy.efficient.transformer import Transformer

    default = inspect.signature(Transformer.__init__).parameters["loss_impl"].default
    assert calibrate_host.HOST_STEP["loss_impl"] == default == Run(1, 1).loss_impl
    assert Run.from_record(calibrate_host.HOST_STEP).loss_impl == default


_SDPA_ROWS = json.loads(records.H200_PROFILE.read_text())["measurements"]["attention_kernels"]  # every grid


# fake masked-SDPA rows (not measurements), in calibrate_sdpa.measure_masked_attention's fields
_MASKED = [dict(B=2, heads=64, kv_heads=8, S=2048, keys=2049, hd=64, pad=8, fwd_ms=1.0, fwd_bwd_ms=3.0, backend="cudnn")]


def _fake_calibrate(monkeypatch, measurements: dict, host_step: dict) -> None:
    """calibrate.main with every measurement replaced by fake numbers (not a measurement) on a fake H200."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    m = measurements
    fakes = dict(measure_copy=lambda: m["copy_tbps"], measure_upcast=lambda: m.get("upcast_tbps", m["copy_tbps"] / 2),
                 measure_launch=lambda: m["launch_us"],
                 measure_host=lambda: (m["host_op_us"], dict(m["host_custom_us"])),
                 measure_host_step=lambda **_: json.loads(json.dumps(host_step)),
                 measure_attention=lambda _d: (m["attention"], []),
                 measure_masked_attention=lambda _d, _t: (json.loads(json.dumps(m.get("attention_masked", _MASKED))), []),
                 measure_matmuls=lambda _g, _d: m["matmul_bf16"],
                 measure_gemms_in_step=lambda _g, _d: [], measure_fused=lambda _d: [], measure_grouped=lambda _d: [],
                 measure_vocab_matmuls=lambda _g, _d: [],
                 measure_sdpa_kernels=lambda _d: json.loads(json.dumps(m.get("attention_kernels", _SDPA_ROWS))),
                 measure_kernel_gap=lambda: None, measure_sustained=lambda _w: None,
                 measure_optimizer_host=lambda **_: json.loads(json.dumps(m.get("optimizer_host", _OPT_HOST))),
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


class _FakeStep:
    """A stand-in optimizer whose step costs CALL_US + TENSOR_US per parameter tensor on the fake clock."""
    def __init__(self, clock: _FakeClock, params: list):
        self.clock, self.n = clock, len(params)

    def step(self):
        self.clock.t += (CALL_US + TENSOR_US * self.n) * 1e-6


def test_optimizer_host_times_the_step_at_each_tensor_count(monkeypatch):
    """measure_optimizer_host times one step per tensor count on the host clock (a fake clock and a fake step here,
    not a measurement); the profile's line through the rows is the step's call and per-tensor cost, exactly."""
    clock = _FakeClock()
    monkeypatch.setattr(calibrate_host, "time", types.SimpleNamespace(perf_counter=clock, monotonic=clock))
    got = calibrate_host.measure_optimizer_host(counts=(4, 16, 64), reps=5, device="cpu",
                                                make=lambda ps: _FakeStep(clock, ps))
    assert [r["tensors"] for r in got["rows"]] == [4, 16, 64]
    assert [r["us"] for r in got["rows"]] == pytest.approx([CALL_US + TENSOR_US * n for n in (4, 16, 64)])
    f = fit.optimizer_host_fit(got["rows"])
    assert (f["call_s"], f["tensor_s"], f["max_error"]) == pytest.approx((CALL_US * 1e-6, TENSOR_US * 1e-6, 0.0))
    # past the deadline no count is started
    assert calibrate_host.measure_optimizer_host(counts=(4, 16), device="cpu", deadline=clock.t - 1,
                                                 make=lambda ps: _FakeStep(clock, ps)) == dict(rows=[])


def test_optimizer_host_subtracts_the_steps_gpu_time(monkeypatch):
    """What the row keeps is the host time the GPU waited for: the wall time less the step's GPU time (a fake
    clock, a fake step and a fake GPU timer here, not a measurement)."""
    clock, gpu = _FakeClock(), 40.0

    def gpu_us(step):  # the GPU timer steps too (it times a step), off the host clock's wall samples
        step()
        return gpu
    monkeypatch.setattr(calibrate_host, "time", types.SimpleNamespace(perf_counter=clock, monotonic=clock))
    got = calibrate_host.measure_optimizer_host(counts=(4, 16), reps=5, device="cpu", numel=3, gpu_us=gpu_us,
                                                make=lambda ps: _FakeStep(clock, ps))
    assert [(r["tensors"], r["numel"]) for r in got["rows"]] == [(4, 3), (16, 3)]
    assert [r["us"] for r in got["rows"]] == pytest.approx([CALL_US + TENSOR_US * n - gpu for n in (4, 16)])
    assert [r["wall_us"] - r["gpu_us"] for r in got["rows"]] == pytest.approx([r["us"] for r in got["rows"]])


def test_optimizer_host_runs_a_real_step_on_cpu():
    """The same function over real parameters and AdEMAMix's eager foreach step (compile=False: the compiled one
    spends ~30 s compiling C++ per count here): a row per count, each a time > 0, and every parameter stepped."""
    from llm_anatomy.optim import FusedAdEMAMix

    made = []

    def make(ps):
        made.append(ps)
        return FusedAdEMAMix(ps, lr=1e-3, compile=False)
    got = calibrate_host.measure_optimizer_host(counts=(2, 8), reps=3, warmup=1, device="cpu", make=make)
    assert [r["tensors"] for r in got["rows"]] == [2, 8] and all(r["us"] > 0 for r in got["rows"])
    assert all(bool((p != 0).all()) for ps in made for p in ps)  # lr x sign of the grad: every parameter moved


def test_profile_with_and_without_the_optimizer_host():
    """A profile without measurements.optimizer_host loads with none and names the fallback (an eager op per
    launch); with it, the fitted call and per-tensor seconds; a malformed one is one line naming the field."""
    p0 = fit.from_measured(calibrate.build_profile(_fake_measurements(), {}, "h200-sxm"))
    assert p0.optimizer_host == {} and p0["sources"]["optimizer_host"].startswith("not measured")
    sheet = timing.get("h200-sxm")
    assert sheet.optimizer_host == {} and sheet["sources"]["optimizer_host"].startswith("not measured")
    m = dict(_fake_measurements(), optimizer_host={"ademamix-compiled": _OPT_HOST})
    p = fit.from_measured(calibrate.build_profile(m, {}, "h200-sxm"))
    f = p.optimizer_host["ademamix-compiled"]
    assert (f["call_s"], f["tensor_s"]) == pytest.approx((CALL_US * 1e-6, TENSOR_US * 1e-6))
    assert f["tensors"] == list(calibrate_host.OPTIMIZER_HOST_TENSORS)
    assert "per tensor" in p["sources"]["optimizer_host"]
    flat = [dict(tensors=n, us=500.0 - n) for n in (8, 32, 128)]  # a slope <= 0: not the host following the list
    p1 = fit.from_measured(calibrate.build_profile(dict(m, optimizer_host={"ademamix-compiled": dict(rows=flat)}),
                                                   {}, "h200-sxm"))
    assert p1.optimizer_host == {} and p1["sources"]["optimizer_host"].startswith("not measured")
    bad = [({"ademamix-compiled": dict(rows=_OPT_HOST["rows"][:1])}, r"ademamix-compiled\.rows must be rows at two"),
           ({"adamw": _OPT_HOST}, r"adamw must be one of ademamix-compiled"),  # its call is not timed whole
           ({"ademamix-compiled": dict(rows=[dict(tensors=8, us=0.0), dict(tensors=32, us=1.0)])},
            r"ademamix-compiled\.rows\[0\]\.us must be a finite number > 0"),
           ({"ademamix-compiled": [1, 2]}, r"ademamix-compiled\.rows must be a list")]
    for oh, msg in bad:
        data = dict(name="h200-measured", base="h200-sxm", kind="measured", provenance={},
                    measurements=dict(_fake_measurements(), optimizer_host=oh))
        with pytest.raises(ConfigError, match=r"calibrated profile: field measurements\.optimizer_host\." + msg):
            profile.check_measured(data, "calibrated profile")


def test_calibrate_writes_the_optimizer_host_and_leaves_out_a_single_count(tmp_path, monkeypatch, capsys):
    """calibrate.main keeps the optimizer's rows (fake here); rows at one count, as a deadline can leave, are left out
    of the profile with one warning line, and the profile is still written."""
    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0))
    _fake_calibrate(monkeypatch, _fake_measurements(), hs)
    out = tmp_path / "h200.json"
    assert calibrate.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["measurements"]["optimizer_host"] == {"ademamix-compiled": _OPT_HOST}
    assert timing.get(str(out)).optimizer_host["ademamix-compiled"]["tensor_s"] == pytest.approx(TENSOR_US * 1e-6)
    _fake_calibrate(monkeypatch, dict(_fake_measurements(), optimizer_host=dict(rows=_OPT_HOST["rows"][:1])), hs)
    capsys.readouterr()
    out1 = tmp_path / "h200-one.json"
    assert calibrate.main(["--out", str(out1)]) == 0
    assert "WARNING: optimizer_host: 1 tensor count(s)" in capsys.readouterr().err
    data = json.loads(out1.read_text())
    assert "optimizer_host" not in data["measurements"] and len(data["provenance"]["dropped"]) == 1


def test_calibrate_times_the_sdpa_schedule_whatever_the_budget_left(tmp_path, monkeypatch, capsys):
    """SDPA's kernel schedule gets its own seconds (SDPA_KERNELS_S) from when it starts, not what is left of
    --budget-s (the host and optimizer measurements before it may spend all of that); grids it could not
    time are named in one warning line and in provenance.dropped."""
    import time

    from llm_anatomy.measure.calibrate_sdpa import schedule_shapes

    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0))
    _fake_calibrate(monkeypatch, _fake_measurements(), hs)
    given = []
    monkeypatch.setattr(calibrate, "measure_sdpa_kernels", lambda d: given.append(d - time.monotonic()) or _SDPA_ROWS)
    out = tmp_path / "h200.json"
    assert calibrate.main(["--out", str(out), "--budget-s", "0"]) == 0
    assert given and given[0] > calibrate.SDPA_KERNELS_S - 5
    assert not json.loads(out.read_text())["provenance"]["dropped"]
    _fake_calibrate(monkeypatch, dict(_fake_measurements(), attention_kernels=_SDPA_ROWS[:3]), hs)
    capsys.readouterr()
    assert calibrate.main(["--out", str(tmp_path / "h200-short.json")]) == 0
    assert f"WARNING: attention_kernels: 3 of {len(schedule_shapes())} SDPA grids" in capsys.readouterr().err
    data = json.loads((tmp_path / "h200-short.json").read_text())
    assert len(data["measurements"]["attention_kernels"]) == 3 and len(data["provenance"]["dropped"]) == 1
