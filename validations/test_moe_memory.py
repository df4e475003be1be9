"""The memory phases of a mixture-of-experts model (llm_anatomy.calculator.memory.phases, device="cpu") against
live tensor storage counted on CPU (llm_anatomy.measure.liveness): forward end, backward end and optimizer end
exact, and the peak inside backward exact wherever the walk puts it in an MoE stage (else within the dense stages'
±3%, test_memory_walk.py). Every router is forced (measure/routing.py force()): the balanced routing, calculator/moe.py's default
histogram, or the skewed one (every token to experts 0..k-1), and the phases are given the same histogram.

  efficient  the grouped-GEMM path, plain and lean: the named aligned configs (amp, bf16, with and without AdamW),
             a router-bound config (its peak inside the router's backward), 30 drawn configs (up to 64 experts);
             dropless routing keeps N = T·k rows, so no byte depends on the histogram;
  baseline   the per-expert loop (swiglu, no expert biases) under all three dtype policies: the named configs and
             30 drawn ones; its bytes follow the histogram.
On two gloo ranks (settled), each rank's step peak within 3% of sharding.per_rank_peak: DDP and FSDP over the
baseline block, and FSDP over the efficient block with gpt-oss's expert biases (amp's bf16 gathers and bf16 weights:
the biases added after the grouped GEMMs).
What the phases do not model is refused in one line (the efficient block's loop-of-mm fallback);
test_moe_recompute.py holds the efficient block under recompute, test_moe_memory_bias.py the baseline loop with
expert biases and gpt-oss's activation."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from llm_anatomy.calculator import moe
from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.measure.liveness import measure_phases_live
from llm_anatomy.measure.routing import force
from validations.moe_reference import moe_configs
from validations.test_memory_walk import TOL
from validations.test_moe_efficient import NAMED_MOE

ALIGNED = {n: c for n, c in NAMED_MOE.items() if c.hidden % 8 == 0 and c.expert_intermediate % 8 == 0}
# many experts over a narrow model: the router's (T, E) fp32 gradients outweigh the experts' (the peak's stage)
ROUTER_BOUND = ModelConfig(name="router-bound", hidden=8, layers=2, heads=1, intermediate=16, vocab=32,
                           experts=64, experts_per_token=1, expert_intermediate=8)


def check(claims, cfg: ModelConfig, run: Run, optimizer: str | None, config_id: str, skewed: bool = False,
          variant: str = "efficient"):
    """The phases against the measurement under a forced routing (balanced, or skewed)."""
    route = "skewed" if skewed else "balanced"
    hist = (moe.skewed if skewed else moe.balanced)(cfg, run)
    pred = phases(cfg, run, variant, optimizer=optimizer, device="cpu", hist=hist)
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, variant, optimizer=optimizer, prepare=force(route))}
    kw = dict(component="model", config=config_id + ("/skewed" if skewed else ""), variant=variant,
              device="cpu", unit="B")
    claims.check("memory.live after forward (MoE)", predicted=pred["forward_end"],
                 measured=meas["forward"]["allocated"], **kw)
    # exact where the walk puts the peak in an MoE stage or in attention's re-run (under "full"); elsewhere the
    # dense stages' bound (test_memory_walk.TOL)
    at = pred["backward_peak_at"]
    claims.check("memory.peak in backward (MoE)", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 tolerance=0 if " moe." in at or " recompute attention." in at else TOL,
                 note=f"predicted peak at {at}; measured after {meas['backward']['peak_op']}", **kw)
    claims.check("memory.live after backward (MoE)", predicted=pred["backward_end"],
                 measured=meas["backward"]["allocated"], **kw)
    if optimizer:
        claims.check("memory.live after optimizer step (MoE)", predicted=pred["optimizer_end"],
                     measured=meas["optimizer"]["allocated"], **kw)
    return pred


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
@pytest.mark.parametrize("optimizer", [None, "adamw"])
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", list(ALIGNED))
def test_moe_phases_named(name, policy, optimizer, lean, skewed, claims):
    cfg = ALIGNED[name]
    check(claims, cfg, Run(2, 16, policy, lean=lean), optimizer, f"{name}/B2S16/{policy}/{optimizer}/lean={lean}",
          skewed)


@pytest.mark.parametrize("policy", ["amp", "bf16"])
def test_moe_phases_router_bound(policy, claims):
    """The peak inside the router's backward (top-k's scatter into a zero (T, E) and softmax's gradient)."""
    pred = check(claims, ROUTER_BOUND, Run(4, 64, policy), "adamw", f"router-bound/B4S64/{policy}")
    assert ".router" in pred["backward_peak_at"], pred["backward_peak_at"]


