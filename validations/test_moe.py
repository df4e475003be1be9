"""Mixture of experts (Qwen3-MoE, Mixtral, gpt-oss, OLMoE) and gpt-oss's attention, against transformers.

`anatomy estimate --hf-config` on each committed config: parameters equal transformers' model of that config on the
meta device (total, and active per token: the total less the E - k experts a token skips in each layer, one
expert's size read off transformers' own stacked tensors). FLOPs equal FlopCounterMode's count of transformers'
model of a depth- and width-reduced version of the same config (2 layers, narrow; every router, bias, sink and
window field as published), forward and backward: narrow because two full-width layers of Mixtral alone are 2.9B
parameters, beyond a shared CPU machine, while the formulas are linear in each width, which the drawn configs of
test_moe_saved.py vary. No routing needs forcing there: dropless routing runs every
token through its k experts, so the matmul FLOPs depend only on the T·k routed rows, not on how they spread (the
eager experts loop skips experts without rows, which would contribute 0 anyway). The model convention counts the
attended (query, key) pairs, read off transformers' own attention probabilities (output_attentions: the pairs a
causal or sliding-window mask leaves out have probability 0). Every field the reader does not model is refused
in one line (a test per kind).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.hf_config import read_hf_config
from llm_anatomy.models import build_model
from validations.hf_configs import HF_CONFIGS, MODELS
from validations.test_fuzz import run_cli

transformers = pytest.importorskip("transformers")

MOE = [n for n, m in MODELS.items() if m.model_type in ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")]
B, S = 2, 16


def _json(name: str) -> dict:
    return json.loads(HF_CONFIGS[name].read_text())


def hf_model(d: dict, device: str = "cpu"):
    """transformers' model of a config dict: eager attention (QKᵀ and P@V as matmuls), eager experts (a loop)."""
    d = dict(d)
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                             experts_implementation="eager")


