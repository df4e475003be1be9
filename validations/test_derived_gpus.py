"""Derived profiles (llm_anatomy/calculator/timing/derived.py): the rules that carry the measured H200's kernel
efficiencies over to another GPU's datasheet, the range around each derived estimate, the names that reach them,
and the committed comparison against published runs (llm_anatomy/report/published.py)."""
from __future__ import annotations

import json
import math

import pytest

from llm_anatomy import records
from llm_anatomy.calculator import gpus
from llm_anatomy.calculator.timing import derived, estimate_time, get, lookup, registry
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.report.published import comparison, profiles_table, table

ROOT = records.ROOT
MEASURED = "h200-measured"
OTHERS = [k for k in gpus.GPUS if k != "h200-sxm"]
# fields that hold no figure of the GPU: names, the calibration's own fit report, bookkeeping
NOT_FIGURES = {"name", "display", "kind", "provenance", "sources", "matmul_fit"}


def named(gpu: str, bound: str) -> str:
    """The profile name of a derived bound: h100-sxm-derived, h100-sxm-derived-low, ..."""
    return f"{gpu}-derived" + ("" if bound == "point" else f"-{bound}")


def close(a, b, rel=1e-12) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)
    return a == b


def test_h200_derived_from_its_own_measurement_reproduces_it():
    """Carrying the H200's fractions over to the H200's own datasheet gives back every measured rate (same
    generation, same clocks: every scale factor is 1) and the same predicted step."""
    d, m = get("h200-sxm-derived"), get(MEASURED)
    for f in ("matmul_flops", "matmul_k_half", "mfu_peak_flops", "hbm_Bps", "launch_s", "kernel_gap_s", "host_op_s",
              "attention", "sdpa_schedule", "fused_rows", "matmul_misaligned", "matmul_misaligned_accumulate",
              "sustained_ratio", "sustained_tau_s"):
        assert close(d[f], m[f]), f
    cfg, run = ModelConfig.from_name("llama3-8b"), Run(batch=1, seq=4096, recompute="mlp")
    a, b = (estimate_time(cfg, run, gpu=g, with_kernels=False)["step_s"] for g in (d, m))
    assert math.isclose(a, b, rel_tol=1e-12)


@pytest.mark.parametrize("gpu", OTHERS)
def test_fractions_of_the_roof_carry_over(gpu):
    """The GEMM, copy and SDPA rates keep the measured H200's fraction of their roof; each calibrated op keeps
    its fraction of the copy bandwidth; launch and host figures are the H200's unchanged."""
    d, m, ds, hds = get(f"{gpu}-derived"), get(MEASURED), lookup.datasheet(gpu), lookup.datasheet("h200-sxm")
    bf = "bfloat16"
    assert math.isclose(d.matmul_flops[bf] / ds.peak_flops[bf], m.matmul_flops[bf] / hds.peak_flops[bf], rel_tol=1e-12)
    assert math.isclose(d.hbm_Bps / ds.hbm_Bps, m.hbm_Bps / hds.hbm_Bps, rel_tol=1e-12)
    att = lambda p: p.attention["cudnn"]["128"]["fwd_bwd"] / p.peak_flops[bf]  # noqa: E731
    assert math.isclose(att(d), att(m), rel_tol=1e-12)
    per_sm = (hds.peak_flops[bf] / hds.sms) / (ds.peak_flops[bf] / ds.sms)  # a CTA's cost follows its SM's peak
    for ph in ("forward", "backward"):
        got, was = d.sdpa_schedule["cudnn"]["128"][ph], m.sdpa_schedule["cudnn"]["128"][ph]
        assert math.isclose(got["c"], was["c"] * per_sm) and math.isclose(got["o"], was["o"] * per_sm)
        assert got["a"] == was["a"]
    for op, width in (("rms_norm.forward", 4096), ("swiglu.backward", 14336), ("residual_add", 4096)):
        assert math.isclose(registry.efficiency(d, op, width, 16384), registry.efficiency(m, op, width, 16384),
                            rel_tol=1e-9), op
    for f in ("launch_s", "kernel_gap_s", "host_op_s", "host_custom_s", "optimizer_host", "host_step"):
        assert d[f] == m[f], f
    assert d.kind == "derived" and d.name == f"{gpu}-derived" and d.sms == ds.sms and d.peak_flops == ds.peak_flops
    assert d.matmul_flops[bf] < ds.peak_flops[bf] and d.hbm_Bps < ds.hbm_Bps  # under the datasheet's roof


