"""Claims: the baseline's per-expert loop (baseline/moe.py) with expert biases and with gpt-oss's activation
(silu(clamp(gate)) * (clamp(up) + 1)), in the memory phases (calculator/memory.py, its backward walk
calculator/backward_moe_baseline.py) on CPU against the live storage (llm_anatomy.measure.liveness), under a forced
routing (measure/routing.py: balanced, skewed) and the same histogram given to the phases: forward end, backward end
and optimizer end exact, the peak inside backward exact wherever the walk puts it in an MoE stage (else the dense
stages' ±3%, test_memory_walk.py), under all three dtype policies, on named configs and 30 drawn ones; and the timing
kernel list's clamps and bias kernels per expert with rows. Configs carry none of gpt-oss's attention fields (sinks,
windows, o bias: another scope's)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, seed, settings

from llm_anatomy.calculator import moe
from llm_anatomy.calculator.timing.kernels_baseline import baseline_kernels
from llm_anatomy.config import Run
from validations.test_moe_efficient import NAMED_MOE
from validations.test_moe_memory import baseline_cases, check

MIXTRAL = NAMED_MOE["mixtral-like"]
NAMED = {"gptoss-like": NAMED_MOE["gptoss-like"],  # biases, gpt-oss's activation, top-k then softmax, the balance loss
         "odd-widths": NAMED_MOE["odd-widths"],  # biases, widths not multiples of 8, a shared expert
         "mixtral-gpt-oss": replace(MIXTRAL, name="mixtral-gpt-oss", mlp="gpt-oss"),
         "mixtral-bias": replace(MIXTRAL, name="mixtral-bias", expert_bias=True)}


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("policy", ["amp", "bf16", "fp32"])
@pytest.mark.parametrize("name", list(NAMED))
def test_moe_phases_baseline_bias_named(name, policy, skewed, claims):
    check(claims, NAMED[name], Run(2, 16, policy), "adamw", f"{name}/B2S16/{policy}/adamw", skewed, "baseline")


@seed(20261209)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=baseline_cases([(True, "swiglu"), (False, "gpt-oss"), (True, "gpt-oss")]))
def test_moe_phases_baseline_bias_hypothesis(case, claims):
    cfg, run, optimizer, skewed = case
    check(claims, cfg, run, optimizer, f"hypothesis {cfg.to_dict()} {run}", skewed, "baseline")


@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("hist", ["balanced", "skewed"])
def test_baseline_loop_kernels_clamps_and_biases(hist, policy):
    """Per expert with rows, once per layer: gpt-oss's clamp chain forward and backward, each bias slice's cast
    (amp), its gradient's row sum, its slice's backward into a zero (E, width) and the sum into the stacked bias
    gradient; addmm reads the bias: its forward bytes exceed the unbiased matmul's by the bias's."""
    cfg = NAMED["gptoss-like"]
    run = Run(2, 64, policy)
    h = getattr(moe, hist)(cfg, run)
    hit = sum(1 for n in h if n) * cfg.layers
    ks = baseline_kernels(cfg, run, hist=h)
    count = lambda name: sum(k.count for k in ks if k.name == name)  # noqa: E731
    plain = baseline_kernels(replace(cfg, expert_bias=False, mlp="swiglu"), run, hist=h)
    for w in ("gate_up", "down"):
        n = f"moe.expert.{w}"
        expected = {f"{n}.grad_bias": hit, f"{n}.bias_select_backward": hit, f"{n}.bias_grad_sum": hit}
        expected |= {f"{n}.bias_cast": hit, f"{n}.grad_bias_cast": hit} if policy == "amp" else {}
        assert {k: count(k) for k in expected} == expected
        if policy != "amp":
            assert count(f"{n}.bias_cast") == 0
        width = 2 * cfg.expert_intermediate if w == "gate_up" else cfg.hidden
        fwd = {k.shape: k.bytes for k in ks if k.name == n}
        assert fwd and all(b - next(p.bytes for p in plain if p.name == n and p.shape == s) == width * 2
                           for s, b in fwd.items())
    clamps = [k for k in ks if k.name.startswith("moe.expert.clamp_")]
    # forward: the two clamps (and the +1); backward: gate's mask and where, up's two masks, their and, its where
    assert {k.phase for k in clamps} == {"forward", "backward"} and sum(k.count for k in clamps) == 8 * hit
    assert count("moe.expert.add_one") == hit
    assert not any(k.name.startswith("moe.expert.clamp_") for k in plain)