def reduced(d: dict) -> dict:
    """The same config two layers deep and narrow: every structural field (experts, k, router, biases, sinks, the
    window pattern, head_dim apart from hidden / heads where the config states one) kept."""
    d = dict(d, num_hidden_layers=2, hidden_size=64, vocab_size=128, num_attention_heads=8, num_key_value_heads=2)
    for k in ("quantization_config", "pad_token_id", "bos_token_id", "eos_token_id"):  # ids past a vocab of 128
        d.pop(k, None)
    if d["model_type"] == "olmoe":  # multi-head attention: every head its own k and v
        d.update(num_attention_heads=4, num_key_value_heads=4)
    if "head_dim" in d:
        d["head_dim"] = 16  # 8 x 16 = 128 wide q over a hidden of 64, as the full models are wider than hidden
    d["moe_intermediate_size" if d["model_type"] == "qwen3_moe" else "intermediate_size"] = 32
    if d["model_type"] == "gpt_oss":
        d.update(sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    return d


def estimate_cli(path, run: Run = Run(1, 16, "fp32")) -> dict:
    rc, out, err = run_cli(["estimate", "--hf-config", str(path), "--variant", "baseline", "--batch", str(run.batch),
                            "--seq", str(run.seq), "--dtype", run.dtype, "--json"], "moe")
    assert rc == 0, err
    return json.loads(out)


def one_expert(model) -> int:
    """One routed expert's parameters in transformers' model: a slice of each stacked experts tensor."""
    experts = model.model.layers[0].mlp.experts
    return sum(p[0].numel() for p in experts.parameters())


# ---- parameters and FLOPs, against transformers ----------------------------------------------------------
@pytest.mark.parametrize("name", MOE)
def test_estimate_params_equal_transformers(name, claims):
    d, cfg = _json(name), read_hf_config(HF_CONFIGS[name]).config
    model = hf_model(d, device="meta")
    total = sum(p.numel() for p in model.parameters())
    active = total - cfg.layers * (cfg.experts - cfg.experts_per_token) * one_expert(model)
    out = estimate_cli(HF_CONFIGS[name])
    claims.check("params equal Hugging Face's", component="model", config=name, variant="hf-moe",
                 predicted=out["params"], measured=total)
    claims.check("active params per token equal Hugging Face's", component="model", config=name, variant="hf-moe",
                 predicted=out["params_active"], measured=active)
    assert total == MODELS[name].params


def _attended(attentions) -> int:
    """Σ over layers of 4·hd·(attended pairs − B·nh·S/2): the model convention's S×S FLOPs (half of S², less what
    a window leaves out), from the pairs whose probability is not 0."""
    return sum(int((a > 0).sum()) for a in attentions)


@pytest.mark.parametrize("name", MOE)
def test_estimate_flops_equal_transformers(name, tmp_path, claims):
    from torch.utils.flop_counter import FlopCounterMode

    d = reduced(_json(name))
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = read_hf_config(tmp_path).config
    est = estimate_cli(tmp_path, Run(B, S, "fp32"))["flops"]
    torch.manual_seed(0)
    model = hf_model(d)
    ids = torch.randint(0, cfg.vocab, (B, S))
    with FlopCounterMode(display=False) as fwd:
        out = model(input_ids=ids, output_attentions=True)
    with FlopCounterMode(display=False) as bwd:
        out.logits.sum().backward()
    counts = {ph: {str(op): n for op, n in m.get_flop_counts()["Global"].items()} for ph, m in (("f", fwd), ("b", bwd))}
    assert set(counts["f"]) | set(counts["b"]) <= {"aten.mm", "aten.addmm", "aten.bmm"}, counts
    pairs = _attended(out.attentions)
    attn_model = 4 * cfg.head_dim * pairs - 2 * cfg.layers * B * cfg.heads * S * cfg.head_dim  # pairs less S/2 a row
    mm = {ph: c.get("aten.mm", 0) + c.get("aten.addmm", 0) for ph, c in counts.items()}
    ratio = counts["b"]["aten.bmm"] // counts["f"]["aten.bmm"]  # backward runs each S×S matmul twice
    cid = f"{name}-2L-narrow/B{B}S{S}"
    claims.check("flops.counter.forward", component="model", config=cid, variant="hf-moe",
                 predicted=est["counter"]["forward"], measured=fwd.get_total_flops(), unit="FLOP")
    claims.check("flops.counter.backward", component="model", config=cid, variant="hf-moe",
                 predicted=est["counter"]["backward"], measured=bwd.get_total_flops(), unit="FLOP")
    claims.check("flops.model.forward", component="model", config=cid, variant="hf-moe",
                 predicted=est["model"]["forward"], measured=mm["f"] + attn_model, unit="FLOP")
    claims.check("flops.model.backward", component="model", config=cid, variant="hf-moe",
                 predicted=est["model"]["backward"], measured=mm["b"] + ratio * attn_model, unit="FLOP")


def test_window_leaves_pairs_out(tmp_path):
    """The window matters in the reduced gpt-oss (S=16 over a window of 5): fewer model FLOPs than causal
    attention, the same counter FLOPs (the masked scores are still computed)."""
    from llm_anatomy.calculator import estimate

    (tmp_path / "config.json").write_text(json.dumps(reduced(_json("gpt-oss-20b"))))
    cfg, run = read_hf_config(tmp_path).config, Run(B, S, "fp32")
    full = dataclasses.replace(cfg, window=None, window_pattern="all")
    assert estimate(cfg, run).total("flops_model_fwd") < estimate(full, run).total("flops_model_fwd")
    assert estimate(cfg, run).total("flops_counter_fwd") == estimate(full, run).total("flops_counter_fwd")


# ---- the reader ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MOE)
def test_real_config_fields(name):
    d, hf = _json(name), read_hf_config(HF_CONFIGS[name])
    cfg, family = hf.config, d["model_type"]
    assert cfg.experts == d.get("num_experts", d.get("num_local_experts"))
    assert cfg.experts_per_token == d["num_experts_per_tok"]
    assert cfg.expert_intermediate == d.get("moe_intermediate_size", d["intermediate_size"])
    assert cfg.shared_experts == 0 and cfg.head_dim == d.get("head_dim", d["hidden_size"] // d["num_attention_heads"])
    assert cfg.router == ("topk-softmax" if family == "gpt_oss" else "softmax-topk")
    assert cfg.norm_topk == (family == "mixtral" or d.get("norm_topk_prob", False))
    gpt_oss = family == "gpt_oss"
    assert (cfg.router_bias, cfg.expert_bias, cfg.attn_sinks, cfg.o_bias, cfg.qkv_bias) == (gpt_oss,) * 5
    assert cfg.mlp == ("gpt-oss" if gpt_oss else "swiglu")
    assert (cfg.window, cfg.window_pattern) == ((128, "even") if gpt_oss else (None, "all"))
    assert cfg.qk_norm == (family in ("qwen3_moe", "olmoe")) and cfg.qk_norm_whole == (family == "olmoe")
    # the published files leave output_router_logits false: transformers adds no aux loss, and none is counted
    assert not d["output_router_logits"] and cfg.router_aux_coef == 0
    assert any(n.startswith(f"router_aux_loss_coef={d['router_aux_loss_coef']:g} read") for n in hf.notes)


@pytest.mark.parametrize("name", MOE)
def test_aux_coefficient_read_under_output_router_logits(name, tmp_path):
    d = dict(_json(name), output_router_logits=True)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = read_hf_config(tmp_path).config
    assert cfg.router_aux_coef == d["router_aux_loss_coef"] > 0 and cfg.to_dict()["router_aux_coef"] > 0


REFUSALS = [  # (config, field changes, the message's part): one per kind of field not modelled
    ("Qwen3-30B-A3B", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not modelled"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [0, 3]}, "mlp_only_layers=[0, 3] is not modelled"),
    ("Mixtral-8x7B-v0.1", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not modelled"),
    ("OLMoE-1B-7B-0924", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not modelled"),
    ("gpt-oss-20b", {"swiglu_limit": 5.0}, "swiglu_limit=5 is not modelled"),
    ("gpt-oss-20b", {"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types is not modelled"),
    ("gpt-oss-20b", {"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ("gpt-oss-20b", {"layer_types": "sliding"}, "layer_types must be a list"),
    ("Mixtral-8x7B-v0.1", {"num_experts_per_tok": 9}, "experts_per_token=9 is more than experts=8"),
    ("OLMoE-1B-7B-0924", {"num_experts": 0}, "num_experts must be a positive integer"),
    ("Qwen3-30B-A3B", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ("Mixtral-8x7B-v0.1", {"router_aux_loss_coef": -1, "output_router_logits": True},
     "router_aux_loss_coef must be a finite number >= 0"),
]


@pytest.mark.parametrize("name, change, message", REFUSALS, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSALS])
def test_unmodelled_fields_are_refused_in_one_line(name, change, message, tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(_json(name), **change)))
    rc, _, err = run_cli(["estimate", "--hf-config", str(p), "--variant", "baseline"], "moe")
    assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("variant", ["efficient", "baseline"])
def test_moe_attention_fields_are_timed(variant):
    """OLMoE's whole q/k norms and gpt-oss-20b's masked SDPA and sinks are priced (calculator/timing/
    kernels_fields.py): each estimate answers on the H200's datasheet (which prices the masked SDPA at the bf16 peak,
    as its causal SDPA), on the derived H100 and on both packaged calibrations, whose masked-SDPA and sinks' S x S
    rows came with later calibrations of the same GPUs (scripts/supplement_profile.py; a calibration without them
    refuses: test_timing_fields.py)."""
    for gpu in ("H200", "H100", "h200-measured", "h100-measured"):
        for name in ("OLMoE-1B-7B-0924", "gpt-oss-20b"):
            rc, out, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS[name]), "--variant", variant,
                                    "--gpu", gpu, "--json"], "moe")
            assert rc == 0 and json.loads(out)["time"]["step_s"] > 0, (gpu, name, err)


def test_moe_attention_fields_under_recompute_are_estimated():
    """OLMoE's whole q/k norms in its MoE blocks under the efficient recompute: the memory phases model them
    (validations/test_moe_fields_recompute.py), so the per-rank estimate answers."""
    rc, out, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS["OLMoE-1B-7B-0924"]), "--variant", "efficient",
                            "--no-lean", "--recompute", "mlp", "--world-size", "8", "--json"], "moe")
    assert rc == 0, err
    d = json.loads(out)
    assert d["distributed"]["world_size"] == 8 and d["memory"]["phases"]["backward_peak"] > 0


def test_efficient_model_builds_experts():
    cfg = ModelConfig(hidden=16, layers=1, heads=2, intermediate=8, vocab=16, experts=4, experts_per_token=2)
    assert type(build_model(cfg, "efficient", device="meta").layers[0].mlp).__module__ == "llm_anatomy.efficient.moe"


@pytest.mark.parametrize("field", ["attn_sinks", "window", "o_bias", "qk_norm_whole"])
def test_efficient_model_builds_the_attention_fields(field):
    """The efficient model builds gpt-oss's and OLMoE's attention fields, with the baseline's parameter names and
    shapes (validations/test_gptoss_attention.py checks its numbers)."""
    kw = {"attn_sinks": dict(attn_sinks=True), "window": dict(window=4), "o_bias": dict(o_bias=True),
          "qk_norm_whole": dict(qk_norm=True, qk_norm_whole=True)}[field]
    cfg = ModelConfig(hidden=16, layers=1, heads=2, intermediate=8, vocab=16, **kw)
    from llm_anatomy.efficient.transformer import to_baseline_names

    eff, base = build_model(cfg, "efficient", device="meta"), build_model(cfg, "baseline", device="meta")
    shapes = {n: p.shape for n, p in to_baseline_names(dict(eff.named_parameters()), cfg).items()}
    assert shapes == {n: p.shape for n, p in base.named_parameters()}
    assert eff.layers[0].attn.window == (4 if field == "window" else None)


@pytest.mark.parametrize("kw, message", [
    (dict(window_pattern="even"), "window_pattern needs a window"),
    (dict(window=4, window_pattern="odd"), "window_pattern must be one of all, even"),
    (dict(window=0), "window must be a positive integer"),
    (dict(qk_norm_whole=True), "qk_norm_whole needs qk_norm"),
    (dict(attn_sinks=1), "attn_sinks must be true or false"),
])
def test_attention_fields_checked(kw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(hidden=16, layers=1, heads=2, intermediate=8, vocab=16, **kw)


def test_attention_fields_left_out_of_to_dict_when_off():
    d = ModelConfig(hidden=16, layers=1, heads=2, intermediate=8, vocab=16).to_dict()
    assert not {"o_bias", "attn_sinks", "window", "window_pattern", "qk_norm_whole"} & set(d)


def test_estimate_reports_the_routing_it_counts():
    """The MoE blocks' saved bytes are counted under the balanced routing, the worst one (measured exact under
    any routing by test_moe_saved.py); the skewed routing's figure is reported beside it, and is smaller under
    autocast (k experts hit: fewer weight-slice casts kept)."""
    out = estimate_cli(HF_CONFIGS["Mixtral-8x7B-v0.1"], Run(1, 64, "amp"))
    r = out["moe_routing"]
    assert r["histogram"] == "balanced" and r["moe_saved_worst"] == out["memory"]["saved"]["by_component"]["moe"]
    assert 0 < r["moe_saved_skewed"] < r["moe_saved_worst"]


def test_intermediate_flag_refused_for_moe():
    """--intermediate would change no count of a mixture of experts (no layer has the dense MLP): refused."""
    rc, _, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS["Mixtral-8x7B-v0.1"]), "--variant", "baseline",
                          "--intermediate", "1024"], "moe")
    assert rc == 2 and err.count("\n") == 1 and "is a mixture of experts" in err, err
    rc, out, err = run_cli(["estimate", "--hf-config", str(HF_CONFIGS["gpt-oss-20b"]), "--variant", "baseline",
                            "--layers", "2", "--json"], "moe")
    assert rc == 0 and json.loads(out)["config"]["layers"] == 2, err


