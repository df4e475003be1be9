"""The sustained-load regime (llm_anatomy/measure/calibrate_sustained.py, fit.sustained_fields,
roofline.sustained_weight): a long step runs at a lower, power-limited clock than calibrate's bursts; the
profile carries the ratio and its time constant, and the timing model weighs them by the step's length (all
on CPU, with fake measurements)."""
from __future__ import annotations

import pytest

from llm_anatomy.calculator import timing
from llm_anatomy.calculator.timing import fit, roofline
from llm_anatomy.config import PRESETS, ConfigError, Run
from llm_anatomy.measure import calibrate
from validations.test_calibrate import _fake_measurements


def _fake_sustained(ratio=0.8, tau=0.4, mem=0.98) -> dict:
    """Fake numbers (not a measurement): a GEMM rate falling from 800 to 800 x ratio TFLOP/s with time constant
    tau over an 8 s warm-up, chunks every 20 ms."""
    import math

    trace = [dict(t_s=0.02 * i, tflops=800 * (ratio + (1 - ratio) * math.exp(-0.02 * i / tau)), clock_MHz=None,
                  power_W=None) for i in range(1, 400)]
    b = dict(matmul_tflops=800.0, attention_tflops=500.0, copy_tbps=4.2, clock_MHz=1980.0, power_W=480.0)
    s = dict(matmul_tflops=800.0 * ratio, attention_tflops=500.0 * ratio, copy_tbps=4.2 * mem, clock_MHz=1590.0,
             power_W=None)
    return dict(burst=b, sustained=s, trace=trace, warmup_s=8.0, settled=True, limits=dict(power_limit_W=700.0))


def test_sustained_fields_from_a_fake_warm_up():
    """The ratios are the sustained rates over the burst ones, per class; the time constant is recovered
    from the trace within a chunk; the clocks are carried; a short step stays near burst, a long one near
    sustained, and the weight rises monotonically with the step's length."""
    data = calibrate.build_profile(dict(_fake_measurements(), sustained=_fake_sustained()), dict(date="fake"),
                                   "h200-sxm")
    p = fit.from_measured(data)
    assert p.sustained_ratio == pytest.approx(dict(matmul=0.8, attention=0.8, memory=0.98))
    assert p.sustained_tau_s == pytest.approx(0.4, abs=0.02)
    assert p.clocks["burst_MHz"] == 1980.0 and p.clocks["sustained_W"] is None and p.clocks["power_limit_W"] == 700.0
    assert "warm-up" in p.sources["sustained_ratio"]
    w = [roofline.sustained_weight(t, p.sustained_tau_s) for t in (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)]
    assert w == sorted(w) and w[0] < 0.002 and w[-1] > 0.99
    assert roofline.sustained_weight(0.5, 0.0) == 0.0


def test_fit_tau_without_a_fall():
    """A flat trace has no time constant: the term is then ~0 for any step (its first chunk's time)."""
    trace = [dict(t_s=0.02 * i, tflops=800.0) for i in range(1, 100)]
    assert fit.fit_tau(trace) == pytest.approx(0.02)


def test_sustained_term_scales_compute_not_launches():
    """At full sustained weight a compute-bound GEMM takes 1 / ratio of its burst time (less the launch
    term); a copy-bound kernel takes 1 / memory ratio; weight 0 is the burst profile exactly."""
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), sustained=_fake_sustained()),
                                                  dict(date="fake"), "h200-sxm"))
    mm = timing.Kernel("mm", "mlp", "forward", "matmul", 1, 2 * 8192 ** 3, 3 * 8192 ** 2 * 2, shape=(1, 8192, 8192, 8192))
    cp = timing.Kernel("cp", "norm", "forward", "memory", 1, 0, 2 << 30)
    for k, r in ((mm, 0.8), (cp, 0.98)):
        b, s = timing.time_kernel(k, p), timing.time_kernel(k, p, 1.0)
        assert s["time_s"] - s["launch_s"] == pytest.approx((b["time_s"] - b["launch_s"]) / r, rel=1e-9)
        assert timing.time_kernel(k, p, 0.0) == b


def test_estimate_picks_the_regime_from_the_step_length():
    """A 7B-class step (hundreds of ms) runs mostly sustained, a tiny one at burst; the estimate states its
    weight; a profile without the term (sustained_ratio empty) gives the burst estimate."""
    p = fit.from_measured(calibrate.build_profile(dict(_fake_measurements(), sustained=_fake_sustained(tau=0.1)),
                                                  dict(date="fake"), "h200-sxm"))
    big = timing.estimate_time(PRESETS["llama2-7b"], Run(1, 4096), "efficient", p)
    tiny = timing.estimate_time(PRESETS["seed"], Run(1, 256), "efficient", p)
    burst = timing.estimate_time(PRESETS["llama2-7b"], Run(1, 4096), "efficient", p.replace(sustained_ratio={}))
    assert big["sustained"]["weight"] > 0.6 and tiny["sustained"]["weight"] < 0.05
    assert 1.1 < big["step_s"] / burst["step_s"] < 1.25  # compute slows by <= 1/0.8; memory-bound work barely
    assert burst["sustained"]["weight"] == 0.0


