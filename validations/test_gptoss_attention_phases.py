"""The memory phases (calculator/memory.py) of both variants with gpt-oss's attention fields (sinks, sliding windows,
o bias) and OLMoE's whole q/k norms, against the live storage on CPU (llm_anatomy.measure.liveness, the method of
test_memory_walk.py): forward end, backward end and the optimizer's end exact, the peak inside backward within
test_memory_walk's ±3% and, for the baseline on attention-bound shapes (the peak in the softmax's backward, where
the sinks widen it), exact. Named reduced shapes of gpt-oss's and OLMoE's attention (dense, and gpt-oss's attention
over swiglu experts without expert biases: the MoE block's own refusals are another part's), and 20 drawn configs;
the efficient model under its recompute policies ("mlp", "full") on 20 drawn dense configs (ends exact, peak ±3%)
and on the attention-bound shapes (exact).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.liveness import measure_phases_live
from validations.configs import POLICIES
from validations.test_gptoss_attention import attention_configs
from validations.test_memory_walk import _check

GPTOSS = dict(heads=8, kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True, attn_sinks=True, window=5,
              window_pattern="even")
NAMED = {  # gpt-oss-20b's and OLMoE-1B-7B's attention, narrow (validations/test_moe.reduced's widths)
    "gptoss-attn": ModelConfig(name="gptoss-attn", hidden=64, layers=3, intermediate=32, vocab=128, **GPTOSS),
    "gptoss-attn-moe": ModelConfig(name="gptoss-attn-moe", hidden=64, layers=2, intermediate=32, vocab=128,
                                   experts=4, experts_per_token=2, router="topk-softmax", router_bias=True, **GPTOSS),
    "olmoe-attn": ModelConfig(name="olmoe-attn", hidden=64, layers=2, heads=4, head_dim=16, intermediate=32,
                              vocab=128, qk_norm=True, qk_norm_whole=True),
}
# the peak in attention's backward: a long sequence over a narrow model and a tiny vocabulary
ATTENTION_BOUND = {
    "gptoss-attn-bound": ModelConfig(name="gptoss-attn-bound", hidden=32, layers=3, heads=8, kv_heads=2, head_dim=8,
                                     intermediate=32, vocab=16, qkv_bias=True, o_bias=True, attn_sinks=True, window=5,
                                     window_pattern="even"),
    "olmoe-attn-bound": ModelConfig(name="olmoe-attn-bound", hidden=32, layers=2, heads=4, kv_heads=2,
                                    intermediate=32, vocab=16, qk_norm=True, qk_norm_whole=True, window=7),
}


def _cases():
    for name, cfg in NAMED.items():
        for variant in ("baseline", "efficient"):
            for policy in POLICIES:
                if cfg.moe and variant == "efficient" and policy == "fp32":
                    continue  # the grouped-GEMM path runs under amp and bf16 (calculator/moe.py refuses the rest)
                yield name, variant, policy


@pytest.mark.parametrize("name, variant, policy", list(_cases()))
def test_phases_named(name, variant, policy, claims):
    _check(claims, NAMED[name], Run(2, 16, policy), variant, "adamw", f"{name}/B2S16/{policy}/adamw")


@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", ["gptoss-attn", "olmoe-attn"])
def test_phases_lean_block(name, policy, claims):
    """The efficient model's lean block (Run.lean): o a lean matmul over the sinks' merged copy, the adds inside the
    norms."""
    _check(claims, NAMED[name], Run(2, 16, policy, lean=True), "efficient", "adamw", f"{name}/B2S16/{policy}/lean")


def test_recompute_in_moe_block_modelled():
    """Under recompute the fields are modelled in mixture-of-experts blocks too (validations/test_moe_fields_recompute.py
    checks them), expert biases under bf16 too; fp32 takes the loop of mm, refused in one line."""
    from dataclasses import replace

    from llm_anatomy.calculator.moe import refuse_phases
    from llm_anatomy.config import ConfigError

    for recompute in ("mlp", "full"):
        refuse_phases(NAMED["gptoss-attn-moe"], Run(2, 16, "amp", recompute=recompute), "efficient", device="cpu")
    biased = replace(NAMED["gptoss-attn-moe"], expert_bias=True)
    refuse_phases(biased, Run(2, 16, "bf16", recompute="mlp"), "efficient", device="cpu")
    with pytest.raises(ConfigError, match="loop-of-mm") as e:
        refuse_phases(biased, Run(2, 16, "fp32", recompute="mlp"), "efficient", device="cpu")
    assert "\n" not in str(e.value)


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cfg=attention_configs(), policy=st.sampled_from(POLICIES), batch=st.integers(1, 2), seq=st.integers(4, 40),
       recompute=st.sampled_from(["mlp", "full"]))
def test_phases_recompute_hypothesis(cfg, policy, batch, seq, recompute, claims):
    """The efficient model under its recompute policies, 20 drawn configs with the fields: "mlp" re-runs the norm
    before qkv (attention keeps the forward's shared masks), "full" the whole block in backward, outside the
    forward's shared masks (each re-run builds its layer's mask again). The phase ends exact, the backward peak
    within test_memory_walk's ±3%."""
    run = Run(batch, seq, policy, recompute=recompute)
    _check(claims, cfg, run, "efficient", "adamw", f"hypothesis {cfg.to_dict()} {run}/efficient")