@pytest.mark.parametrize("name", MOE)
def test_fuzz_moe_config(name, tmp_path_factory):
    """Mutated config.json files of each family (test_fuzz's mutations, over every key the reader reads): one line
    and exit 2, or an estimate whose MoE fields are of their types."""
    from hypothesis import given as given_

    from validations.test_fuzz import _examples, mutated

    base = _json(name)
    keys = [*base, "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise", "clip_qkv", "swiglu_limit",
            "layer_types", "norm_topk_prob", "experts_per_token", "output_router_logits"]

    @_examples(40)
    @given_(raw=mutated(base, keys))
    def one(raw):
        p = tmp_path_factory.mktemp("moe") / "config.json"
        p.write_bytes(raw)
        rc, out, _ = run_cli(["estimate", "--hf-config", str(p), "--variant", "baseline", "--batch", "1", "--seq",
                              "64", "--json"], "config.json")
        d = json.loads(out) if rc == 0 else {}
        if "params_active" in d:  # still a mixture of experts (a mutated model_type may name a dense family)
            c = d["config"]
            assert isinstance(c["experts"], int) and isinstance(c["norm_topk"], bool)
            assert isinstance(c["router_aux_coef"], float) and d["params_active"] <= d["params"]

    one()


def test_the_h100_fields_table_is_the_committed_claims_report():
    """docs/moe.md's table of gpt-oss's and OLMoE's live H100 steps reads reports/h100/claims-gpu-moe-gptoss.json:
    each row's predicted / measured kernel and wall times and the wall error, as committed; the speed-ups and the
    four wall steps predicted on the packaged h100-measured, as the prose quotes them."""
    from llm_anatomy import records
    from llm_anatomy.calculator.timing import estimate_time
    from scripts.probe_moe import cases

    rows = json.loads((records.ROOT / "reports/h100/claims-gpu-moe-gptoss.json").read_text())["rows"]
    doc = (records.ROOT / "docs/moe.md").read_text()
    names = {"gptoss-L2": "gpt-oss-20b, 2 layers", "olmoe-L4": "OLMoE-1B-7B, 4 layers"}
    cfg_run = {cid: cases()[cid][:2] for cid in names}  # the live cases (scripts/probe_moe.py), balanced routing
    walls, errs = {}, []
    claims = ("time.moe.gpu.forward_backward", "time.moe.gpu.step", "time.moe.step")
    for cid, name in names.items():
        for variant in ("efficient", "baseline"):
            got = {r["claim"]: r for r in rows if r["config"] == f"{cid}/balanced (live)" and r["variant"] == variant}
            cells = [f"{got[c]['predicted']:.1f} / {got[c]['measured']:.1f}" for c in claims]
            wall = got["time.moe.step"]
            err = f"{(wall['predicted'] / wall['measured'] - 1) * 100:+.1f}%"
            line = f"| {name} | {variant} | {' | '.join(cells)} | {err} |"
            assert line in doc, line
            walls[(cid, variant)] = wall["measured"]
            pred = estimate_time(cfg_run[cid][0], cfg_run[cid][1], variant, "h100-measured", optimizer="adamw",
                                 with_kernels=False)["steady"]["step_s"] * 1e3
            errs.append(pred / wall["measured"] - 1)
    speed = [walls[(c, "baseline")] / walls[(c, "efficient")] for c in names]
    assert f"is {speed[0]:.1f}x the baseline loop's speed on gpt-oss's shape and\n  {speed[1]:.0f}x on OLMoE's" in doc
    worst = max(abs(e) for e in errs)
    assert f"predicted within {worst:.1%} ({min(errs):+.1%} .. {max(errs):+.1%})" in doc, (worst, errs)


