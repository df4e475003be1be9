"""The step time and the plan of a mixture-of-experts model, from the config alone (no GPU in this suite):

  - `anatomy estimate --gpu H200` and `--gpu h200-measured` answer for the committed MoE configs, with the memory
    phases and the peak (one figure under the balanced and the worst routing: the efficient block keeps T·k rows);
  - the expert GEMMs are priced as the grouped kernel runs them: one dense GEMM over every expert's rows rounded up
    to the tile height, at the profile's grouped fraction of the dense rate per role (anatomy calibrate);
  - `anatomy plan` plans MoE models with data parallelism (DDP and FSDP) under every recompute policy of the
    efficient block, refusing in one line what the memory phases do not model (its loop-of-mm fallback).
The GPU suite's test_moe_live.py checks these times against the user's loop on an H200."""
from __future__ import annotations

import json

import pytest

from llm_anatomy.calculator import moe
from llm_anatomy.calculator.timing.kernels import kernels
from llm_anatomy.calculator.timing.fit import grouped_rows
from llm_anatomy.calculator.timing.kernels_moe import GROUPED_TILE_M, efficient_moe
from llm_anatomy.calculator.timing.ops import Ops
from llm_anatomy.config import ConfigError, ModelConfig, Run
from validations.hf_configs import HF_CONFIGS
from validations.test_fuzz import run_cli

MOE_CONFIGS = ("Qwen3-30B-A3B", "Mixtral-8x7B-v0.1")
CFG = ModelConfig(name="moe-time", hidden=64, layers=3, heads=4, intermediate=64, vocab=128, experts=8,
                  experts_per_token=2, expert_intermediate=32, shared_experts=1, shared_intermediate=16)


@pytest.mark.parametrize("variant", ["efficient", "baseline"])
@pytest.mark.parametrize("gpu", ["H200", "h200-measured"])
@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_estimate_answers_with_time_and_peak(name, gpu, variant):
    rc, out, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS[name]), "--batch", "1", "--seq", "2048",
                            "--gpu", gpu, "--layers", "4", "--variant", variant, "--json"], "moe")
    assert rc == 0, err
    d = json.loads(out)
    assert d["time"]["step_s"] > 0 and d["memory"]["need_bytes"] > d["memory"]["phases"]["init"]
    comps = d["time"]["components"]
    assert 0 < comps["moe"]["total_s"] < d["time"]["step_s"] and "mlp" not in comps  # no dense MLP kernel listed
    r = d["moe_routing"]
    assert r["need_bytes_balanced"] == d["memory"]["need_bytes"]
    if variant == "efficient":  # dropless: T·k rows kept under any histogram
        assert r["need_bytes_worst"] == r["need_bytes_balanced"] and r["worst_histogram"] == "any"
        assert r["moe_saved_skewed"] == r["moe_saved_worst"] == d["memory"]["saved"]["by_component"]["moe"]
    else:  # the per-expert loop: the worst of the histograms tried, each a figure of its own
        assert r["need_bytes_worst"] == max(r[f"need_bytes_{h}"] for h in ("balanced", "skewed", "full_last"))


def _expert_gemms(hist, run=Run(2, 16)):
    o = Ops(CFG, run)
    efficient_moe(o, hist)
    return [k for k in o.k if k.name.startswith("moe.experts.") and k.kind == "matmul"]