@pytest.mark.parametrize("recompute", ["mlp", "full"])
@pytest.mark.parametrize("name", ATTENTION_BOUND)
def test_recompute_attention_bound_exact(name, recompute, claims):
    """Long sequences over narrow models under recompute, where attention's tensors weigh most: ends and the backward
    peak exact (under "full" with sinks the peak is the re-run's o, while rope_qkv's q, k, v are locals beside
    SDPA's padded copies, with every later layer's bias and sink gradients)."""
    cfg, run = ATTENTION_BOUND[name], Run(1, 128, "fp32", recompute=recompute)
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer="adamw")}
    pred = phases(cfg, run, "efficient", optimizer="adamw", device="cpu")
    note = f"predicted peak at {pred['backward_peak_at']}; measured after {meas['backward']['peak_op']}"
    for claim, predicted, measured in (("memory.live after forward", pred["forward_end"], meas["forward"]["allocated"]),
                                       ("memory.live after backward", pred["backward_end"],
                                        meas["backward"]["allocated"]),
                                       ("memory.peak in backward", pred["backward_peak"], meas["backward"]["peak"])):
        claims.check(claim, predicted=predicted, measured=measured, component="model", variant="efficient",
                     config=f"{name}/B1S128/fp32/{recompute}", unit="B", note=note)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ATTENTION_BOUND)
def test_baseline_attention_bound_peak_exact(name, policy, claims):
    """The baseline's backward peak in the softmax of the last layer, with the sinks' wider rows, o's bias gradient
    and the window's mask: exact, and the phase ends exact."""
    cfg, run = ATTENTION_BOUND[name], Run(1, 96, policy)
    _check(claims, cfg, run, "baseline", "adamw", f"{name}/B1S96/{policy}/adamw")
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "baseline", optimizer="adamw")}
    pred = phases(cfg, run, "baseline", optimizer="adamw", device="cpu")
    assert pred["backward_peak_at"].endswith("attention.softmax")
    claims.check("memory.peak in backward", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 component="model", config=f"{name}/B1S96/{policy}", variant="baseline", unit="B")


@pytest.mark.parametrize("policy", POLICIES)
def test_efficient_attention_bound_sinks(policy, claims):
    """The efficient model where its backward peak is SDPA's (the sinks' padded gradients): ends exact, peak ±3%."""
    _check(claims, ATTENTION_BOUND["gptoss-attn-bound"], Run(1, 128, policy), "efficient", "adamw",
           f"gptoss-attn-bound/B1S128/{policy}/adamw")


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cfg=attention_configs(), policy=st.sampled_from(POLICIES), batch=st.integers(1, 2), seq=st.integers(4, 40))
def test_phases_hypothesis(cfg, policy, batch, seq, claims):
    """20 drawn configs (sinks on or off, a window on all or the even layers, o bias, q/k norms per head or whole),
    both variants: the phase ends exact, the backward peak ±3%."""
    run = Run(batch, seq, policy)
    for variant in ("baseline", "efficient"):
        _check(claims, cfg, run, variant, "adamw", f"hypothesis {cfg.to_dict()} {run}/{variant}")


@pytest.mark.parametrize("recompute", ["none", "mlp", "full"])
@pytest.mark.parametrize("policy", ["fp32", "amp"])
@pytest.mark.parametrize("pattern, sinks", [("all", False), ("all", True), ("even", False), ("even", True)])
def test_efficient_shared_masks_deep_exact(pattern, sinks, policy, recompute, claims):
    """Six layers over a wide vocabulary, where the backward peak is the embedding's (or the final norm's): the
    forward's masks are shared by every layer of a kind and freed with the first such layer's SDPA node (under
    "full" each re-run builds its own), so the peak at the end of backward holds every gradient and no mask: exact."""
    cfg = ModelConfig(name="deep-masks", hidden=32, layers=6, heads=8, kv_heads=2, head_dim=8, intermediate=32,
                      vocab=4096, qkv_bias=True, o_bias=True, attn_sinks=sinks, window=5, window_pattern=pattern)
    run = Run(1, 64, policy, recompute=recompute)
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer="adamw")}
    pred = phases(cfg, run, "efficient", optimizer="adamw", device="cpu")
    assert pred["backward_peak_at"] in ("embedding", "final norm"), pred["backward_peak_at"]
    claims.check("memory.peak in backward", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 component="model", variant="efficient", unit="B", config=f"deep-masks/{pattern}/sinks={sinks}/"
                 f"B1S64/{policy}/{recompute}", note=f"measured after {meas['backward']['peak_op']}")
