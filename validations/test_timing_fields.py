"""The timing model of gpt-oss's and OLMoE's attention fields (calculator/timing/kernels_fields.py), on CPU:

- the kernel lists' FLOPs are the calculator's, exactly: every matmul plus every SDPA call, a masked call's
  FLOPs (S x keys at the called head dim, what the kernel runs) carried to the calculator's S x S at hd by their
  exact ratio, a causal one doubled (the causal convention); both variants, every recompute policy, gpt-oss-20b
  and OLMoE-1B-7B and 20 drawn configs;
- the masked calibration rows (calibrate_sdpa.measure_masked_attention's fields; fake numbers, not measurements)
  round-trip through check_measured and fit.from_measured into Profile.attention_masked; bad rows are refused in
  one line naming the field;
- a measured profile without them refuses masked attention in one line (the packaged h200-measured, and the
  `anatomy estimate --gpu h200-measured` command); a datasheet one prices it at the bf16 peak, its sources say so;
- a derived profile carries the masked rates by the causal rates' factor (the bf16 peak ratio);
- with the rows, a masked SDPA entry's time is its FLOPs at the calibrated rate x wave quantization.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy import records
from llm_anatomy.calculator import estimate
from llm_anatomy.calculator.timing import derived, estimate_time, fit, lookup, roofline
from llm_anatomy.calculator.timing.kernels import kernels as step_kernels
from llm_anatomy.calculator.timing.kernels_fields import masked_layers
from llm_anatomy.calculator.timing.profile import check_measured
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.hf_config import from_hf_config
from validations.test_gptoss_attention import attention_configs

HF = Path(__file__).parent / "data" / "hf_configs"
GPTOSS = from_hf_config(HF / "gpt-oss-20b")
OLMOE = from_hf_config(HF / "OLMoE-1B-7B-0924")
# fake rows (not measurements): gpt-oss's calls at hd 64 + 8 over S + 1 keys, hd 128 + 8, and a window's hd 64
FAKE_MASKED = [dict(B=4096 // S, heads=64, kv_heads=8, S=S, keys=S + 1, hd=64, pad=8, fwd_ms=0.5 * S / 1024,
                    fwd_bwd_ms=1.6 * S / 1024) for S in (1024, 2048, 4096)] + \
              [dict(B=2, heads=32, kv_heads=8, S=2048, keys=2049, hd=128, pad=8, fwd_ms=0.9, fwd_bwd_ms=2.9),
               dict(B=2, heads=64, kv_heads=8, S=2048, keys=2048, hd=64, pad=0, fwd_ms=0.45, fwd_bwd_ms=1.4)]


def _calc_sdpa(k, S: int, hd: int) -> int:
    """One SDPA entry's FLOPs per launch in the calculator's convention (4 B nh S² hd forward, 2.5x backward)."""
    B, nh, _, wd = k.shape
    if k.backend == roofline.MASKED:
        keys = S + (wd != hd)  # the sinks' call: one key more, pad columns wider
        assert k.flops * S * hd % (keys * wd) == 0
        return k.flops * S * hd // (keys * wd)
    return 2 * k.flops


def _check_flops(cfg: ModelConfig, run: Run, variant: str) -> None:
    """Every component's but the MoE block's (its grouped GEMMs also compute their tiles' empty rows:
    test_moe_memory_time.py checks them where the rows fill whole tiles)."""
    comps = estimate(cfg, run, variant, "cuda").to_dict()["components"]
    want = sum(v["flops"]["counter"][ph] for name, v in comps.items() if name != "moe" and "flops" in v
               for ph in ("forward", "backward"))
    ks = [k for k in step_kernels(cfg, run, variant, optimizer=None) if k.component != "moe"]
    mm = sum(k.flops * k.count for k in ks if k.kind == "matmul")
    sdpa = [k for k in ks if k.kind == "sdpa"]
    assert variant == "efficient" or not sdpa
    got = mm + sum(_calc_sdpa(k, run.seq, cfg.head_dim) * k.count for k in sdpa)
    assert got == want
    masked = sum(k.count for k in sdpa if k.backend == roofline.MASKED and k.phase == "forward")
    assert masked == (masked_layers(cfg) if variant == "efficient" else 0)
    for k in sdpa:
        if k.backend == roofline.MASKED and not k.op_phase:
            wd, keys = k.shape[3], run.seq + cfg.attn_sinks
            assert k.flops == (4 if k.phase == "forward" else 10) * run.batch * cfg.heads * run.seq * keys * wd


@pytest.mark.parametrize("cfg", [replace(GPTOSS, layers=2), GPTOSS, replace(OLMOE, layers=2)],
                         ids=["gptoss-L2", "gptoss-L24", "olmoe-L2"])
@pytest.mark.parametrize("variant, recompute", [("baseline", "none"), ("efficient", "none"), ("efficient", "mlp"),
                                                ("efficient", "full")])
def test_flops_of_the_real_families(cfg, variant, recompute):
    _check_flops(cfg, Run(2, 2048, "amp", recompute), variant)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(cfg=attention_configs(), seq=st.sampled_from([64, 128, 384]), recompute=st.sampled_from(["none", "mlp", "full"]),
       lean=st.booleans())
def test_flops_of_drawn_configs(cfg, seq, recompute, lean):
    """20 drawn configs (sinks, windows, o bias, q/k norms per head or whole, GQA): both variants' lists."""
    _check_flops(cfg, Run(2, seq, "amp"), "baseline")
    _check_flops(cfg, Run(2, seq, "amp", recompute, lean=lean), "efficient")


