"""scripts/supplement_profile.py: a later calibration's rows of the classes the packaged profile never measured
(grouped GEMMs, masked SDPA, the baseline sinks' ops) join it, and nothing a dense step reads changes.

The "later calibration" here is the packaged profile itself with those classes given synthetic rows: what is
checked is which rows move and what a prediction reads after, not any GPU's speed.
"""
from __future__ import annotations

import json

import pytest

from llm_anatomy.calculator.timing import estimate_time, get
from llm_anatomy.config import ModelConfig, Run
from scripts.supplement_profile import INTO, main, supplement

# the packaged profile without the supplementable classes (it may carry them already)
PACKAGED = json.loads(INTO.read_text())
for _k in ("grouped_mm", "attention_masked"):
    PACKAGED["measurements"].pop(_k, None)
PACKAGED["measurements"]["fused"] = [r for r in PACKAGED["measurements"]["fused"]
                                    if not r["op"].startswith("sxs.sink_")]
PACKAGED["provenance"].pop("supplements", None)
DENSE = [("llama3.2-1b", Run(4, 2048)), ("seed", Run(2, 1024, "amp"))]


def _later(packaged: dict, **prov) -> dict:
    """A calibration of the same GPU and versions holding every supplementable class."""
    cal = json.loads(json.dumps(packaged))
    cal["provenance"].update(date="2026-12-06 00:00:00 UTC", command="anatomy calibrate --out p.json", **prov)
    m = cal["measurements"]
    m["grouped_mm"] = [dict(family="f", routing="balanced", proj="gate_up", rows=[256] * 8, n=1024, k=2048,
                            role=role, ms=ms, queued=True) for role, ms in (("forward", 0.05), ("backward", 0.11))]
    m["attention_masked"] = [dict(r, pad=8, keys=r["S"] + 1) for r in _masked_rows()]
    like = next(r for r in m["fused"] if r["op"] == "sxs.float")
    m["fused"] = m["fused"] + [dict(like, op=op) for op in ("sxs.sink_cat", "sxs.sink_slice_cast")]
    return {"key": {"gpu": cal["provenance"]["gpu"]}, "profile": cal}


def _masked_rows() -> list[dict]:
    return [dict(B=1, heads=64, kv_heads=8, S=s, hd=64, fwd_ms=0.1 * s / 1024, fwd_bwd_ms=0.4 * s / 1024)
            for s in (1024, 2048, 4096)]


def test_only_the_missing_classes_join_and_the_provenance_says_whence():
    cal = _later(PACKAGED)
    out, taken = supplement(PACKAGED, cal)
    m, pm = out["measurements"], PACKAGED["measurements"]
    assert [t.split(" ")[0] for t in taken] == ["grouped_mm", "attention_masked", "fused"]
    assert m["grouped_mm"] == cal["profile"]["measurements"]["grouped_mm"]
    assert m["fused"][:len(pm["fused"])] == pm["fused"]  # every packaged row kept, in order
    assert {r["op"] for r in m["fused"][len(pm["fused"]):]} == {"sxs.sink_cat", "sxs.sink_slice_cast"}
    assert {k: v for k, v in m.items() if k not in ("grouped_mm", "attention_masked", "fused")} == \
        {k: v for k, v in pm.items() if k not in ("grouped_mm", "attention_masked", "fused")}
    (sup,) = out["provenance"]["supplements"]
    assert sup["date"] == "2026-12-06 00:00:00 UTC" and sup["rows"] == taken
    assert sup["command"].startswith("anatomy calibrate (the GPU suite's")  # a cache file's command, no machine path
    with pytest.raises(ValueError, match="already has"):  # a second pass adds nothing: it never replaces
        supplement(out, cal)


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H100 80GB HBM3"), ("torch", "2.12.0+cu130")])
def test_another_gpu_or_version_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        supplement(PACKAGED, _later(PACKAGED, **{field: value}))


@pytest.mark.parametrize("name,run", DENSE, ids=[n for n, _ in DENSE])
def test_a_dense_step_predicts_the_same_after(name, run):
    out, _ = supplement(PACKAGED, _later(PACKAGED))
    cfg = ModelConfig.from_name(name)
    for variant in ("baseline", "efficient"):
        before = estimate_time(cfg, run, variant, get(PACKAGED), optimizer="adamw", with_kernels=False)
        after = estimate_time(cfg, run, variant, get(out), optimizer="adamw", with_kernels=False)
        assert after["steady"]["step_s"] == before["steady"]["step_s"] and after["gpu_s"] == before["gpu_s"]


def test_the_command_writes_a_profile_that_loads_and_refuses_in_one_line(tmp_path, capsys):
    into, cal = tmp_path / "h200.json", tmp_path / "cal.json"
    into.write_text(json.dumps(PACKAGED))
    cal.write_text(json.dumps(_later(PACKAGED)))
    assert main([str(cal), "--into", str(into)]) == 0
    assert get(json.loads(into.read_text())).grouped_mm
    assert main([str(cal), "--into", str(into)]) == 2  # nothing left to take
    err = capsys.readouterr().err.strip()
    assert err.startswith("supplement_profile: error:") and "\n" not in err
    cal.write_text("[1, 2]")  # JSON, but no calibration
    assert main([str(cal), "--into", str(into)]) == 2
    assert "not a calibration" in capsys.readouterr().err
