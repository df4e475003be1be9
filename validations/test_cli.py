"""The `anatomy` command: documented JSON keys, one-line errors with exit code 2, never a traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_anatomy.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "llm_anatomy.cli", *args], capture_output=True, text=True, timeout=300)


def _get(d, dotted):
    for k in dotted.split("."):
        d = d[k]
    return d


def test_estimate_json_keys_and_llama2_params(capsys):
    assert main(["estimate", "--preset", "llama2-7b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 6_738_415_616
    for key in ("flops.counter.forward", "flops.counter.backward", "flops.model.forward", "flops.model.backward",
                "memory.saved.total", "memory.saved.by_component.attention", "memory.saved.by_component.loss"):
        assert isinstance(_get(out, key), int), key


def test_fields_override_a_preset(capsys):
    assert main(["estimate", "--preset", "seed", "--layers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["layers"] == 2 and out["config"]["hidden"] == 512


@pytest.mark.parametrize("args, needle", [
    (["estimate", "--hidden", "500", "--heads", "8", "--layers", "2", "--intermediate", "64", "--vocab", "10"],
     "hidden=500"),
    (["estimate", "--hf-config", "/no/such/config.json"], "no Hugging Face config"),
    (["estimate", "--preset", "nope"], "unknown preset"),
    (["estimate", "--batch", "0"], "batch"),
    (["estimate", "--dtype", "fp16"], "dtype"),
    (["estimate", "--variant", "turbo"], "variant"),
    (["estimate", "--hidden", "64"], "without --preset"),
    (["estimate", "--no-such-flag"], "unrecognized"),
    (["report", "/no/such/claims.json"], "No such file"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_compare_small_config_is_exact(variant):
    r = _run("compare", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "96",
             "--vocab", "128", "--batch", "2", "--seq", "16", "--variant", variant, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert len(rows) == 9 and all(row["predicted"] == row["measured"] for row in rows), rows


def test_estimate_gpu_gives_step_time_without_a_gpu(capsys):
    """`anatomy estimate --gpu H200` predicts the step from the datasheet profile on a machine with no
    GPU: the training loop's step (steps back to back) and bench/step.py's isolated step, both positive,
    the back-to-back step no longer than the isolated one, and the text line names both."""
    assert main(["estimate", "--preset", "seed", "--batch", "4", "--seq", "1024", "--gpu", "H200", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["time"]
    assert t["gpu"] == "H200" and 0 < t["forward_backward_s"] < t["step_s"]
    assert 0 < t["steady"]["forward_backward_s"] <= t["steady"]["step_s"] <= t["step_s"] * (1 + 1e-9)
    assert main(["estimate", "--preset", "seed", "--batch", "4", "--seq", "1024", "--gpu", "H200"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "predicted training step on H200" in text and "one step on an idle GPU" in text
    # seed B4 S1024 is host-bound on the H200 (its host work above its GPU work: docs/timing.md); B16 S4096 is not
    assert t["host_bound"] and "host-bound" in text
    # the kernels' time, a part of the step: forward + backward under the step, and under its wall time
    busy = t["gpu_busy_s"]
    assert 0 < busy["forward_backward"] < busy["step"] < t["steady"]["step_s"]
    assert f"the GPU's kernel time in that step: {busy['step'] * 1e3:,.1f} ms" in text
    # the datasheet profile says so, and names the calibrated one; the calibrated one does not
    assert (t["profile"], t["profile_kind"]) == ("h200-sxm", "datasheet") and "--gpu h200-measured uses" in text
    assert main(["estimate", "--preset", "seed", "--batch", "16", "--seq", "4096", "--gpu", "H200-measured"]) == 0
    out = capsys.readouterr().out
    assert "host-bound" not in out and "datasheet" not in out


def test_estimate_unknown_gpu_is_one_line_exit_2():
    r = _run("estimate", "--preset", "seed", "--gpu", "Z9000")
    assert r.returncode == 2 and "unknown gpu" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _main(argv, capsys):
    """llm_anatomy.cli.main in this process: (exit code, stdout, stderr)."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exits (--help, --version, usage errors)
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_version_and_plain_help(capsys):
    rc, out, _ = _main(["--version"], capsys)
    assert rc == 0 and out.startswith("anatomy ") and out.split()[1][0].isdigit()
    rc, out, _ = _main(["-h"], capsys)
    assert rc == 0 and "cmd_" not in out and "predict parameters" in out
    rc, out, _ = _main(["estimate", "-h"], capsys)
    assert rc == 0 and "cmd_" not in out and "(default: 16)" in " ".join(out.split())