def _measured(rows=FAKE_MASKED) -> dict:
    data = json.loads(records.H200_PROFILE.read_text())
    data["measurements"]["attention_masked"] = copy.deepcopy(rows)
    return data


def test_masked_rows_round_trip():
    prof = fit.from_measured(check_measured(_measured(), "fake.json"))
    sms = prof.sms
    for r in FAKE_MASKED:
        wd = r["hd"] + r["pad"]
        f = 4 * r["B"] * r["heads"] * r["S"] * r["keys"] * wd
        eff = roofline.attention_wave_efficiency(r["B"], r["heads"], r["S"], sms)
        got = prof.attention_masked[str(wd)]["seq"][str(r["S"])]
        assert got["fwd"] == pytest.approx(f / (r["fwd_ms"] * 1e-3) / eff, rel=1e-12)
        assert got["fwd_bwd"] == pytest.approx(3.5 * f / (r["fwd_bwd_ms"] * 1e-3) / eff, rel=1e-12)
    assert prof.attention_masked["72"]["fwd"] == prof.attention_masked["72"]["seq"]["4096"]["fwd"]  # the longest S
    assert "hd64+8 S2048" in prof.sources["attention_masked"]


@pytest.mark.parametrize("field, value, says", [
    ("keys", 2050, "keys must be S or S + 1"), ("pad", 8.0, "pad must be an integer"),
    ("kv_heads", 7, "kv_heads must be a divisor of heads"), ("fwd_ms", 0, "fwd_ms must be a finite number > 0"),
    ("hd", None, "hd must be an integer > 0")])
def test_bad_masked_rows_refused_in_one_line(field, value, says):
    rows = copy.deepcopy(FAKE_MASKED)
    rows[1][field] = value
    with pytest.raises(ConfigError) as e:
        check_measured(_measured(rows), "fake.json")
    msg = str(e.value)
    assert "\n" not in msg and f"measurements.attention_masked[1].{says.split()[0]}" in msg and says.split(" must")[1] \
        in msg


def without_field_rows(tmp_path) -> str:
    """The packaged H200 calibration less the rows its supplement added (masked SDPA, the sinks' S x S ops), as
    a profile file: what a calibration taken before those rows existed gives."""
    doc = json.loads((lookup.PROFILE_DIR / "h200.json").read_text())
    m = doc["measurements"]
    m.pop("attention_masked")
    m["fused"] = [r for r in m["fused"] if not r["op"].startswith("sxs.sink_")]
    path = tmp_path / "h200-without-field-rows.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_without_rows_a_measured_profile_refuses_a_datasheet_one_states(tmp_path):
    run = Run(2, 2048, "amp")
    cfg = replace(GPTOSS, layers=2)
    bare = without_field_rows(tmp_path)
    with pytest.raises(ConfigError, match="no masked-attention calibration") as e:
        estimate_time(cfg, run, "efficient", bare, with_kernels=False)
    assert "\n" not in str(e.value) and "attention_masked" in str(e.value)
    for gpu in ("h200-measured", "h100-sxm"):  # the packaged calibration, supplemented; a profile derived from it
        assert estimate_time(cfg, run, "efficient", gpu, with_kernels=False)["gpu_s"] > 0
    res = estimate_time(cfg, run, "efficient", "h200-sxm")
    k = next(k for k in res["kernels"] if k["name"] == "attention.sdpa_masked")
    assert "bf16 matmul rate" in k["note"]
    assert "bf16 peak" in lookup.get("h200-sxm").sources["attention_masked"]
    # the baseline runs no SDPA, but its sinks' unaligned S x S ops need rows of their own: a calibration without
    # them refuses in one line naming the op; the datasheet prices them at the copy rate
    with pytest.raises(ConfigError, match="no calibration of sxs.sink_") as e:
        estimate_time(cfg, run, "baseline", bare, with_kernels=False)
    assert "\n" not in str(e.value)
    assert estimate_time(cfg, run, "baseline", "h200-sxm", with_kernels=False)["gpu_s"] > 0
    with pytest.raises(ConfigError, match="on cuDNN only"):
        step_kernels(cfg, run, "efficient", "flash")