@st.composite
def _cases(draw):
    cfg = replace(draw(moe_configs(max_experts=64, aligned=True)), layers=draw(st.integers(1, 3)))
    policy = draw(st.sampled_from(["amp", "bf16"]))
    run = Run(draw(st.integers(1, 3)), draw(st.integers(2, 48)), policy, lean=draw(st.booleans()))
    return cfg, run, draw(st.sampled_from([None, "adamw"])), draw(st.booleans())


@seed(20261205)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_moe_phases_hypothesis(case, claims):
    cfg, run, optimizer, skewed = case
    check(claims, cfg, run, optimizer, f"hypothesis {cfg.to_dict()} {run}", skewed)


@pytest.mark.parametrize("cfg, run, variant, word", [
    (NAMED_MOE["mixtral-like"], Run(2, 16, "fp32"), "efficient", "loop-of-mm"),
    (NAMED_MOE["odd-widths"], Run(2, 16), "efficient", "loop-of-mm"),
])
def test_refused(cfg, run, variant, word):
    with pytest.raises(ConfigError, match=word) as e:
        phases(cfg, run, variant, device="cpu")
    assert "\n" not in str(e.value)


# ---- the baseline's per-expert loop: its transients follow each expert's rows --------------------------------
BASELINE = {n: c for n, c in NAMED_MOE.items() if not c.expert_bias and c.mlp == "swiglu"}


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("optimizer", [None, "adamw"])
@pytest.mark.parametrize("policy", ["amp", "bf16", "fp32"])
@pytest.mark.parametrize("name", list(BASELINE))
def test_moe_phases_baseline_named(name, policy, optimizer, skewed, claims):
    check(claims, BASELINE[name], Run(2, 16, policy), optimizer, f"{name}/B2S16/{policy}/{optimizer}", skewed,
          "baseline")


@st.composite
def baseline_cases(draw, experts=((False, "swiglu"),)):
    """(config, run, optimizer, skewed) for the baseline loop's phases; experts: the (expert_bias, mlp) pairs drawn."""
    bias, mlp = draw(st.sampled_from(experts))
    cfg = replace(draw(moe_configs(max_experts=32)), layers=draw(st.integers(1, 3)), expert_bias=bias, mlp=mlp)
    run = Run(draw(st.integers(1, 3)), draw(st.integers(2, 32)), draw(st.sampled_from(["amp", "bf16", "fp32"])))
    return cfg, run, draw(st.sampled_from([None, "adamw"])), draw(st.booleans())


@seed(20261206)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=baseline_cases())
def test_moe_phases_baseline_hypothesis(case, claims):
    cfg, run, optimizer, skewed = case
    check(claims, cfg, run, optimizer, f"hypothesis {cfg.to_dict()} {run}", skewed, "baseline")


def test_baseline_peak_follows_the_routing():
    """The calculator reports the baseline's peak under each histogram: the skewed routing (k experts, every
    token each) keeps fewer experts' tensors but gives each one T rows of transients."""
    cfg, run = BASELINE["mixtral-like"], Run(4, 64)
    bal, skw = (phases(cfg, run, "baseline", device="cpu", hist=h(cfg, run))["backward_peak"]
                for h in (moe.balanced, moe.skewed))
    assert bal != skw


