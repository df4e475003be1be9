"""GPU profiles (llm_anatomy/calculator/timing/profile.py, lookup.py, fit.py) and the one GPU table
(llm_anatomy/calculator/gpus.py): lookup, sources, the packaged calibration, and strict loading of profile files."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from llm_anatomy import records
from llm_anatomy.calculator import gpus, timing
from llm_anatomy.config import ConfigError, ModelConfig, Run

SEED, SEED_RUN = ModelConfig.from_name("seed"), Run(16, 4096, "amp")


def test_calculator_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from llm_anatomy.calculator import timing, gpus\n"
            "from llm_anatomy.config import ModelConfig, Run\n"
            "timing.estimate_time(ModelConfig.from_name('seed'), Run(2, 256), 'efficient', 'h200-measured')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", ["H200", "h200-sxm", "NVIDIA H200", "h200_SXM", " h200 "])
def test_lookup_is_case_insensitive(name):
    assert timing.get(name)["name"] == "h200-sxm"


@pytest.mark.parametrize("name", ["h200-measured", "H200-Measured", "h200:measured"])
def test_measured_lookup(name):
    p = timing.get(name)
    assert p["name"] == "h200-measured" and p["kind"] == "measured"


def test_unknown_gpu_is_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        timing.get("tpu-v5")
    assert "\n" not in str(e.value) and "tpu-v5" in str(e.value)
    with pytest.raises(ConfigError):
        timing.estimate_time(SEED, SEED_RUN, "efficient", "b300")


@pytest.mark.parametrize("name", sorted(gpus.GPUS))
def test_datasheet_profiles_carry_sources(name):
    p = timing.get(f"{name}-datasheet")
    assert p["kind"] == "datasheet" and p["sms"] > 0 and p["hbm_Bps"] > 0
    assert p["peak_flops"]["bfloat16"] > p["peak_flops"]["float32"] > 0
    for key in ("peak_flops", "hbm_Bps", "sms"):
        assert "https://" in p["sources"][key], (name, key)
    for key in ("launch_s", "host_op_s"):  # unmeasured: must say it is an assumption
        assert "assumption" in p["sources"][key]


def test_datasheet_figures():
    """Dense (no 2:4 sparsity) bf16 with fp32 accumulate, and HBM bandwidth, as the sources print them."""
    got = {n: (timing.get(f"{n}-datasheet")["peak_flops"]["bfloat16"] / 1e12, timing.get(f"{n}-datasheet")["hbm_Bps"] / 1e9)
           for n in gpus.GPUS}
    assert got == {"a100-40gb-sxm": (312.0, 1555.0), "a100-80gb-sxm": (312.0, 2039.0), "h100-sxm": (989.4, 3350.0),
                   "h200-sxm": (989.4, 4800.0), "rtx-3090": (71.0, 936.0), "rtx-4090": (165.2, 1008.0),
                   "h100-pcie": (756.5, 2000.0), "l40s": (362.05, 864.0), "l4": (121.0, 300.0), "b200": (2250.0, 8000.0)}


@pytest.mark.parametrize("device_name, profile", [
    ("NVIDIA H200", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA B200", "b200"), ("Tesla T4", None)])
def test_device_names_map_to_one_datasheet_table(device_name, profile):
    """torch's device names pick a datasheet profile (first match wins: "H100 PCIe" before "H100",
    "L40S" before "L4"); `anatomy train`'s MFU reads its peak from the same table."""
    p = gpus.for_device_name(device_name)
    assert (p and p["name"]) == profile