def test_the_h200_fields_prose_is_the_committed_claims_report():
    """docs/moe.md's H200 run of gpt-oss's and OLMoE's live cases quotes reports/h200/claims-gpu-moe-gptoss.json: the
    outcome, the memory figures' worst error (rounded up), the whole OLMoE's backward peak and each wall error."""
    import math

    from llm_anatomy import records

    rep = json.loads((records.ROOT / "reports/h200/claims-gpu-moe-gptoss.json").read_text())
    rows, doc = rep["rows"], " ".join((records.ROOT / "docs/moe.md").read_text().split())
    assert rep["outcome"]["passed"] == 27 and not rep["outcome"]["skipped"] and all(r["passed"] for r in rows)
    memory = [r for r in rows if r["claim"].startswith("memory.")]
    assert f"the 60 memory figures is within {math.ceil(max(abs(r['error']) for r in memory) * 1e4) / 100}%" in doc
    peak = next(r for r in memory if r["config"] == "olmoe/balanced (live)" and "backward" in r["claim"]
                and "peak" in r["claim"])
    assert f"{peak['predicted']:,} B predicted, {peak['measured']:,} measured" in doc
    wall = {(r["config"].split("/")[0], r["variant"]): r["error"] for r in rows if r["claim"] == "time.moe.step"}
    said = {("gptoss-L2", "efficient"): "gpt-oss efficient", ("gptoss-L2", "baseline"): "baseline",
            ("olmoe-L4", "efficient"): "four layers efficient", ("olmoe-L4", "baseline"): "baseline",
            ("olmoe", "efficient"): "OLMoE whole"}
    for key, words in said.items():
        err = wall[key] * 100
        assert f"{words} {err:+.{2 if abs(err) < 0.1 else 1}f}%" in doc, (key, err)


def test_the_bf16_gptoss_bound_in_the_prose_is_the_committed_claims_report():
    """docs/moe.md's "within 0.24%" for gpt-oss-20b on bf16 weights (the expert biases added after the grouped GEMMs)
    is the committed H100 report's largest error over its ten memory claims, rounded up to the stated digits."""
    import math
    import re

    from llm_anatomy import records

    rows = json.loads((records.ROOT / "reports/h100/claims-gpu-moe-bf16.json").read_text())["rows"]
    assert len(rows) == 10 and all(r["passed"] for r in rows)
    worst = max(abs(r["error"]) for r in rows)
    doc = (records.ROOT / "docs/moe.md").read_text()
    stated = float(re.search(r"reads its five\s+phase figures within ([\d.]+)%", doc).group(1))
    assert stated == math.ceil(worst * 1e4) / 100, (stated, worst)