@pytest.mark.parametrize("args, needle", [
    (["estimate", "--gpu", ""], "argument --gpu: empty value"),
    (["estimate", "--hf-config", ""], "argument --hf-config: empty value"),
    (["estimate", "--batch", "1e23"], "invalid int value"),
    (["estimate", "--preset", "seed", "--layers", str(10**30)], "layers=1e+30 is larger than any machine could hold"),
    (["estimate", "--batch", str(2**40)], "batch=1.1e+12 is larger than any machine could hold"),
    (["estimate", "--world-size", str(10**20)], "--world-size must be between 1 and"),
    (["sweep", "--mem-limit", "inf"], "--mem-limit must be a number of GiB > 0"),
    (["sweep", "--batch", "1,,2"], "empty value"),
    (["sweep", "--layers", "1,2,3,4,5,6,7,8,9,10,11", "--batch", "1,2,3,4,5,6,7,8,9,10", "--seq",
      "1,2,3,4,5,6,7,8,9,10", "--variant", "baseline,efficient", "--dtype", "amp,bf16,fp32,amp,bf16"],
     "the grid has 11,000 points"),
    (["compare", "--hidden", "16384", "--heads", "128", "--layers", "64", "--intermediate", "65536", "--vocab",
      "1000000"], "by prediction"),
])
def test_out_of_range_input_is_one_line(args, needle, capsys):
    rc, _, err = _main(args, capsys)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def _hf(tmp_path, **kw):
    d = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             vocab_size=128, **kw)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_rope_scaling_is_read_with_one_note(tmp_path, capsys):
    path = _hf(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    rc, out, err = _main(["estimate", "--hf-config", path, "--json"], capsys)
    assert rc == 0 and json.loads(out)["params"] > 0
    assert err.count("\n") == 1 and "note: RoPE scaling llama3 (factor 8)" in err


def test_sliding_window_shorter_than_seq_is_refused(tmp_path, capsys):
    path = _hf(tmp_path, sliding_window=1024)
    assert _main(["estimate", "--hf-config", path, "--seq", "1024", "--json"], capsys)[0] == 0
    rc, _, err = _main(["estimate", "--hf-config", path, "--seq", "2048"], capsys)
    assert rc == 2 and "sliding_window=1024 is shorter than --seq 2048" in err and err.count("\n") == 1


def test_printed_names_carry_no_control_character_or_markup(tmp_path, capsys):
    path = _hf(tmp_path, _name_or_path="org/[bold red]x\x1b]0;pwned\x07")
    rc, out, err = _main(["estimate", "--hf-config", path, "--batch", "1", "--seq", "16"], capsys)
    assert rc == 0 and "\x1b" not in out and "\x07" not in out and "_bold_red_x_" in out, (out, err)


# ---- one optimizer, said once ---------------------------------------------------------------------
def test_optimizer_moves_memory_and_time_together(capsys):
    """--optimizer picks the optimizer for the memory phases and the step time at once: each figure equals
    the calculator's own for that optimizer (memory.phases, timing.estimate_time), AdEMAMix's state is
    larger than AdamW's at every phase after init's parameters, and the init phase holds the state."""
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.calculator.timing import estimate_time
    from llm_anatomy.config import ModelConfig, Run

    cfg = ModelConfig.from_name("seed")
    got = {}
    for opt in ("adamw", "ademamix"):
        for variant in ("baseline", "efficient"):
            run = Run(4, 1024, lean=variant == "efficient")  # the efficient variant's default: its lean block
            rc, out, err = _main(["estimate", "--preset", "seed", "--batch", "4", "--seq", "1024", "--variant", variant,
                                  "--gpu", "H200", "--optimizer", opt, "--json"], capsys)
            assert rc == 0, err
            e = json.loads(out)
            ph = phases(cfg, run, variant, optimizer=opt, device="cuda")
            assert e["memory"]["phases"]["optimizer"] == e["time"]["optimizer"] == e["optimizer"]["name"] == opt
            assert e["memory"]["phases"]["init"] == ph["init"] == ph["params"] + ph["inputs"] + ph["optimizer"]
            assert e["memory"]["need_bytes"] == max(ph["forward_peak"] or 0, ph["backward_peak"])
            assert e["memory"]["fits"]["need_bytes"] == e["memory"]["need_bytes"]
            t = estimate_time(cfg, run, variant, "H200", optimizer=opt, with_kernels=False)
            assert e["time"]["optimizer_s"] == t["optimizer_s"] and e["time"]["step_s"] == t["step_s"]
            got[opt, variant] = e
    for variant in ("baseline", "efficient"):
        a, m = got["adamw", variant], got["ademamix", variant]
        assert m["memory"]["need_bytes"] > a["memory"]["need_bytes"]
        assert m["memory"]["phases"]["init"] > a["memory"]["phases"]["init"]
        assert m["time"]["optimizer_s"] > a["time"]["optimizer_s"]
        assert a["time"]["forward_backward_s"] == m["time"]["forward_backward_s"]
    # the default is AdamW, for both figures, on the default variant: the efficient one with its lean block
    rc, out, _ = _main(["estimate", "--preset", "seed", "--batch", "4", "--seq", "1024", "--gpu", "H200", "--json"],
                       capsys)
    e = json.loads(out)
    assert e["optimizer"] == dict(name="adamw", implementation="adamw") and e["time"]["optimizer"] == "adamw"
    assert e["memory"]["need_bytes"] == got["adamw", "efficient"]["memory"]["need_bytes"]
    assert e["variant"] == "efficient" and e["lean"] is True and e["run"]["lean"] is True


def test_estimate_text_names_the_optimizer_and_the_efficient_variant(capsys):
    rc, out, _ = _main(["estimate", "--preset", "seed", "--gpu", "H200", "--optimizer", "ademamix", "--variant",
                        "baseline"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "memory with AdEMAMix" in text and "AdEMAMix's per-parameter loop" in text
    assert "--variant efficient estimates the fused model" in text
    rc, out, _ = _main(["estimate", "--preset", "seed", "--gpu", "H200", "--variant", "efficient"], capsys)
    text = " ".join(out.split())
    assert "memory with AdamW" in text and "fused AdamW" in text and "--variant efficient" not in text


def test_no_figure_is_cut_at_80_columns():
    """Every figure of the table whole at 80 columns, and the exact parameter count printed."""

    for args in (["estimate", "--preset", "llama3-8b"], ["estimate", "--preset", "llama3-8b", "--variant", "efficient",
                                                         "--batch", "1", "--gpu", "H100"]):
        r = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", *args], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, COLUMNS="80"))
        assert r.returncode == 0, r.stderr
        assert "…" not in r.stdout and "8,030,261,248 parameters" in r.stdout
        assert "8,030.26" in r.stdout  # the params column, in millions


def test_measure_prints_a_table_unless_json(capsys):
    args = ["measure", "--hidden", "64", "--layers", "1", "--heads", "4", "--intermediate", "96", "--vocab", "128",
            "--batch", "2", "--seq", "16", "--device", "cpu"]
    rc, out, _ = _main(args, capsys)
    assert rc == 0 and not out.lstrip().startswith("{") and "measured on cpu" in out
    rc, out, _ = _main([*args, "--json"], capsys)
    assert rc == 0 and json.loads(out)["params"] > 0


@pytest.mark.parametrize("cmd", ["estimate", "measure", "compare", "sweep", "forensics", "report", "calibrate", "train"])
def test_every_help_is_plain_words(cmd, capsys):
    rc, out, _ = _main([cmd, "-h"], capsys)
    assert rc == 0 and out.startswith("usage: anatomy ")
    if cmd == "train":  # every training flag with its default, a default of 0 too
        assert "(default: 200)" in out and "(default: 0)" in out and "adamw" in out
    for internal in ("cmd_", "def ", "__", "None)"):
        assert internal not in out, (cmd, internal)


@pytest.mark.parametrize("args, needle", [
    (["estimate", "--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
    (["estimate", "--batch", "1e23"], "invalid int value"),
    (["estimate", "--seq", str(2**30)], "seq"),
    (["estimate", "--batch", "65536", "--seq", str(2**22)], "tokens per step is more than any machine"),
    (["sweep", "--optimizer", "lion"], "invalid choice"),
    (["sweep", "--gpu", "Z9000", "--batch", "1"], "unknown gpu"),
    (["sweep", "--world-size", "0"], "--world-size must be between 1 and"),
    (["sweep", "--preset", "seed", "--hf-config", "x.json"], "not both"),
    (["sweep", "--heads", "4"], "without --preset"),
])
def test_more_bad_input_is_one_line(args, needle, capsys, tmp_path):
    if args[0] == "sweep":
        args = [*args, "--out", str(tmp_path / "s.json"), "--quiet", "--device", "cpu"]
    rc, _, err = _main(args, capsys)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("cmd", ["measure", "forensics"])
def test_a_run_too_big_for_this_machine_is_refused_at_once(cmd, capsys, monkeypatch):
    """Before anything is built: one line with the predicted bytes and the memory available."""
    import llm_anatomy.sweep

    monkeypatch.setattr(llm_anatomy.sweep, "available_bytes", lambda device: 2**30)
    args = [cmd, "--hidden", "2048", "--layers", "4", "--heads", "16", "--intermediate", "5632", "--vocab", "32000",
            "--batch", "1", "--seq", "64", "--device", "cpu"]
    rc, _, err = _main(args, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "by prediction" in err and " B)" in err and "1.0 GiB (1,073,741,824 B) of RAM available" in err, err
    assert "0.8 GiB of it usable" in err, err


def test_world_size_text_is_lines_not_json(capsys):
    rc, out, _ = _main(["estimate", "--preset", "seed", "--world-size", "8", "--strategy", "ddp"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "ddp on 8 ranks, rank 0:" in text and "per-rank memory at the step's peak" in text
    assert "collectives per step" in text and "ms exposed" in text
    assert '"collectives"' not in out and "{" not in out


@pytest.mark.parametrize("script", ["bench.step", "bench.profile_step", "bench.step_power"])
def test_bench_lean_is_refused_for_other_peers(script, tmp_path):
    """--lean is the efficient peers' block: for any other peer the bench scripts refuse it, exit 2, before
    touching a GPU."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", script, "--peer", "hf-liger", "--lean", "--preset", "seed",
                        "--batch", "1", "--seq", "8", "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300,
                       cwd=root)
    assert r.returncode == 2 and "--lean applies to the efficient peers, not hf-liger" in r.stderr.splitlines()[-1]


def test_profile_step_names_where_the_gpu_idles():
    """bench/profile_step.idle_gaps: gaps between kernels, summed per step by the kernels around them, largest
    first; overlapping kernels (another stream) leave no gap, and a kernel inside another's span is no 'before'."""
    from bench import profile_step as mod

    k = [(0, 10, "a"), (2, 5, "inner"), (12, 20, "b"), (18, 25, "c"), (40, 50, "a"), (52, 60, "b"), (60, 65, "c")]
    g = mod.idle_gaps(k, steps=2)
    assert [(r["before"], r["after"], r["count"], r["idle"]) for r in g] == [("c", "a", 0.5, 7.5), ("a", "b", 1.0, 2.0)]
    assert mod.idle_gaps(k, steps=2, top=1) == g[:1] and mod.idle_gaps([], steps=1) == []