def test_sustained_ratio_carries_the_share_of_the_clock_gap():
    """The H200 loses a measured share of its boost-to-base gap under its power limit; a part with a wider
    gap (L40S: base 1110 of boost 2520 MHz) loses that share of its own, and the bounds are the clocks."""
    m = get(MEASURED)
    share = (1 - m.sustained_ratio["matmul"]) / (1 - 1590 / 1980)
    for gpu in OTHERS:
        boost, base, _, _ = derived.clocks.clock(gpu)
        assert math.isclose(get(f"{gpu}-derived").sustained_ratio["matmul"], 1 - share * (1 - base / boost))
        assert get(f"{gpu}-derived-low").sustained_ratio["matmul"] == pytest.approx(base / boost)
        assert get(f"{gpu}-derived-high").sustained_ratio["matmul"] == 1.0


@pytest.mark.parametrize("gpu", list(gpus.GPUS))
def test_every_derived_figure_names_its_source(gpu):
    for bound in derived.BOUNDS:
        d = get(named(gpu, bound))
        missing = [f for f in d if f not in NOT_FIGURES and not (isinstance(d.sources.get(f), str) and d.sources[f])]
        assert missing == [], (gpu, bound)
        assert d.sources["range"].startswith(f"bound {bound}")
    same = derived.GENERATION[gpu] == "hopper"
    assert ("assumption" in get(f"{gpu}-derived").sources["generation"]) is not same


@pytest.mark.parametrize("gpu", list(gpus.GPUS))
def test_range_contains_the_point_estimate(gpu):
    """On a GPU-bound step (the range bounds the GPU's rates; a host-bound step's host is the CPU's)."""
    cfg, run = ModelConfig.from_name("llama2-7b"), Run(batch=2, seq=4096, recompute="mlp")
    t = {b: estimate_time(cfg, run, gpu=named(gpu, b), with_kernels=False)["steady"]["step_s"]
         for b in derived.BOUNDS}
    assert t["high"] < t["point"] < t["low"], t


def _fractions(p) -> dict:
    ds = lookup.datasheet("h200-sxm")
    return dict(gemm=p.matmul_flops["bfloat16"] / ds.peak_flops["bfloat16"], copy=p.hbm_Bps / ds.hbm_Bps,
                sdpa=p.attention["cudnn"]["128"]["fwd_bwd"] / ds.peak_flops["bfloat16"])


# every committed H200 calibration: the packaged one (2026-12-03), the timing probe's (2026-11-30) and the two the
# committed H200 MoE live claims ran on (2026-12-05, 2026-12-06): four machines of one model, the same software
# versions
H200_CALIBRATIONS = (MEASURED, str(records.TIMING_PROBE_PROFILE), str(records.MOE_LIVE_PROFILE),
                     str(records.MOE_GPTOSS_PROFILE))


def test_same_generation_spread_covers_the_committed_h200_calibrations():
    """SPREAD["same"] is at least the widest spread of a carried fraction between two committed H200 calibrations
    (2.8%: the copy rate), and within a point of it (it is that spread rounded up)."""
    fr = [_fractions(get(p)) for p in H200_CALIBRATIONS]
    worst = max(abs(a[k] / b[k] - 1) for a in fr for b in fr for k in a)
    assert 0 < worst <= derived.SPREAD["same"] < worst + 0.01, worst