@pytest.mark.parametrize("hist", ["balanced", "skewed", (28, 36, 0, 0, 64, 0, 0, 128), (100, 100, 28, 28, 0, 0, 0, 0)])
def test_expert_gemms_priced_as_one_gemm_over_tile_rounded_rows(hist):
    """Each grouped GEMM's forward and d(x) are one dense GEMM over every expert's rows rounded up to the tile
    height (kernels_moe.GROUPED_TILE_M), its d(W) each expert's reduction over its own rows; each marked grouped
    for its role; one launch per grouped GEMM."""
    run = Run(2, 64)
    h = {"balanced": moe.balanced(CFG, run), "skewed": moe.skewed(CFG, run)}.get(hist, hist)
    gemms = _expert_gemms(h, run)
    H, I, L = CFG.hidden, CFG.expert_intermediate, CFG.layers
    rows = sum(-(-n // GROUPED_TILE_M) * GROUPED_TILE_M for n in h)
    assert rows == grouped_rows(list(h))
    dense = {k.name: (k.shape[1:], k.count, k.fused) for k in gemms if not k.name.endswith("grad_weight")}
    assert dense == {
        "moe.experts.gate_up": ((rows, 2 * I, H), L, ("grouped_mm", "forward")),
        "moe.experts.gate_up.grad_input": ((rows, H, 2 * I), L, ("grouped_mm", "backward")),
        "moe.experts.down": ((rows, H, I), L, ("grouped_mm", "forward")),
        "moe.experts.down.grad_input": ((rows, I, H), L, ("grouped_mm", "backward"))}
    # d(W): each expert's own reduction over its rows, a batch of experts per distinct row count
    per_count = {n: list(h).count(n) for n in set(h) if n}
    for name, (d_out, d_in) in (("moe.experts.gate_up", (2 * I, H)), ("moe.experts.down", (H, I))):
        dw = [k for k in gemms if k.name == f"{name}.grad_weight"]
        assert {(k.shape[3], k.shape[0]) for k in dw} == set(per_count.items())
        assert all(k.shape[1:3] == (d_out, d_in) and k.count == L and k.fused == ("grouped_mm", "backward") for k in dw)
        assert sum(k.flops * k.count for k in dw) == 2 * d_out * d_in * sum(h) * L  # the routed rows, unpadded
    # one launch per grouped GEMM: the host is charged once, not per expert
    assert sum(1 for k in gemms if k.host == "op") == 6


def test_expert_gemms_follow_the_rows_only_through_the_tiles():
    """Where every expert's rows fill whole tiles, the balanced and the skewed routing are the same forward and
    d(x) GEMMs (the grouped kernel fills the GPU by its total rows) and d(W)s of the same FLOPs (each expert's
    reduction over its own rows); a part-filled tile costs a whole one."""
    run = Run(2, 512)  # T·k / E = 256 rows per expert: two whole tiles
    bal, skw = _expert_gemms(moe.balanced(CFG, run), run), _expert_gemms(moe.skewed(CFG, run), run)
    assert [k for k in bal if "grad_weight" not in k.name] == [k for k in skw if "grad_weight" not in k.name]
    assert sum(k.flops * k.count for k in bal) == sum(k.flops * k.count for k in skw)
    part = _expert_gemms((255, 257) + (256,) * 6, run)  # the same 2048 rows, one tile more
    assert [k.shape[1] for k in part if k.name == "moe.experts.down"] == [2048 + GROUPED_TILE_M]


def test_grouped_fraction_prices_the_grouped_gemms():
    """The profile's grouped_mm fraction (anatomy calibrate) scales the grouped GEMMs' rate by role and nothing
    else: halving the backward fraction leaves the forward and every dense GEMM where they were."""
    from dataclasses import replace as dc_replace

    from llm_anatomy.calculator.timing import get
    from llm_anatomy.calculator.timing.roofline import kernel_terms

    prof = get("h200-measured")
    half = dc_replace(prof, grouped_mm=dict(prof.grouped_mm or {}, forward=1.0, backward=0.5))
    one = dc_replace(prof, grouped_mm=dict(forward=1.0, backward=1.0))
    for k in kernels(CFG, Run(2, 512), "efficient", optimizer=None):
        if k.kind != "matmul":
            continue
        t_half, t_one = kernel_terms(k, half)[0], kernel_terms(k, one)[0]
        grouped_bwd = k.fused == ("grouped_mm", "backward")
        assert t_half == pytest.approx(2 * t_one if grouped_bwd else t_one, rel=1e-12), k.name


def test_moe_matmul_flops_are_the_calculators():
    """Every matmul of the MoE block in the kernel list (router, experts, shared MLP) sums to calculator/moe.py's
    forward FLOPs, and backward to twice them, where each expert's rows fill whole tiles (else the grouped GEMMs
    also compute the tiles' empty rows)."""
    run = Run(2, 256)
    ks = [k for k in kernels(CFG, run, "efficient", optimizer=None) if k.component == "moe" and k.kind == "matmul"]
    assert sum(k.flops * k.count for k in ks if k.phase == "forward") == moe.flops(CFG, run)
    assert sum(k.flops * k.count for k in ks if k.phase == "backward") == 2 * moe.flops(CFG, run)


def test_plan_plans_moe_over_data_and_expert_parallelism():
    rc, out, err = run_cli(["plan", "--hf-config", str(HF_CONFIGS["Qwen3-30B-A3B"]), "--gpu", "H100", "--gpus", "8",
                            "--seq", "2048", "--json"], "moe")
    assert rc == 0, err
    d = json.loads(out)
    assert {c["strategy"] for c in d["candidates"]} == {"ddp", "fsdp"}
    assert {c["recompute"] for c in d["candidates"]} == {"none", "mlp", "full"}  # the efficient block's policies
    # the meshes an MoE is planned over are expert-parallel in the engine's layouts (dp = GPUs, every ep >= 2 dividing
    # both the GPUs and the 128 experts), nothing else
    assert d["meshes"] and {(m["dp"], m["tp"], m["pp"]) for m in d["meshes"]} == {(8, 1, 1)}
    assert {m["ep"] for m in d["meshes"]} <= {2, 4, 8} and 8 in {m["ep"] for m in d["meshes"]}
    assert d["best"]["strategy"] == "fsdp" and d["best"]["fits"]


@pytest.mark.parametrize("variant", ["efficient", "baseline"])
def test_plan_one_gpu_answers(variant):
    rc, out, err = run_cli(["plan", "--hf-config", str(HF_CONFIGS["Mixtral-8x7B-v0.1"]), "--gpu", "H200",
                            "--seq", "1024", "--layers", "2", "--variant", variant, "--json"], "moe")
    assert rc == 0, err
    assert json.loads(out)["best"]["strategy"] == "single"


@pytest.mark.parametrize("argv, word", [
    (["plan", "--gpu", "H100", "--gpus", "8", "--dtype", "fp32"], "loop-of-mm"),
    (["estimate", "--device", "cpu", "--world-size", "2", "--dtype", "fp32"], "loop-of-mm"),
])
def test_unmodelled_refused_in_one_line(argv, word):
    rc, _, err = run_cli([*argv, "--hf-config", str(HF_CONFIGS["Qwen3-30B-A3B"])], "moe")
    assert rc == 2 and err.count("\n") == 1 and word in err, err


@pytest.mark.parametrize("hist", ["balanced", "skewed"])
def test_baseline_loop_launches_per_expert_with_rows(hist):
    """The baseline's loop: every expert runs torch.where over the choices (a host sync: its size), rows or not;
    every expert with rows is then its own launches at its own row count; its matmul FLOPs are the calculator's."""
    from llm_anatomy.calculator.timing.kernels_baseline import mlp
    from llm_anatomy.calculator.timing.kernels_moe import baseline_moe

    run = Run(2, 24)
    h = (moe.balanced if hist == "balanced" else moe.skewed)(CFG, run)
    o = Ops(CFG, run)
    baseline_moe(o, mlp, h)
    hit = sum(1 for n in h if n)
    gate_up = [k for k in o.k if k.name == "moe.expert.gate_up"]
    assert sum(k.count for k in gate_up) == CFG.layers * hit and all(k.host == "op" for k in gate_up)
    assert sorted(k.shape[1] for k in gate_up for _ in range(k.count // CFG.layers)) == sorted(n for n in h if n)
    assert sum(k.count for k in o.k if k.sync) == CFG.layers * CFG.experts
    assert sum(k.count for k in o.k if k.name == "moe.expert.where") == CFG.layers * CFG.experts
    mms = [k for k in o.k if k.kind == "matmul"]
    assert sum(k.flops * k.count for k in mms if k.phase == "forward") == moe.flops(CFG, run)
    assert sum(k.flops * k.count for k in mms if k.phase == "backward") == 2 * moe.flops(CFG, run)


@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_moe_host_calls_are_per_step(variant):
    """Kernel.calls counts a step's host calls: an MoE entry of several eager ops a launch (torch.where: eq,
    nonzero and its copy back) states ops x launches, so the baseline's L x E syncing wheres cost 3 L E eager ops
    of host time, not 3 (test_moe_live's baseline loop on skewed routing, host-bound by this)."""
    from llm_anatomy.calculator.timing.host import host_seconds

    run = Run(2, 24)
    ks = [k for k in kernels(CFG, run, variant, None, None, hist=moe.skewed(CFG, run)) if k.name.startswith("moe.")]
    prof = dict(host_op_s=1.0, host_custom_s={})
    assert all(k.calls is None or k.calls % k.count == 0 for k in ks), [(k.name, k.calls, k.count) for k in ks]
    if variant == "baseline":
        where = [k for k in ks if k.name == "moe.expert.where"]
        assert sum(host_seconds(k, prof) for k in where) == 3 * CFG.layers * CFG.experts


def test_calibrated_grouped_rows_fit_the_grouped_fraction():
    """fit.grouped_efficiency: rows timed at the dense model's time for their tile-rounded rows read 1.0, at twice
    it 0.5 (the median over the queued rows, per role); a measured profile carrying them prices with it, and a
    row whose per-expert counts are not counts is refused in one line naming the field."""
    from llm_anatomy.calculator.timing import get
    from llm_anatomy.calculator.timing.fit import grouped_efficiency
    from llm_anatomy.calculator.timing.profile import check_measured
    from llm_anatomy.calculator.timing.roofline import matmul_efficiency
    from llm_anatomy.measure.calibrate_grouped import grouped_grid

    prof = get("h200-measured")
    rate, kh, sms = prof.matmul_flops["bfloat16"], prof.matmul_k_half, prof.sms

    def dense_ms(g, role):  # kernels_moe's pricing: one GEMM over N' rows; d(W) per expert over its own rows
        N, n, k, rows = grouped_rows(g["rows"]), g["n"], g["k"], g["rows"]
        gemms = [(N, n, k, 1)] if role == "forward" else [(N, k, n, 1)] + [
            (n, k, r, rows.count(r)) for r in set(rows) if r]
        return sum(2 * a * b * c * e / (rate * matmul_efficiency(a, b, c, sms, kh, e)) for a, b, c, e in gemms) * 1e3

    rows = [dict(g, role=r, ms=dense_ms(g, r) * (1 if r == "forward" else 2), queued=True)
            for g in grouped_grid() for r in ("forward", "backward")]
    rows.append(dict(rows[0], ms=rows[0]["ms"] * 10, queued=False))  # not queued: left out
    eff = grouped_efficiency(rows, rate, kh, sms)
    assert eff == pytest.approx(dict(forward=1.0, backward=0.5), rel=1e-9)
    bad = dict(base="h200-sxm", measurements=dict(grouped_mm=[dict(rows[0], rows=[1.5, 2])]))
    with pytest.raises(ConfigError, match=r"measurements\.grouped_mm\[0\]\.rows"):
        check_measured(bad, "p.json")


def test_plan_fits_gptoss_under_fsdp_and_says_what_it_cannot_time(tmp_path):
    """gpt-oss's expert biases under FSDP2's bf16 gathers (no autocast) are added after the grouped GEMMs, whose
    memory phases are modelled (test_moe_memory.py's bf16 draws): FSDP fits 8 H100s where DDP's whole replicas do
    not, and expert parallel is searched (its phases exact on gloo with expert biases: test_ep_memory.py). The
    derived H100 and h100-measured carry masked-attention rows (gpt-oss's sinks and windows): the plan is timed,
    meshes included. A calibration without those rows (the packaged H200's before its supplement): the fitting rows
    carry no time, the meshes none either (left out), the plan says why in one line, and its verdict says what
    fits without calling it timed or an OOM."""
    from validations.test_timing_fields import without_field_rows

    argv = ["plan", "--hf-config", str(HF_CONFIGS["gpt-oss-20b"]), "--gpus", "8", "--seq", "1024"]
    for gpu in ("H100", "h100-measured"):
        rc, out, err = run_cli([*argv, "--gpu", gpu, "--json"], "moe")
        assert rc == 0, err
        d = json.loads(out)
        assert {c["strategy"] for c in d["candidates"] if c["fits"]} == {"fsdp"}, d["candidates"]
        assert d["best"]["strategy"] == "fsdp" and d["best"]["step_s"] > 0 and not d["untimed"]
        assert d["meshes"] and all(m["ep"] > 1 and m["step_s"] > 0 for m in d["meshes"])
    bare = without_field_rows(tmp_path)
    rc, out, err = run_cli([*argv, "--gpu", bare, "--json"], "moe")
    assert rc == 0, err
    d = json.loads(out)
    assert d["best"] is None and not d["skipped"] and any(c["fits"] for c in d["candidates"]), d["candidates"]
    assert all(c["step_s"] is None for c in d["candidates"])
    assert len(d["untimed"]) == 1 and "masked-attention" in d["untimed"][0]
    assert d["meshes"] == [] and not d["ep_skipped"], d["ep_skipped"]
    rc, text, err = run_cli([*argv, "--gpu", bare], "moe")
    assert rc == 0 and "verdict: fits, not timed on " in text and "fsdp, recompute none" in text, text
    assert "predicted OOM" not in text and "not timed: gpu profile" in text


def test_plan_lists_recompute_with_attention_fields():
    """gpt-oss's attention fields (sinks, windows, o bias) and OLMoE's whole q/k norms in MoE blocks are modelled under
    every recompute policy (validations/test_moe_fields_recompute.py): the plan lists gpt-oss-20b's "mlp" and "full"
    rows, and plans every policy for OLMoE-1B-7B."""
    from llm_anatomy.hf_config import read_hf_config
    from llm_anatomy.plan import modelled_policies

    rc, out, err = run_cli(["plan", "--hf-config", str(HF_CONFIGS["gpt-oss-20b"]), "--gpu", "H200", "--gpus", "8",
                            "--seq", "4096", "--json"], "moe")
    assert rc == 0, err
    assert {c["recompute"] for c in json.loads(out)["candidates"]} == {"none", "mlp", "full"}
    olmoe = read_hf_config(HF_CONFIGS["OLMoE-1B-7B-0924"]).config
    assert modelled_policies(olmoe, "efficient", 4096, "amp", True) == ("none", "mlp", "full")
