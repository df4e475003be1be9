"""Claims: gpt-oss's attention fields (sinks, a sliding window on all or the even layers, o bias, q/k/v bias) and
OLMoE's whole q/k norms in the efficient model's mixture-of-experts blocks under Run.recompute "mlp" and "full", on
CPU against the live storage (llm_anatomy.measure.liveness) under a forced routing (balanced, skewed):

  - the memory phases (calculator/memory.py): forward end, backward end and optimizer end exact; the peak inside
    backward exact where the walk puts it in an MoE stage or in attention's re-run (test_moe_memory.check), else
    within test_memory_walk's ±3%;
  - the largest moment inside the last layer's checkpoint in forward (the MoE half under "mlp": moe_region.py with
    every bias cast autocast caches; the whole block under "full": attention_region.py's replay, with the masks the
    forward's shared masks hold) and inside the last layer's re-run in backward (the MoE half; under "full" the
    attention half too), exact;
  - the timing kernel list re-runs the MoE block's forward kernels in backward as without the fields
    (test_moe_recompute.check_moe_rerun_kernels; the fields' own attention kernels: test_timing_fields.py).
On named reduced gpt-oss-like and OLMoE-like configs three layers deep (amp and bf16: without autocast gpt-oss's
expert biases are added after the grouped GEMMs; fp32's loop of mm is refused in one line), and on 20 drawn configs
with the fields per policy.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from llm_anatomy.calculator import memory, moe
from llm_anatomy.calculator.moe import refuse_phases
from llm_anatomy.config import ConfigError, ModelConfig, Run
from validations.moe_reference import moe_configs
from validations.test_gptoss_attention import attention_configs
from validations.test_moe_memory import check
from validations.test_moe_recompute import _peaks_inside, _region_predicted, check_moe_rerun_kernels
from validations.test_recompute_full import _peaks_inside as _attention_peaks

POLICIES = ("mlp", "full")
GPTOSS = dict(heads=8, kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True, attn_sinks=True, window=5,
              window_pattern="even", mlp="gpt-oss", router="topk-softmax", router_bias=True, router_aux_coef=0.02)
NAMED = {  # gpt-oss-20b's and OLMoE-1B-7B's attention and routers over narrow experts (validations/test_moe.reduced)
    "gptoss-moe": ModelConfig(name="gptoss-moe", hidden=64, layers=3, intermediate=32, vocab=128, experts=4,
                              experts_per_token=2, expert_intermediate=16, expert_bias=True, **GPTOSS),
    # without expert biases: the grouped GEMM under bf16 too
    "gptoss-moe-nobias": ModelConfig(name="gptoss-moe-nobias", hidden=64, layers=3, intermediate=32, vocab=128,
                                     experts=4, experts_per_token=2, expert_intermediate=16, **GPTOSS),
    "olmoe-moe": ModelConfig(name="olmoe-moe", hidden=64, layers=3, heads=4, head_dim=16, intermediate=32, vocab=128,
                             qk_norm=True, qk_norm_whole=True, experts=8, experts_per_token=2, expert_intermediate=16,
                             norm_topk=False, router_aux_coef=0.01),
}
# attention_configs' fields a drawn MoE config takes
ATTENTION = ("hidden", "heads", "kv_heads", "head_dim", "qkv_bias", "o_bias", "attn_sinks", "window", "window_pattern",
             "qk_norm", "qk_norm_whole")
# long sequences over narrow models: attention's tensors weigh most (under "full" with sinks the backward peak is in
# attention's re-run; OLMoE's under "mlp" in its whole k_norm's backward)
ATTENTION_BOUND = {
    "gptoss-moe-attn-bound": ModelConfig(name="gptoss-moe-attn-bound", hidden=32, layers=3, intermediate=32, vocab=16,
                                         experts=2, experts_per_token=1, expert_intermediate=8,
                                         **{**GPTOSS, "head_dim": 8}),
    "olmoe-moe-attn-bound": ModelConfig(name="olmoe-moe-attn-bound", hidden=32, layers=3, heads=4, intermediate=32,
                                        vocab=16, qk_norm=True, qk_norm_whole=True, window=7, experts=2,
                                        experts_per_token=1, expert_intermediate=8),
}
RUNS = {**{n: Run(2, 16) for n in NAMED}, **{n: Run(1, 128) for n in ATTENTION_BOUND}}
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _inside(claims, cfg: ModelConfig, run: Run, config_id: str, attention: bool = True) -> None:
    """The largest moments inside the last layer's checkpoint in forward and inside its re-run in backward, exact
    (attention: under "full" its attention re-run's too, a step measured apart)."""
    meas = _peaks_inside(cfg, run)
    pred = memory.phases(cfg, run, "efficient", device="cpu", hist=moe.balanced(cfg, run))
    stage = {s["name"]: s["live"] for s in pred["backward_stages"]}
    last = f"layer {cfg.layers - 1} "
    kw = dict(component="model", config=config_id, variant="efficient", device="cpu", unit="B")
    claims.check("memory.live at the peak inside the last layer's checkpoint in forward (MoE, attention fields)",
                 predicted=_region_predicted(cfg, run, pred), measured=meas["forward"]["peak"],
                 note=f"measured after {meas['forward']['peak_op']}", **kw)
    claims.check("memory.live at the peak inside a layer's re-run in backward (MoE, attention fields)",
                 predicted=stage[last + "recompute moe"], measured=meas["rerun"]["peak"],
                 note=f"measured after {meas['rerun']['peak_op']}", **kw)
    if run.recompute == "full" and attention:
        rerun = _attention_peaks(cfg, run)["rerun"]
        predicted = max(v for k, v in stage.items() if k.startswith(last + "recompute attention."))
        claims.check("memory.live at the peak inside a layer's attention re-run in backward (MoE, attention fields)",
                     predicted=predicted, measured=rerun["peak"], note=f"measured after {rerun['peak_op']}", **kw)


def _named_cases():
    for name, cfg in {**NAMED, **ATTENTION_BOUND}.items():
        for policy in ("amp", "bf16"):
            for recompute in POLICIES:
                for skewed in (False, True) if name in NAMED else (False,):
                    yield pytest.param(name, policy, recompute, skewed,
                                       id=f"{name}-{policy}-{recompute}-{'skewed' if skewed else 'balanced'}")


@pytest.mark.parametrize("name, policy, recompute, skewed", list(_named_cases()))
def test_named_phases_and_peaks_inside(name, policy, recompute, skewed, claims):
    cfg, run = {**NAMED, **ATTENTION_BOUND}[name], replace(RUNS[name], dtype=policy, recompute=recompute)
    config_id = f"{name}/B{run.batch}S{run.seq}/{policy}/recompute={recompute}"
    pred = check(claims, cfg, run, "adamw", config_id + "/adamw", skewed)
    if name == "gptoss-moe-attn-bound" and (policy, recompute) == ("bf16", "full"):
        assert " recompute attention." in pred["backward_peak_at"], pred["backward_peak_at"]
    if not skewed:  # the regions' bytes follow no routing (dropless: T·k rows)
        _inside(claims, cfg, run, config_id)
        check_moe_rerun_kernels(cfg, replace(run, batch=2, seq=64))


def test_the_loop_of_mm_refused_in_one_line():
    """fp32 takes the efficient block's loop of mm, whose walk is not written: refused in one line naming it,
    under either policy."""
    for recompute in POLICIES:
        with pytest.raises(ConfigError, match="loop-of-mm") as e:
            refuse_phases(NAMED["gptoss-moe"], Run(2, 16, "fp32", recompute=recompute), "efficient", device="cpu")
        assert "\n" not in str(e.value)


def _cases(recompute: str):
    @st.composite
    def cases(draw):
        """An MoE config (moe_configs: every router, activation and bias) with drawn attention fields
        (attention_configs: sinks, a window on all or the even layers, o and qkv biases, q/k norms per head or
        whole, GQA), one to three layers."""
        a, m = draw(attention_configs()), draw(moe_configs(max_experts=16, aligned=True))
        cfg = replace(m, name="hypothesis-moe-fields", layers=draw(st.integers(1, 3)),
                      **{f: getattr(a, f) for f in ATTENTION})
        policy = draw(st.sampled_from(["amp", "bf16"]))
        run = Run(draw(st.integers(1, 2)), draw(st.integers(4, 32)), policy, recompute=recompute)
        return cfg, run, draw(st.sampled_from([None, "adamw"])), draw(st.booleans())
    return cases()


def _drawn(claims, case) -> None:
    cfg, run, optimizer, skewed = case
    config_id = f"hypothesis {cfg.to_dict()} {run}"
    check(claims, cfg, run, optimizer, config_id, skewed)
    _inside(claims, cfg, run, config_id, attention=False)  # the named configs hold attention's re-run


@seed(20261209)
@settings(max_examples=20, **SETTINGS)
@given(case=_cases("mlp"))
def test_mlp_hypothesis(case, claims):
    _drawn(claims, case)


@seed(20261210)
@settings(max_examples=20, **SETTINGS)
@given(case=_cases("full"))
def test_full_hypothesis(case, claims):
    _drawn(claims, case)