def test_committed_h200_profile_is_a_calibration():
    """The packaged `h200-measured` profile is an `anatomy calibrate` output of a fresh H200, with its
    provenance and its measured sustained regime; every figure the datasheet had is replaced by a measurement, and the
    attention table reproduces the SDPA rows it measured at their own shapes (a round trip, not a
    prediction)."""
    committed = records.H200_PROFILE
    p = timing.get("h200-measured")
    assert p["provenance"]["command"].startswith("anatomy calibrate") and p["provenance"]["gpu"] == "NVIDIA H200"
    for key in ("date", "torch", "cuda", "triton", "cudnn"):
        assert p["provenance"][key]
    for key in ("matmul_flops", "hbm_Bps", "launch_s", "host_op_s", "host_custom_s", "attention", "mfu_peak_flops"):
        assert p["sources"][key].startswith("measured"), key
    assert p["matmul_k_half"] > 0 and set(p["host_custom_s"]) >= {"rms_norm", "swiglu", "rope_qkv", "liger_ce"}
    assert "sustained" in json.loads(committed.read_text())["measurements"]
    assert p["sources"]["sustained_ratio"].startswith("measured") and 0.5 < p["sustained_ratio"]["matmul"] < 1
    from llm_anatomy.measure.calibrate_aten import SXS_OPS, SXS_SEQS
    from llm_anatomy.measure.calibrate_kernels import LIGER_VOCABS

    fused = {(r["op"], r["width"]) for r in p["fused_rows"]}
    # the sinks' S x S ops (sxs.sink_*) are not in the packaged calibration: it prices them at the copy bandwidth
    ops = [op for op in SXS_OPS if not op.startswith("sxs.sink_")]
    assert {(op, S) for op in ops for S in SXS_SEQS} <= fused and {("liger_ce", V) for V in LIGER_VOCABS} <= fused
    m = json.loads(committed.read_text())["measurements"]
    for row in m["attention"]:
        if row["S"] != 4096 or row["backend"] in p["sdpa_schedule"]:  # those are timed by their schedule, below
            continue
        ks = [k for k in timing.efficient_kernels(ModelConfig(name="a", hidden=row["heads"] * row["hd"], layers=1,
                                                              heads=row["heads"], intermediate=256, vocab=256),
                                                  Run(row["B"], row["S"], "amp"), row["backend"]) if k.kind == "sdpa"]
        t = {k.phase: timing.time_kernel(k, p) for k in ks}
        per = {ph: (r["compute_s"] / r["count"]) * 1e3 for ph, r in t.items()}
        assert per["forward"] == pytest.approx(row["fwd_ms"], rel=1e-9)
        assert per["forward"] + per["backward"] == pytest.approx(row["fwd_bwd_ms"], rel=1e-9)
    # cuDNN's CTA schedule holds every main-kernel duration it was fitted to within 5%
    from llm_anatomy.measure.calibrate_sdpa import schedule_shapes

    assert {(r["B"], r["heads"], r["S"], r["hd"]) for r in m["attention_kernels"]} == set(schedule_shapes())
    assert all(e["max_error"] < 0.05 for e in p["sdpa_schedule"]["cudnn"].values())


def test_one_gpu_table_serves_timing_and_comm():
    """Links live in the same table as the datasheet peaks: comm reads them (PCIe for a part without
    NVLink), and an unknown GPU is a one-line error there."""
    from llm_anatomy.calculator import comm

    assert gpus.entry("H200")["nvlink_GBps"] == 450.0 and gpus.entry("a100-40gb")["nvlink_GBps"] == 300.0
    assert gpus.entry("rtx-4090")["nvlink_GBps"] is None
    assert comm.collective_time("all_reduce", 2**30, 8, "h200") == comm.collective_time("all_reduce", 2**30, 8, "h200-sxm")
    assert comm.link("rtx-4090", 8)["name"] == "pcie" and comm.link("h100", 16)["name"] == "ib (across nodes)"
    with pytest.raises(ConfigError) as e:
        comm.collective_time("all_reduce", 2**30, 8, "tpu-v5")
    assert "\n" not in str(e.value)


def test_profile_fields_name_their_unit_and_calibration():
    """Every field of a measured profile that a calibration fills says where its figure comes from."""
    p = timing.get("h200-measured")
    for key in ("matmul_flops", "matmul_k_half", "hbm_Bps", "launch_s", "kernel_gap_s", "host_op_s", "host_custom_s",
                "host_step", "attention", "sdpa_schedule", "fused_rows", "matmul_misaligned", "mfu_peak_flops",
                "sustained_ratio", "sustained_tau_s", "clocks"):
        assert p.sources.get(key), key
    assert isinstance(p, timing.Profile) and dict(p)["name"] == "h200-measured"


def _write(tmp_path, data, raw: bytes | None = None):
    f = tmp_path / "p.json"
    f.write_bytes(raw if raw is not None else json.dumps(data).encode())
    return f


def _valid() -> dict:
    return json.loads(records.H200_PROFILE.read_text())


@pytest.mark.parametrize("case", ["not-utf8", "not-json", "list", "no-measurements", "nan", "infinity", "string-rate",
                                  "bool-rate", "negative", "base-self", "base-path", "row-missing", "row-string",
                                  "host-step-nan", "empty-path"])