def test_names_reach_the_derived_the_datasheet_and_the_bounds():
    assert get("H100").name == "h100-sxm-derived" and get("h100-sxm-derived").kind == "derived"
    assert get("H100-datasheet").kind == "datasheet" and get("a100-80gb-datasheet").name == "a100-80gb-sxm"
    assert get("l40s-derived-low").name == "l40s-derived-low"
    assert get("H200").kind == "datasheet" and get(MEASURED).kind == "measured"  # the base keeps its names
    assert gpus.base_key("h100-sxm-derived-high") == gpus.base_key("h100-datasheet") == "h100-sxm"
    assert lookup.bound_names("H100") == {"low": "h100-sxm-derived-low", "high": "h100-sxm-derived-high"}
    assert lookup.bound_names("H100-datasheet") is None and lookup.bound_names(MEASURED) is None
    with pytest.raises(ConfigError) as e:
        get("h100-derived-middle")
    assert "\n" not in str(e.value)


def test_plan_and_estimate_print_the_range(capsys):
    from llm_anatomy.cli import main

    args = ["--preset", "seed", "--gpu", "H100", "--seq", "1024"]
    assert main(["plan", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rg, best = out["range"], out["best"]
    assert out["profile_kind"] == "derived" and rg["low"]["gpu"] == "h100-sxm-derived-low"
    assert rg["low"]["tokens_per_s"] < best["tokens_per_s"] < rg["high"]["tokens_per_s"]
    assert main(["plan", *args]) == 0
    assert "plausible range" in capsys.readouterr().out
    assert main(["estimate", *args, "--batch", "4", "--json"]) == 0
    tm = json.loads(capsys.readouterr().out)["time"]
    assert tm["profile_kind"] == "derived"
    assert tm["range"]["high"]["forward_backward_s"] < tm["forward_backward_s"] < tm["range"]["low"]["forward_backward_s"]
    assert main(["estimate", "--preset", "seed", "--gpu", "H100-datasheet", "--batch", "4", "--json"]) == 0
    assert "range" not in json.loads(capsys.readouterr().out)["time"]


def test_published_comparison_is_current_and_in_the_doc():
    """The committed comparison is what the derived profiles predict now, and docs/derived-gpus.md shows it."""
    from scripts.compare_published import render

    cmp = comparison()
    assert len(cmp["rows"]) >= 5 and all(r["source"] for r in cmp["rows"])
    assert records.DERIVED_GPUS.read_text() == render(cmp), "stale: run python3 -m scripts.compare_published"
    doc = (ROOT / "docs" / "derived-gpus.md").read_text()
    assert table(cmp) in doc and profiles_table() in doc


def test_h100_comparison_is_current_and_in_the_doc():
    """docs/derived-gpus.md shows the derived H100 profile against the H100's calibration and measured steps as the
    committed files give them now (python3 -m scripts.compare_h100)."""
    from scripts.compare_h100 import rates, steps, table

    doc = (ROOT / "docs" / "derived-gpus.md").read_text()
    assert table(rates(), steps()) in doc, "stale: run python3 -m scripts.compare_h100 and update the doc"


def test_derived_h100_predicts_the_measured_h100_steps(claims):
    """The derived H100 profile (the H200's fractions on the H100's datasheet, committed before an H100 was lent)
    predicts each wall step the user's loop measured on an H100 within ±10%."""
    from scripts.compare_h100 import DERIVED, steps

    rows = steps()
    assert len(rows) >= 10
    for r in rows:
        claims.check("time.derived_h100.step (measured H100)", component="step", config=r["case"], variant="recorded",
                     predicted=r[DERIVED], measured=r["measured_ms"], tolerance=0.10, device="cuda (recorded)",
                     unit="ms", note="reports/h100/*-live.json, the derived profile h100-sxm-derived")