def test_estimate_command_refuses_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--hf-config", str(HF / "gpt-oss-20b"),
                        "--gpu", without_field_rows(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "attention_masked" in p.stderr, p.stderr


def test_masked_entry_priced_at_its_rate_and_derived_by_the_peak_ratio():
    prof = fit.from_measured(check_measured(_measured(), "fake.json"))
    cfg, run = replace(GPTOSS, layers=2), Run(2, 2048, "amp")
    res = estimate_time(cfg, run, "efficient", prof)
    k = next(k for k in step_kernels(cfg, run, "efficient") if k.name == "attention.sdpa_masked")
    B, nh, S, wd = k.shape
    assert wd == 72 and S == 2048
    rate = prof.attention_masked["72"]["seq"]["2048"]["fwd"] * roofline.attention_wave_efficiency(B, nh, S, prof.sms)
    t_c, _, cls, got, note = roofline.kernel_terms(k, prof)
    assert cls == "attention" and got == pytest.approx(rate, rel=1e-12) and t_c == pytest.approx(k.flops / rate)
    assert note == "cudnn-masked hd72"
    assert res["gpu_s"] > 0
    # a derived profile: each masked rate x the causal rates' factor (the bf16 peak ratio, under the roof)
    d = derived.derive("h100-sxm", "point", prof)
    att = d.attention["cudnn"]["64"]["fwd"] / prof.attention["cudnn"]["64"]["fwd"]
    for hd, t in prof.attention_masked.items():
        assert d.attention_masked[hd]["fwd"] == pytest.approx(t["fwd"] * att, rel=1e-12)
        assert d.attention_masked[hd]["seq"]["1024" if hd == "72" else "2048"]["fwd_bwd"] == pytest.approx(
            t["seq"]["1024" if hd == "72" else "2048"]["fwd_bwd"] * att, rel=1e-12)
    assert "bf16 peak ratio" in d.sources["attention_masked"]
    assert estimate_time(cfg, run, "efficient", d, with_kernels=False)["gpu_s"] > res["gpu_s"]  # an H100 is slower


@pytest.mark.parametrize("rows", [FAKE_MASKED, []], ids=["rows", "none"])
def test_calibrate_stores_the_masked_rows_or_says_none(rows, tmp_path, monkeypatch, capsys):
    """`anatomy calibrate` (every measurement faked) writes the masked rows under measurements.attention_masked and
    the profile fits them; with none timed it warns, and records the drop in the provenance."""
    from llm_anatomy.measure import calibrate, calibrate_host
    from validations.test_calibrate_host import _fake_calibrate, _fake_measurements

    hs = dict(calibrate_host.HOST_STEP, efficient=dict(forward_backward_ms=9.0), baseline=dict(forward_backward_ms=7.0))
    _fake_calibrate(monkeypatch, dict(_fake_measurements(), attention_masked=rows), hs)
    out = tmp_path / "h200.json"
    assert calibrate.main(["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    prof = lookup.load(out)
    assert data["measurements"]["attention_masked"] == rows
    assert sorted(prof.attention_masked) == sorted({str(r["hd"] + r["pad"]) for r in rows})
    said = any("attention_masked" in d for d in data["provenance"]["dropped"])
    assert said == (not rows) and said == ("WARNING: attention_masked" in capsys.readouterr().err)


def test_baseline_sink_ops_take_their_calibrated_rates():
    """Fake timings (not a measurement) of the S x S ops, each at its own fraction of the copy bandwidth
    (test_calibrate.SXS_FRAC): with sinks the baseline's cat, both casts of the strided [..., :S] slice and the
    slice's backward copy take their own ops' rates, the softmax and its backward (over S + 1) theirs."""
    from validations.test_calibrate import SXS_FRAC, _kernel, sxs_profiles

    p, p0 = sxs_profiles()
    cfg = ModelConfig(name="b", hidden=1024, layers=2, heads=8, intermediate=2816, vocab=32000, attn_sinks=True)
    a, b = (estimate_time(cfg, Run(2, 2048), "baseline", q, with_kernels=True) for q in (p, p0))
    of = {"attention.sinks_cat": "sxs.sink_cat", "attention.to_compute": "sxs.sink_slice_cast",
          "attention.float.backward": "sxs.sink_slice_cast", "attention.sinks_slice.backward_copy": "sxs.sink_slice_backward",
          "attention.softmax": "sxs.softmax", "attention.softmax.backward": "sxs.softmax.backward",
          "attention.float": "sxs.float"}
    for name, op in of.items():
        assert _kernel(a, name)["memory_s"] == pytest.approx(_kernel(b, name)["memory_s"] / SXS_FRAC[op], rel=1e-3), name