def test_bad_profile_files_are_one_line_errors_naming_file_and_field(tmp_path, case):
    d = _valid()
    m = d["measurements"]
    raw = None
    if case == "not-utf8":
        raw = b'{"measurements": {"copy_tbps": "\xff\xfe"}}'.replace(b"\\xff\\xfe", b"\xff\xfe")
    elif case == "not-json":
        raw = b"{not json"
    elif case == "list":
        d = [d]
    elif case == "no-measurements":
        del d["measurements"]
    elif case == "nan":
        raw = json.dumps(d).replace('"copy_tbps": ' + json.dumps(m["copy_tbps"]), '"copy_tbps": NaN').encode()
    elif case == "infinity":
        m["matmul_bf16"][0]["tflops"] = math.inf
        raw = json.dumps(d).encode()
    elif case == "string-rate":
        m["launch_us"] = "fast"
    elif case == "bool-rate":
        m["host_op_us"] = True
    elif case == "negative":
        m["copy_tbps"] = -1.0
    elif case == "base-self":
        d["base"] = "h200-measured"
    elif case == "base-path":
        d["base"] = str(tmp_path / "p.json")
    elif case == "row-missing":
        del m["fused"][3]["ms"]
    elif case == "row-string":
        m["attention"][0]["S"] = "4096"
    elif case == "host-step-nan":
        m["host_step"]["efficient"]["forward_backward_ms"] = -3.0
    path = str(_write(tmp_path, d, raw)) if case != "empty-path" else ""
    with pytest.raises(ConfigError) as e:
        timing.get(path)
    msg = str(e.value)
    assert "\n" not in msg and (case == "empty-path" or "p.json" in msg), msg
    field = {"nan": "copy_tbps", "infinity": "tflops", "string-rate": "launch_us", "bool-rate": "host_op_us",
             "negative": "copy_tbps", "base-self": "base", "base-path": "base", "row-missing": "fused[3].ms",
             "row-string": "attention[0].S", "host-step-nan": "host_step", "no-measurements": "measurements"}
    assert field.get(case, "") in msg, msg


def test_a_profile_file_is_read_once_per_version(tmp_path):
    path = tmp_path / "h200.json"
    path.write_bytes(records.H200_PROFILE.read_bytes())
    a, b = timing.get(str(path)), timing.get(str(path))
    assert a is b
    d = _valid()
    d["measurements"]["copy_tbps"] = 1.0
    path.write_text(json.dumps(d))
    assert timing.get(str(path)).hbm_Bps == 1e12


def test_estimate_cli_refuses_a_bad_profile_in_one_line(tmp_path):
    bad = _write(tmp_path, dict(base="h200-sxm", measurements=dict(copy_tbps=None)), b'{"base": "h200-sxm", "measurements": {"copy_tbps": NaN}}')
    r = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--preset", "seed", "--gpu", str(bad)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "copy_tbps" in r.stderr, r.stderr


def test_calibrate_writes_to_the_user_cache_and_reads_back_as_calibrated(tmp_path, monkeypatch):
    """`anatomy calibrate` never writes into the installed package: its default is the user's cache, and
    `--gpu <stem>-calibrated` reads that file back; `<stem>-measured` stays the committed profile."""
    import shutil

    from llm_anatomy import records
    from llm_anatomy.calculator.timing import lookup
    from llm_anatomy.measure.calibrate import default_out

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = default_out("h200-sxm")
    assert out == tmp_path / "anatomy" / "profiles" / "h200.json"
    assert lookup.PROFILE_DIR not in out.parents
    out.parent.mkdir(parents=True)
    shutil.copy(records.H200_PROFILE, out)
    lookup.measured_files.cache_clear()
    try:
        assert lookup.get("h200-calibrated").name == lookup.get("h200-measured").name
        assert lookup.measured_files()["h200-calibrated"] == out
        assert lookup.measured_files()["h200-measured"] == records.H200_PROFILE
    finally:
        lookup.measured_files.cache_clear()


@pytest.mark.gpu
@pytest.mark.slow  # holds the GPU under load for its warm-up and trace (~10 s)
def test_sustained_regime_measures_on_this_gpu():
    """calibrate_sustained on the GPU at hand (a short warm-up): both regimes' rates are positive, the copy
    barely follows the SM clock, a sustained compute rate is not above its burst rate by more than noise,
    and the result is a valid measurements.sustained (the profile's strict check)."""
    from llm_anatomy.calculator.timing import fit
    from llm_anatomy.calculator.timing import profile as prof_mod
    from llm_anatomy.measure.calibrate_sustained import measure_sustained

    s = measure_sustained(warmup_s=4.0)
    prof_mod._check_sustained("this GPU", s)
    f = fit.sustained_fields(s)
    assert 0.9 <= f["sustained_ratio"]["memory"] <= 1.05, f
    assert f["sustained_ratio"]["matmul"] <= 1.03 and f["sustained_ratio"]["attention"] <= 1.05, (f, s["burst"],
                                                                                                 s["sustained"])
    assert f["sustained_tau_s"] > 0 and len(s["trace"]) >= 10