def test_datasheet_profiles_have_the_clock_term():
    """Every datasheet GPU carries base/boost clocks and TDP with a source; its compute ratio is base/boost,
    memory 1."""
    from llm_anatomy.calculator import clocks, gpus

    assert set(clocks.CLOCKS) == set(gpus.GPUS)
    for name, (boost, base, tdp, src) in clocks.CLOCKS.items():
        p = timing.get(f"{name}-datasheet")  # the bare name times with the derived profile (timing/derived.py)
        assert 0 < base < boost and tdp > 0 and src.startswith("TechPowerUp") and "techpowerup.com" in src
        assert p.sustained_ratio == dict(matmul=base / boost, attention=base / boost, memory=1.0)
        assert p.sustained_tau_s > 0 and "assumption" in p.sources["sustained_tau_s"]


@pytest.mark.parametrize("path, value", [
    (("burst", "matmul_tflops"), 0.0), (("sustained", "copy_tbps"), float("nan")), (("burst", "clock_MHz"), -5.0),
    (("trace",), [dict(t_s=0.0, tflops=1.0)]), (("trace",), "x"), (("warmup_s",), None), (("sustained",), 3),
    (("limits", "power_limit_W"), "700"), (("limits",), [700]), (("settled",), "yes")])
def test_bad_sustained_measurements_are_one_line_errors(path, value):
    s = _fake_sustained()
    d = s
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(ConfigError, match=r"measurements\.sustained"):
        calibrate.build_profile(dict(_fake_measurements(), sustained=s), dict(date="fake"), "h200-sxm")


def test_warmup_flag_is_checked_before_cuda(capsys):
    assert calibrate.main(["--warmup-s", "0.1"]) == 2
    assert "--warmup-s" in capsys.readouterr().err


class _FakeEvent:
    """A CUDA event on a fake GPU clock: record() stamps the clock, elapsed_time() is in ms."""

    def __init__(self, gpu):
        self.gpu = gpu

    def record(self):
        self.t = self.gpu["t"]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_settle_stops_when_the_rate_settles(monkeypatch):
    """settle: one trace row per chunk after the first two, the rate is work x chunk over the chunk's GPU time,
    and it stops once the last SETTLE_S of rates spreads within SETTLE_TOL after min_s (a fake load whose
    chunks slow from 1.0 to 1.25 ms and stay there; a fake wall clock moving 10 ms per chunk)."""
    from llm_anatomy.measure import calibrate_sustained as cs

    gpu, wall, calls = {"t": 0.0}, {"t": 0.0}, []

    def fn():  # each call: 0.1 ms, slowing by 25% over the first 40 chunks' calls
        calls.append(1)
        gpu["t"] += 1e-4 * (1 + 0.25 * min(1.0, len(calls) / 400))
        wall["t"] += 1e-3

    monkeypatch.setattr(cs.time, "monotonic", lambda: wall["t"])
    trace, settled = cs.settle(fn, 2.0, lambda: (1500.0, 690.0), max_s=30.0, min_s=1.5, chunk=10,
                               event=lambda: _FakeEvent(gpu), sync=lambda: None)
    assert settled and 1.5 <= trace[-1]["t_s"] < 30.0
    assert trace[-1]["rate"] == pytest.approx(2.0 * 10 / 1.25e-3, rel=1e-6)
    assert trace[0]["rate"] > trace[-1]["rate"] and trace[-1]["clock_MHz"] == 1500.0
    short, ok = cs.settle(fn, 2.0, lambda: (None, None), max_s=0.05, min_s=1.5, chunk=10,
                          event=lambda: _FakeEvent(gpu), sync=lambda: None)
    assert not ok and short[-1]["t_s"] >= 0.05 and short[-1]["power_W"] is None


def test_the_power_probe_summarizes_and_refuses_without_a_gpu(tmp_path, capsys):
    """scripts/probe_power.py: summary() takes the first chunk as the burst and the medians of the last second;
    bad arguments and a machine without a GPU are one line each, exit 2."""

    from scripts import probe_power

    trace = [dict(t_s=0.1 * i, rate=10.0 - min(i, 5), clock_MHz=1980.0 - 10 * min(i, 5), power_W=700.0)
             for i in range(1, 30)]
    s = probe_power.summary(trace)
    assert (s["burst_rate"], s["burst_clock_MHz"], s["rate"], s["clock_MHz"], s["power_W"]) == (9.0, 1970.0, 5.0,
                                                                                                1930.0, 700.0)
    assert probe_power.main(["--out", str(tmp_path / "p.json"), "--max-s", "0"]) == 2
    assert "--max-s" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert probe_power.main(["--out", str(tmp_path / "p.json")]) == 2
        assert capsys.readouterr().err.strip() == "probe_power: error: needs a CUDA GPU; this machine has none"
