"""`anatomy forensics` on a synthetic allocator snapshot, and `anatomy sweep` on CPU (split from test_benchmarks.py)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch


# ---- CPU: forensics on a synthetic snapshot ---------------------------------------------------------
def _f(path, name, line=1):
    return {"filename": path, "line": line, "name": name}


def _synthetic_snapshot():
    """A build, then one step: forward, backward (a built-in op with no Python frames), optimizer."""
    from llm_anatomy.measure.forensics import MARKER_FUNC, marker_size

    addr = itertools.count(0x7000_0000, 0x10_0000)
    trace, live = [], {}

    def mark(label):
        a = next(addr)
        trace.append(dict(action="alloc", addr=a, size=marker_size(label),
                          frames=[_f("/r/anatomy/measure/memory.py", MARKER_FUNC), _f("/r/x.py", "hook")]))
        trace.append(dict(action="free_requested", addr=a, size=marker_size(label), frames=[]))
        trace.append(dict(action="free_completed", addr=a, size=marker_size(label), frames=[]))

    def alloc(key, size, frames):
        a = live[key] = next(addr)
        trace.append(dict(action="alloc", addr=a, size=size, frames=frames))
        trace.append(dict(action="segment_alloc", addr=a, size=2 * size, frames=frames))  # must not count

    def free(key, size):
        trace.append(dict(action="free_requested", addr=live[key], size=size, frames=[]))
        trace.append(dict(action="free_completed", addr=live.pop(key), size=size, frames=[]))

    MiB = 2**20
    base = "/r/anatomy/baseline/"
    alloc("w_attn", 4 * MiB, [_f("/t/torch/nn/modules/linear.py", "__init__"), _f(base + "attention.py", "__init__"),
                              _f("/r/anatomy/models.py", "build_model")])
    alloc("w_embed", 8 * MiB, [_f("/t/torch/nn/modules/sparse.py", "__init__"), _f(base + "transformer.py", "__init__")])
    alloc("ids", MiB, [_f("/r/anatomy/models.py", "make_batch")])
    trace.append(dict(action="free_requested", addr=0x1, size=3 * MiB, frames=[]))  # made before recording
    mark("phase:forward")
    mark("embedding")
    alloc("x", 2 * MiB, [_f("/t/torch/nn/functional.py", "embedding"), _f(base + "transformer.py", "forward")])
    mark("other")
    mark("attention")
    alloc("scores", 16 * MiB, [_f("/t/torch/nn/functional.py", "softmax"), _f(base + "attention.py", "forward", 48)])
    mark("other")
    alloc("resid", 2 * MiB, [_f(base + "transformer.py", "forward")])
    mark("loss")
    alloc("logits", 6 * MiB, [_f(base + "loss.py", "forward")])
    mark("phase:backward")
    mark("loss")
    free("logits", 6 * MiB)
    mark("attention")
    alloc("dscores", 16 * MiB, [])  # the peak: autograd's device thread, no Python frames
    free("dscores", 16 * MiB)
    free("scores", 16 * MiB)
    mark("phase:optimizer")
    mark("optimizer")
    alloc("exp_avg", 4 * MiB, [_f("/t/torch/optim/adamw.py", "_init_group")])
    mark("other")
    mark("phase:end")
    segments = [dict(address=0x1000, total_size=4 * MiB, blocks=[
        dict(address=0x1000, size=MiB, state="active_allocated"),  # made before recording, still live
        dict(address=0x1000 + MiB, size=MiB, state="inactive")])]
    return dict(segments=segments, device_traces=[trace]), MiB


def test_forensics_attributes_the_peak_of_a_synthetic_snapshot():
    from llm_anatomy.measure.forensics import attribute_peak, replay

    snap, MiB = _synthetic_snapshot()
    r = replay(snap)
    assert r.pre_existing == 4 * MiB  # 3 MiB freed during the trace + 1 MiB still live at the end
    assert r.steps == 1
    pk = attribute_peak(snap, top=3)
    # at the peak: pre 1 MiB (3 of the 4 freed), attn 4 + 16 + 16, embed 8 + 2, ids 1, resid 2
    assert pk["peak_bytes"] == (1 + 4 + 8 + 1 + 2 + 16 + 2 + 16) * MiB
    assert (pk["peak_phase"], pk["peak_step"], pk["peak_during"]) == ("backward", 1, "attention")
    assert pk["by_component"] == {"attention": 36 * MiB, "embedding": 10 * MiB, "other": 3 * MiB,
                                  "pre-existing": MiB}
    assert sum(pk["by_component"].values()) == pk["peak_bytes"]
    assert pk["by_kind"]["parameter"] == 12 * MiB and pk["by_kind"]["input"] == MiB
    assert pk["attributed_by"] == {"frames": 28 * MiB, "module stack": 18 * MiB, "none": 3 * MiB}
    top = {(t["component"], t["size"], t["via"], t["kind"], t["where"]) for t in pk["top"]}
    assert top == {("attention", 16 * MiB, "frames", "activation", "baseline/attention.py:48:forward"),
                   ("attention", 16 * MiB, "module stack", "gradient / backward buffer", "?"),
                   ("embedding", 8 * MiB, "frames", "parameter", "baseline/transformer.py:1:__init__")}


def test_forensics_plot_of_a_synthetic_snapshot(tmp_path):
    from llm_anatomy.measure.forensics import plot_timeline, replay, step_series

    snap, MiB = _synthetic_snapshot()
    r = replay(snap)
    xs, ys, marks = step_series(r)
    running = list(itertools.accumulate((ev.delta for ev in r.events), initial=r.pre_existing))[1:]
    totals = [sum(v[i] for v in ys.values()) for i in range(len(xs))]
    assert totals == [running[x] for x in xs]  # the stacked bands add up to the allocated total
    assert max(totals) == r.peak and xs[totals.index(max(totals))] == r.peak_pos
    assert [ph for _, ph in marks] == ["forward", "backward", "optimizer"]
    assert set(ys) >= {"attention", "embedding", "loss", "optimizer"}
    png = plot_timeline(r, tmp_path / "step.png", title="synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))


def test_forensics_cli_asks_for_cuda_only_when_told(capsys):
    from llm_anatomy.measure.forensics_cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CPU exit is what is tested here")
    assert main(["--preset", "seed", "--batch", "1", "--seq", "8", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA GPU" in err
    assert main(["--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["--preset", "seed", "--recompute", "mlp", "--device", "cpu", "--variant", "baseline"]) == 2
    assert "option of the efficient variant" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["baseline", "efficient", "efficient --recompute mlp"])
def test_forensics_on_cpu_live_storage(variant, tmp_path, capsys):
    """`anatomy forensics --device cpu`: the live-storage trace goes through the CUDA path's replay,
    attribution and plot. The replayed peak must equal LiveStorage's own per-phase peaks of the same
    steps, and what is live at the peak must be credited to components, not left unattributed."""
    from llm_anatomy.measure.forensics_cli import main

    png, out = tmp_path / "f.png", tmp_path / "f.json"
    argv = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "160",
            "--vocab", "1000", "--batch", "2", "--seq", "64", "--variant", *variant.split(), "--device", "cpu",
            "--png", str(png), "--out", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pk = rep["peak"]
    assert pk["peak_bytes"] == max(p["peak"] for p in rep["phases"])
    assert pk["pre_existing_bytes"] == 0  # the recording starts before the model is built
    assert sum(pk["by_component"].values()) == pk["peak_bytes"]
    assert pk["attributed_by"]["none"] <= 0.05 * pk["peak_bytes"], pk["attributed_by"]
    assert {"embedding", "attention", "mlp", "loss", "optimizer"} <= set(pk["by_component"])
    assert "CPU live tensor storage" in rep["title"]
    assert ("recompute mlp" in rep["title"]) == (rep["run"].get("recompute") == "mlp") == ("recompute" in variant)


@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_forensics_on_cpu_of_a_mixture_of_experts(variant, tmp_path):
    """A mixture-of-experts model (a narrow Mixtral read from its committed config): its MoE blocks mark their
    own component, and what they hold at the peak is credited to "moe"."""
    from llm_anatomy.measure.forensics_cli import main
    from validations.hf_configs import HF_CONFIGS

    d = dict(json.loads(HF_CONFIGS["Mixtral-8x7B-v0.1"].read_text()), num_hidden_layers=2, hidden_size=64,
             intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_local_experts=4)
    (tmp_path / "config.json").write_text(json.dumps(d))
    out = tmp_path / "f.json"
    assert main(["--hf-config", str(tmp_path), "--batch", "2", "--seq", "16", "--variant", variant, "--device", "cpu",
                 "--png", str(tmp_path / "f.png"), "--out", str(out)]) == 0
    pk = json.loads(out.read_text())["peak"]
    assert pk["by_component"].get("moe", 0) > 0 and "mlp" not in pk["by_component"], pk["by_component"]


# ---- CPU: anatomy sweep ------------------------------------------------------------------------------
def _sweep(tmp_path, *argv):
    from llm_anatomy.sweep import main

    out = tmp_path / "sweep.json"
    rc = main([*argv, "--out", str(out), "--quiet"])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_sweep_predicts_and_measures_small_configs_on_cpu(tmp_path):
    rc, rep = _sweep(tmp_path, "--preset", "seed", "--hidden", "64", "--layers", "1,2", "--batch", "2",
                     "--seq", "16", "--variant", "baseline,efficient", "--measure", "--device", "cpu")
    assert rc == 0
    rows = rep["rows"]
    assert rep["grid"]["points"] == 4 and {r["config"] for r in rows} == {"seed-h64-l1", "seed-h64-l2"}
    keys = {"test", "claim", "component", "config", "variant", "predicted", "measured", "error", "tolerance", "unit",
            "device", "passed", "note"}  # the claims report's row keys
    assert all(keys <= set(r) for r in rows)
    exact = [r for r in rows if r["measured"] is not None]
    assert exact and all(r["passed"] and r["error"] == 0 for r in exact)
    assert {r["status"] for r in rows} == {"measured"}
    assert {"params", "flops.counter.forward", "memory.saved.total", "memory.saved"} <= {r["claim"] for r in exact}


def test_sweep_skips_a_predicted_oom_and_records_an_unpredicted_one(tmp_path, monkeypatch):
    import llm_anatomy.sweep as sw

    rc, rep = _sweep(tmp_path, "--preset", "seed", "--batch", "16", "--seq", "4096", "--variant", "baseline",
                     "--measure", "on", "--device", "cpu", "--mem-limit", "1")
    assert rc == 0
    assert {r["status"] for r in rep["rows"]} == {"skipped"}
    assert "predicted to need" in rep["rows"][0]["note"] and "GiB" in rep["rows"][0]["note"]
    need = next(r for r in rep["rows"] if r["claim"].startswith("memory.need"))["predicted"]
    assert f"{need:,} B" in rep["rows"][0]["note"]

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    rows = sw.sweep(sw.grid(["seed"], [64], [1], [2], [16], ["amp"], ["efficient"]), measure=True, device="cpu",
                    measure_fn=oom)
    assert {r["status"] for r in rows} == {"failed"} and "OutOfMemoryError" in rows[0]["note"]

    def bug(*a, **k):
        raise KeyError("a bug is not an OOM")

    with pytest.raises(KeyError):
        sw.sweep(sw.grid(["seed"], [64], [1], [2], [16], ["amp"], ["baseline"]), measure=True, device="cpu",
                 measure_fn=bug)


def test_sweep_predicts_a_large_grid_without_torch_models(tmp_path, monkeypatch):
    import llm_anatomy.measure.run
    import llm_anatomy.models

    def no_model(*a, **k):
        raise AssertionError("a prediction-only sweep built or measured a torch model")

    monkeypatch.setattr(llm_anatomy.models, "build_model", no_model)
    monkeypatch.setattr(llm_anatomy.measure.run, "measure", no_model)
    rc, rep = _sweep(tmp_path, "--preset", "seed,llama3-8b", "--batch", "1", "8", "--seq", "2048,8192",
                     "--device", "cuda")
    assert rc == 0 and rep["grid"]["points"] == 2 * 2 * 2 * 2 and rep["grid"]["device"] == "cuda"
    assert {r["status"] for r in rep["rows"]} == {"predicted"}
    assert all(r["measured"] is None and r["passed"] is None for r in rep["rows"])


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "nope"], "unknown preset"),
    (["--batch", "x"], "int list"),
    (["--batch", "0"], "batch must be a positive integer"),
    (["--variant", "fast"], "unknown variant"),
    (["--hidden", "100"], "head_dim"),
    (["--measure", "maybe"], "invalid choice"),
    (["--mem-limit", "0"], "--mem-limit"),
])
def test_sweep_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, msg):
    from llm_anatomy.sweep import main

    try:  # argparse's own errors leave through sys.exit(2); the rest return 2
        rc = main([*argv, "--out", str(tmp_path / "s.json"), "--quiet", "--device", "cpu"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and msg in err, err
    assert not (tmp_path / "s.json").exists()


def _estimate(capsys, *argv) -> dict:
    from llm_anatomy.cli import main

    capsys.readouterr()
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _point(rows, config, batch, variant):
    return {r["claim"].split(" (")[0]: r for r in rows
            if (r["config"], r["batch"], r["variant"], r["component"]) == (config, batch, variant, "model")}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("optimizer", ["adamw", "ademamix"])
def test_sweep_need_is_estimates_peak(tmp_path, capsys, device, optimizer):
    """Each point's need is `anatomy estimate`'s memory.need_bytes for the same model, run, device and
    optimizer (the optimizer's state included); with --gpu its step time and the GPU's capacity are
    estimate's, with --world-size its per-rank memory."""
    rc, rep = _sweep(tmp_path, "--preset", "seed,llama3.2-1b", "--batch", "1,4", "--seq", "512", "--device", device,
                     "--optimizer", optimizer, "--gpu", "H200", "--world-size", "8")
    assert rc == 0 and rep["grid"]["optimizer"] == optimizer
    for config, batch, variant in itertools.product(("seed", "llama3.2-1b"), (1, 4), ("baseline", "efficient")):
        e = _estimate(capsys, "--preset", config, "--batch", str(batch), "--seq", "512", "--variant", variant,
                      "--device", device, "--optimizer", optimizer, "--gpu", "H200", "--world-size", "8")
        p = _point(rep["rows"], config, batch, variant)
        assert p["memory.need"]["predicted"] == e["memory"]["need_bytes"] > e["memory"]["saved"]["total"]
        assert p["time.step"]["predicted"] == e["time"]["steady"]["step_s"]
        assert p["memory.capacity"]["predicted"] == e["memory"]["fits"]["capacity_bytes"]
        assert p["memory.per_rank"]["predicted"] == e["distributed"]["memory"]["total"]


def test_sweep_takes_the_model_flags_estimate_takes(tmp_path, capsys):
    """An HF config.json (with a field overriding it and --layers reshaping it) and explicit fields."""
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=688, vocab_size=1000)))
    rc, rep = _sweep(tmp_path, "--hf-config", str(hf), "--vocab", "2000", "--layers", "2,4", "--batch", "2",
                     "--seq", "128", "--variant", "efficient", "--device", "cpu")
    assert rc == 0 and rep["grid"]["points"] == 2
    e = _estimate(capsys, "--hf-config", str(hf), "--vocab", "2000", "--layers", "2", "--batch", "2", "--seq", "128",
                  "--variant", "efficient", "--device", "cpu")
    (name2,) = {r["config"] for r in rep["rows"] if r["config"].endswith("-l2")}
    p = _point(rep["rows"], name2, 2, "efficient")
    assert p["params"]["predicted"] == e["params"] and p["memory.need"]["predicted"] == e["memory"]["need_bytes"]
    rc, rep = _sweep(tmp_path, "--hidden", "64,128", "--layers", "2", "--heads", "4", "--intermediate", "96",
                     "--vocab", "128", "--batch", "2", "--seq", "16", "--variant", "baseline", "--device", "cpu")
    assert rc == 0 and rep["grid"]["points"] == 2
    assert {r["config"] for r in rep["rows"]} == {"custom-h64-l2", "custom-h128-l2"}
    for h in (64, 128):
        e = _estimate(capsys, "--hidden", str(h), "--layers", "2", "--heads", "4", "--intermediate", "96", "--vocab",
                      "128", "--batch", "2", "--seq", "16", "--device", "cpu", "--variant", "baseline")
        p = _point(rep["rows"], f"custom-h{h}-l2", 2, "baseline")
        assert p["params"]["predicted"] == e["params"] and p["memory.need"]["predicted"] == e["memory"]["need_bytes"]