# ---- per-rank peaks on 2 gloo ranks (validations/test_distributed.py's harness, which builds the baseline) --------
# experts == experts_per_token: every token reaches every expert, so each expert has T rows under any routing and
# the live run's histogram is the calculator's balanced one
GLOO_MOE = ModelConfig(name="dist-peak-moe", hidden=48, layers=2, heads=4, kv_heads=2, intermediate=32, vocab=64,
                       experts=2, experts_per_token=2, expert_intermediate=256, shared_experts=1,
                       shared_intermediate=16)
# gpt-oss's activation, router and expert biases over two wide experts: the efficient block under FSDP2 computes on
# its bf16 gathers (amp) or bf16 weights, so the biases are added after the grouped GEMMs (efficient/moe.py ExpertBias)
GLOO_GPTOSS = ModelConfig(name="dist-peak-gptoss", hidden=48, layers=2, heads=4, kv_heads=2, intermediate=32,
                          vocab=64, mlp="gpt-oss", experts=2, experts_per_token=2, expert_intermediate=256,
                          router="topk-softmax", expert_bias=True)
# FSDP's collective buffers are read settled (spawn_peaks: distributed/settled.py); DDP's buckets live the whole step
GLOO_SCENARIOS = {"ddp-fp32-moe": dict(cfg=GLOO_MOE, run=Run(batch=2, seq=32, dtype="fp32"), strategy="ddp", steps=3),
                  "fsdp-amp-moe": dict(cfg=GLOO_MOE, run=Run(batch=2, seq=32, dtype="amp"), strategy="fsdp", steps=2),
                  **{f"fsdp-{d}-gptoss-efficient": dict(cfg=GLOO_GPTOSS, run=Run(batch=2, seq=32, dtype=d),
                                                        strategy="fsdp", steps=2, variant="efficient")
                     for d in ("amp", "bf16")}}


@pytest.fixture(scope="module")
def gloo_moe_peaks():
    from llm_anatomy.distributed.settled import spawn_peaks

    results = spawn_peaks(2, list(GLOO_SCENARIOS.values()))
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(GLOO_SCENARIOS)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(GLOO_SCENARIOS))
def test_gloo_moe_per_rank_peak(gloo_moe_peaks, name, claims):
    """Each rank's largest live storage over a step after the first against sharding.per_rank_peak, within the
    per-rank claim's 3% (test_distributed.test_gloo_per_rank_peak)."""
    from validations.test_distributed import check_rank_peaks

    check_rank_peaks(claims, GLOO_SCENARIOS[name], gloo_moe_peaks[name], name,
                     "per-rank step peak with activations and FSDP buffers (MoE)")


def test_the_instrument_sums_expert_gradients_out_of_place():
    """What backward.Walk.input_buffer_sum models per device. Each slice W[e] of a stacked leaf sends a whole-size
    gradient to one autograd InputBuffer. A plain run adds each later one into the first in place, as on CUDA: the
    gradient W ends with has taken E - 1 in-place adds (its version counter). Under a TorchDispatchMode (one that
    only calls each op, or the live-storage instrument the CPU claims are read with) every add is out of place
    (ATen's isTensorSubclassLike is true for any tensor while a mode is active): the gradient is the last sum, a
    new tensor that no in-place op has touched, which is what the CPU walk counts."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from llm_anatomy.measure.liveness import LiveStorage

    class Bare(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    E = 4

    def adds_in_place(mode) -> int:
        g = torch.Generator().manual_seed(0)
        W = torch.randn(E, 16, 8, generator=g, requires_grad=True)
        x, out = torch.randn(8, 8, generator=g), 0
        for e in range(E):
            out = out + (x @ W[e].t()).square().sum()
        with mode:
            out.backward()
        return W.grad._version

    assert adds_in_place(contextlib.nullcontext()) == E - 1
    assert adds_in_place(Bare()) == 0
    assert adds_in_place(LiveStorage()) == 0
