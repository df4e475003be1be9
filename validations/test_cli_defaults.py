"""The CLI's defaults: one default variant (the efficient one with its lean block where it applies) said in every
output; GPU names with aliases, a refused ambiguous name and the closest matches for an unknown one; `anatomy plan`'s
no-fit advice, each suggestion confirmed by the planner; a measurement that cannot fit refused in seconds."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest

from llm_anatomy.calculator import gpus
from llm_anatomy.calculator.memory import phases
from llm_anatomy.cli import main
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.plan_cli import main as plan_main

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "96", "--vocab", "128",
        "--batch", "2", "--seq", "16"]


def _run(fn, argv, capsys):
    """fn(argv) in this process: (exit code, stdout, stderr)."""
    try:
        rc = fn(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _peak(cfg, run, variant) -> int:
    ph = phases(cfg, run, variant, optimizer="adamw", device="cuda")
    return max(ph["forward_peak"] or 0, ph["backward_peak"])


# ---- one default variant, said ----------------------------------------------------------------------
def test_estimate_llama3_8b_without_flags_is_the_efficient_lean_variant_and_says_so(capsys):
    cfg = ModelConfig.from_name("llama3-8b")
    rc, out, err = _run(main, ["estimate", "--preset", "llama3-8b", "--json"], capsys)
    e = json.loads(out)
    assert rc == 0 and err == ""
    assert e["variant"] == "efficient" and e["lean"] is True and e["run"]["lean"] is True
    assert e["defaults"] == dict(batch=16, seq=4096, variant="efficient", lean=True)
    lean, plain = _peak(cfg, Run(lean=True), "efficient"), _peak(cfg, Run(), "efficient")
    assert e["memory"]["need_bytes"] == lean < plain  # the lean block's figures, smaller than the plain block's
    rc, out, _ = _run(main, ["estimate", "--preset", "llama3-8b"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "llama3-8b · efficient · B=16 S=4096 amp · lean block" in text
    assert "defaults taken: variant efficient with the lean block, batch 16, seq 4,096" in text


def test_no_lean_and_baseline_are_the_other_models_and_given_flags_are_no_defaults(capsys):
    cfg = ModelConfig.from_name("seed")
    rc, out, _ = _run(main, ["estimate", "--no-lean", "--batch", "2", "--seq", "256", "--json"], capsys)
    e = json.loads(out)
    assert rc == 0 and e["lean"] is False and "lean" not in e["run"]
    assert e["memory"]["need_bytes"] == _peak(cfg, Run(2, 256), "efficient")
    assert e["defaults"] == dict(variant="efficient", lean=False)
    rc, out, _ = _run(main, ["estimate", "--variant", "baseline", "--batch", "2", "--seq", "256", "--json"], capsys)
    e = json.loads(out)
    assert rc == 0 and e["variant"] == "baseline" and e["lean"] is False and e["defaults"] == {}
    assert e["memory"]["need_bytes"] == _peak(cfg, Run(2, 256), "baseline")
    rc, out, _ = _run(main, ["estimate", "--variant", "baseline", "--batch", "2", "--seq", "256"], capsys)
    assert rc == 0 and "defaults taken" not in out


def test_where_the_lean_block_does_not_apply_the_plain_one_runs_and_a_note_says_so(capsys):
    cfg = ModelConfig.from_name("seed")
    rc, out, err = _run(main, ["estimate", "--recompute", "mlp", "--batch", "2", "--json"], capsys)
    e = json.loads(out)
    assert rc == 0 and e["lean"] is False and e["run"]["recompute"] == "mlp"
    assert e["memory"]["need_bytes"] == _peak(cfg, Run(2, recompute="mlp"), "efficient")
    assert err.count("\n") == 1 and "note: the lean block applies without recompute only" in err
    rc, _, err = _run(main, ["estimate", "--variant", "baseline", "--lean"], capsys)
    assert rc == 2 and "--lean is an option of the efficient variant" in err and err.count("\n") == 1


def test_measure_and_compare_default_to_the_lean_block_exactly(capsys):
    rc, out, _ = _run(main, ["compare", *TINY, "--device", "cpu", "--json"], capsys)
    c = json.loads(out)
    assert rc == 0 and c["variant"] == "efficient" and c["lean"] is True and c["run"]["lean"] is True
    assert c["defaults"] == dict(variant="efficient", lean=True)
    assert all(r["predicted"] == r["measured"] for r in c["rows"]), c["rows"]
    rc, out, _ = _run(main, ["measure", *TINY, "--device", "cpu"], capsys)
    assert rc == 0 and "efficient · lean block · measured on cpu" in " ".join(out.split())


def test_plan_sweep_and_forensics_default_to_the_lean_block(capsys, tmp_path):
    rc, out, _ = _run(plan_main, ["--preset", "seed", "--gpu", "H200", "--json"], capsys)
    p = json.loads(out)
    assert rc == 0 and p["variant"] == "efficient" and p["lean"] is True
    assert p["defaults"] == dict(variant="efficient", seq=4096)
    assert [(c["recompute"], c["lean"]) for c in p["candidates"]] == [("none", True), ("mlp", False), ("full", False)]
    assert "--lean" in p["estimate_command"] or p["best"]["recompute"] != "none"
    rc, out, _ = _run(plan_main, ["--preset", "seed", "--gpu", "H200"], capsys)
    assert rc == 0 and "efficient variant (lean block where recompute is none)" in out and "none (lean)" in out
    assert "defaults taken: variant efficient, seq 4,096" in out

    from llm_anatomy.sweep import main as sweep_main

    rc, _, _ = _run(sweep_main, ["--preset", "seed", "--batch", "1", "--seq", "128", "--out", str(tmp_path / "s.json"),
                                 "--quiet", "--device", "cpu"], capsys)
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert rc == 0 and {(r["variant"], r["lean"]) for r in rows} == {("baseline", False), ("efficient", True)}

    from llm_anatomy.measure.forensics_cli import main as forensics_main

    rc, _, _ = _run(forensics_main, [*TINY, "--device", "cpu", "--png", str(tmp_path / "f.png")], capsys)
    rep = json.loads((tmp_path / "f.json").read_text())
    assert rc == 0 and rep["variant"] == "efficient" and rep["lean"] is True and "(lean block)" in rep["title"]
    assert rep["run"]["lean"] is True and rep["defaults"] == dict(variant="efficient", lean=True)


# ---- GPU names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, key", [
    ("H100-80GB", "h100-sxm"), ("H100 SXM", "h100-sxm"), ("h100_sxm", "h100-sxm"), ("H100SXM5", "h100-sxm"),
    ("H100 PCIe", "h100-pcie"), ("h100-pcie", "h100-pcie"), ("A100-40GB", "a100-40gb-sxm"),
    ("a100 80gb", "a100-80gb-sxm"), ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("B200", "b200"),
    ("nvidia b200", "b200"), ("L40S", "l40s"), ("l4", "l4"), ("RTX 4090", "rtx-4090"), ("3090", "rtx-3090"),
    ("H200", "h200-sxm"), ("h200-measured", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm")])
def test_gpu_aliases(name, key):
    assert gpus.base_key(name) == key
    assert name.endswith("measured") or gpus.entry(name)["name"] == key


def test_every_name_matches_without_case_spaces_or_dashes():
    for k, e in gpus.GPUS.items():
        for name in (k, e["display"], *(a for a, v in gpus.ALIASES.items() if v == k)):
            for form in (name.upper(), name.lower(), name.replace("-", " "), name.replace(" ", "-"),
                         name.replace("-", "").replace(" ", "_")):
                assert gpus.key(form) == k, form


def test_every_gpu_cites_its_figures_and_the_table_needs_no_torch():
    for e in gpus.GPUS.values():
        assert "https://" in e["source"] and e["sms_source"] and e["pcie_source"], e["name"]
        assert (e["nvlink_GBps"] is None) == (e["link_source"] is None), e["name"]
        cap, src = gpus.capacity_bytes(e["name"])
        assert 0 < cap < e["memory_GB"] * 2**30 and src, e["name"]  # allocatable: less than the memory fitted
    r = subprocess.run([sys.executable, "-c", "import sys, llm_anatomy.calculator.gpus as g; g.key('B200'); "
                                              "assert 'torch' not in sys.modules"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("cmd", [["estimate", "--preset", "seed"], ["plan", "--preset", "seed"]])
def test_an_ambiguous_gpu_is_refused_listing_the_parts(cmd, capsys):
    rc, _, err = _run(main, [*cmd, "--gpu", "A100"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "ambiguous" in err
    assert "a100-40gb-sxm" in err and "a100-80gb-sxm" in err


def test_h100_alone_is_resolved_by_a_rule_the_output_states(capsys):
    rc, out, _ = _run(main, ["plan", "--preset", "seed", "--gpu", "H100", "--json"], capsys)
    p = json.loads(out)
    assert rc == 0 and p["gpu_entry"] == "h100-sxm" and "SXM" in p["gpu_rule"]
    rc, out, _ = _run(main, ["plan", "--preset", "seed", "--gpu", "H100"], capsys)
    assert f"--gpu H100: {p['gpu_rule']}" in out
    rc, out, _ = _run(main, ["estimate", "--preset", "seed", "--batch", "1", "--gpu", "h100"], capsys)
    assert rc == 0 and p["gpu_rule"].split(";")[0] in " ".join(out.split())
    rc, out, _ = _run(main, ["plan", "--preset", "seed", "--gpu", "H100 SXM", "--json"], capsys)
    assert json.loads(out)["gpu_rule"] is None  # an exact name needs no rule


@pytest.mark.parametrize("name, close", [("H10", "h100"), ("B100", "b200"), ("h200-measrued", "h200-measured"),
                                         ("L40", "l40s"), ("rtx4080", "rtx4090")])
def test_an_unknown_gpu_lists_the_closest_names(name, close, capsys):
    for cmd in (["estimate", "--preset", "seed"], ["plan", "--preset", "seed"]):
        rc, _, err = _run(main, [*cmd, "--gpu", name], capsys)
        assert rc == 2 and err.count("\n") == 1 and "unknown gpu" in err and "closest: " in err, err
        listed = err.split("closest: ")[1].split(" (")[0].split(", ")
        assert gpus.fold(close) in [gpus.fold(x) for x in listed], err


def test_a_name_like_no_gpu_lists_the_table(capsys):
    rc, _, err = _run(main, ["estimate", "--preset", "seed", "--gpu", "Z9000"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "choose from" in err and "b200" in err


# ---- no-fit advice ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--preset", "llama3-8b", "--gpu", "H100", "--seq", "256"],  # the floor alone is over one H100
    ["--preset", "llama3.2-1b", "--gpu", "L4", "--seq", "32768", "--recompute", "none"],  # activations do not fit
])
def test_no_fit_advice_is_confirmed_by_the_planner(argv, capsys):
    rc, out, _ = _run(plan_main, [*argv, "--json"], capsys)
    p = json.loads(out)
    assert rc == 0 and p["best"] is None
    adv = p["advice"]
    assert adv["floor_fits"] == (adv["floor_bytes"] <= p["budget_bytes"]) and adv["suggestions"]
    for s in adv["suggestions"]:
        words = shlex.split(s["command"])
        assert words[:2] == ["anatomy", "plan"]
        rc, again, _ = _run(plan_main, [*words[2:], "--json"], capsys)
        again = json.loads(again)
        assert rc == 0 and again["best"] == s["best"] and again["best"]["fits"], s
        assert again["best"]["peak_bytes"] <= again["budget_bytes"]
    if "--gpus" not in argv and (n := next((s["changes"]["gpus_n"] for s in adv["suggestions"] if "gpus_n" in
                                            s["changes"]), None)):  # the fewest: one GPU fewer does not fit
        rc, fewer, _ = _run(plan_main, [*argv, "--gpus", str(n - 1), "--json"], capsys)
        assert rc == 0 and json.loads(fewer)["best"] is None
    rc, text, _ = _run(plan_main, argv, capsys)
    assert "what fits (each re-checked by this search):" in text
    assert all(s["command"] in text for s in adv["suggestions"])


def test_llama3_8b_on_one_h100_is_offered_two_gpus_and_bf16_not_a_shorter_seq(capsys):
    from llm_anatomy.calculator import param_count

    rc, out, _ = _run(plan_main, ["--preset", "llama3-8b", "--gpu", "H100", "--seq", "256", "--json"], capsys)
    adv = json.loads(out)["advice"]
    n = param_count(ModelConfig.from_name("llama3-8b"))
    # fp32 weights, fp32 gradients, AdamW's two fp32 moments: 16 B a parameter (each tensor rounded to 512 B)
    assert 16 * n <= adv["floor_bytes"] <= 16 * n + 4 * 512 * 300 and not adv["floor_fits"]
    changes = [s["changes"] for s in adv["suggestions"]]
    assert dict(gpus_n=2, strategies=None) in changes and dict(dtype="bf16") in changes
    assert not any("seq" in c for c in changes)


# ---- a measurement that cannot fit ------------------------------------------------------------------
def test_compare_at_a_million_tokens_is_refused_in_seconds(capsys, monkeypatch):
    """The full run and batch 1 are predicted first; nothing is built. 16 GiB available stands for this
    machine so that the refusal does not depend on the RAM of the machine the test runs on."""
    import llm_anatomy.sweep

    monkeypatch.setattr(llm_anatomy.sweep, "available_bytes", lambda device: 16 * 2**30)
    t0 = time.perf_counter()
    rc, _, err = _run(main, ["compare", "--preset", "seed", "--seq", "1000000", "--device", "cpu"], capsys)
    assert time.perf_counter() - t0 < 5, "the refusal is arithmetic: it takes no time"
    assert rc == 2 and err.count("\n") == 1 and "by prediction at batch 1 and seq 1,000,000" in err, err
    seq = int(err.split("(--seq ")[1].split(" fits")[0].replace(",", ""))
    monkeypatch.setattr(llm_anatomy.sweep, "available_bytes", lambda device: 16 * 2**30)
    from llm_anatomy.cli import _need_bytes, usable_bytes

    cfg, cap = ModelConfig.from_name("seed"), usable_bytes("cpu")[0]
    assert _need_bytes(cfg, Run(1, seq, lean=True), "efficient", "cpu") <= cap
    assert _need_bytes(cfg, Run(1, 2 * seq, lean=True), "efficient", "cpu") > cap


def test_the_refusal_answers_in_seconds_from_the_shell():
    """The command as a user types it, on this machine: one line and exit 2, in seconds (torch's import and
    arithmetic), before anything is built."""
    from llm_anatomy.cli import _need_bytes, usable_bytes

    if _need_bytes(ModelConfig.from_name("seed"), Run(1, 1_000_000, lean=True), "efficient", "cpu") <= \
            usable_bytes("cpu")[0]:
        pytest.skip("this machine has the RAM for a million-token measurement: it would run it")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "compare", "--preset", "seed", "--seq", "1000000",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "by prediction" in r.stderr
    assert time.perf_counter() - t0 < 60, "torch's import and arithmetic: seconds, not minutes"
