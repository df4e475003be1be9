"""The phase memory model (llm_anatomy.calculator.memory.phases, device="cpu") against live tensor storage
counted on CPU (llm_anatomy.measure.liveness): forward end, the peak inside backward, backward end and
optimizer end, on the named configs and on hypothesis configs drawn with a fixed seed.

On CPU the figure is tensor-level: exact storage sizes, no allocator rounding and no workspace
inside a kernel. The CUDA side of the same model (512-byte rounding, cuDNN) is checked against the
committed H200 probe in test_memory_model.py. ±3% is the issue's bound for peak memory.
"""
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, seed, settings

from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import Run
from llm_anatomy.measure.liveness import LiveStorage, measure_phases_live
from validations.configs import NAMED, RUNS, configs, runs

TOL = 0.03
# the claim per kind of live storage (llm_anatomy.calculator.backward.KINDS)
PEAK_IN_BACKWARD = {"parameter": "memory.peak in backward: parameter", "input": "memory.peak in backward: input",
                    "optimizer state": "memory.peak in backward: optimizer state",
                    "activation": "memory.peak in backward: activation",
                    "gradient / backward buffer": "memory.peak in backward: gradient / backward buffer"}


def _check(claims, cfg, run, variant, optimizer, config_id):
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, variant, optimizer=optimizer)}
    pred = phases(cfg, run, variant, optimizer=optimizer, device="cpu")
    note = f"predicted peak at {pred['backward_peak_at']}; measured after {meas['backward']['peak_op']}"
    kw = dict(component="model", config=config_id, variant=variant, device="cpu", unit="B")
    # the end-of-phase figures are sums of known tensors: exact
    claims.check("memory.live after forward", predicted=pred["forward_end"], measured=meas["forward"]["allocated"],
                 **kw)
    claims.check("memory.live after backward", predicted=pred["backward_end"],
                 measured=meas["backward"]["allocated"], **kw)
    if optimizer:
        claims.check("memory.live after optimizer step", predicted=pred["optimizer_end"],
                     measured=meas["optimizer"]["allocated"], **kw)
    claims.check("memory.peak in backward", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 tolerance=TOL, note=note, **kw)


@pytest.mark.parametrize("policy", ["amp", "bf16", "fp32"])
@pytest.mark.parametrize("run_id", list(RUNS))
@pytest.mark.parametrize("name", list(NAMED))
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_phases_named(name, run_id, policy, variant, claims):
    r = RUNS[run_id]
    _check(claims, NAMED[name], Run(r.batch, r.seq, policy), variant, None, f"{name}/{run_id}/{policy}")


@pytest.mark.parametrize("policy", ["amp", "bf16", "fp32"])
@pytest.mark.parametrize("run_id", list(RUNS))
@pytest.mark.parametrize("name", list(NAMED))
def test_phases_named_lean(name, run_id, policy, claims):
    """The efficient model's lean block (Run.lean): its adds inside the norms, no saved weight casts, h made
    again in backward."""
    r = RUNS[run_id]
    _check(claims, NAMED[name], Run(r.batch, r.seq, policy, lean=True), "efficient", None,
           f"{name}/{run_id}/{policy}/lean")


@pytest.mark.parametrize("optimizer", ["adamw", "ademamix"])
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_phases_with_optimizer_state(variant, optimizer, claims):
    """Optimizer state lives through every phase of a step after the first; AdamW's moments take the
    parameter's dtype (bf16 here), AdEMAMix keeps fp32."""
    _check(claims, NAMED["tiny-gqa"], Run(2, 16, "bf16"), variant, optimizer, f"tiny-gqa/B2S16/bf16/{optimizer}")


@seed(20261129)
@settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cfg=configs(), run=runs())
def test_phases_hypothesis(cfg, run, claims):
    for variant, r in (("baseline", run), ("efficient", run), ("efficient", replace(run, lean=True))):
        _check(claims, cfg, r, variant, "adamw", f"hypothesis {cfg.to_dict()} {r}")


def _backward_peak_by_kind(snapshot) -> tuple[int, dict]:
    """The last step's peak inside backward in a forensics replay, and what is live there by kind."""
    from collections import defaultdict

    from llm_anatomy.measure.forensics import replay

    r = replay(snapshot)
    total, best, pos = r.pre_existing, -1, -1
    for i, ev in enumerate(r.events):
        total += ev.delta
        if ev.step == r.steps and ev.phase == "backward" and total > best:
            best, pos = total, i
    by = defaultdict(int)
    for a in r.live_at(pos):
        by[a.kind] += a.size
    return best, dict(by)


# one case per regime of where the backward peak sits
REGIMES = {"loss-bound": ("seed-narrow", Run(2, 64)), "attention-bound": ("tiny-gqa", Run(2, 256)),
           "mlp-bound": ("tiny-gqa", Run(4, 96)), "gradient-bound": ("tiny-gptoss-tied", Run(1, 8))}


@pytest.mark.parametrize("policy, optimizer", [("amp", "adamw"), ("bf16", None), ("fp32", "ademamix")])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_backward_peak_composition_matches_forensics(regime, policy, optimizer, variant, claims):
    """What is live at the backward peak, by kind (parameters, inputs, optimizer state, saved
    activations, gradients and backward buffers): the walk's breakdown at its peak stage against
    `anatomy forensics`' attribution of the live storages at the measured peak (CPU)."""
    from llm_anatomy.calculator.backward import KINDS
    from llm_anatomy.measure.liveness import record_step_live

    name, r = REGIMES[regime]
    cfg, run = NAMED[name], Run(r.batch, r.seq, policy)
    pred = phases(cfg, run, variant, optimizer=optimizer, device="cpu")
    # A composition is only comparable where the walk predicts one peak: if a stage with a different
    # make-up (another kind off by more than 3% of the peak) comes within 3% of it, the measured peak
    # may be that one. Stages next to each other in time share their make-up and are no rivals.
    top, mix = pred["backward_peak"], pred["backward_peak_by_kind"]
    rivals = [st["name"] for st in pred["backward_stages"] if st["live"] > (1 - TOL) * top
              and max(abs(st["by_kind"][k] - mix[k]) for k in KINDS) > TOL * top]
    if rivals:
        pytest.skip(f"no single predicted peak: {pred['backward_peak_at']} and {rivals[0]} (another make-up) "
                    f"within {TOL:.0%}")
    total, meas = _backward_peak_by_kind(record_step_live(cfg, run, variant, optimizer))
    assert set(meas) <= set(KINDS) == set(PEAK_IN_BACKWARD), meas
    for kind in KINDS:
        if meas.get(kind, 0) or pred["backward_peak_by_kind"][kind]:
            claims.check(PEAK_IN_BACKWARD[kind], component="model", config=f"{name}/B{r.batch}S{r.seq}/{policy}",
                         variant=variant, predicted=pred["backward_peak_by_kind"][kind], measured=meas.get(kind, 0),
                         tolerance=TOL, device="cpu", unit="B", note=f"peak {total} B; forensics replay on CPU")


def test_live_storage_counts_a_known_sequence():
    """The instrument itself: a view costs nothing, a freed tensor leaves, and the peak is per phase."""
    import torch

    live = LiveStorage()
    with live:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = a.view(10, 100)  # same storage
        c = torch.empty(500, dtype=torch.bfloat16)  # 1000 B
        first = live.phase("one")
        del c
        d = torch.empty(10, dtype=torch.int64)  # 80 B
        second = live.phase("two")
    assert (first["allocated"], first["peak"]) == (5000, 5000)
    assert (second["allocated"], second["peak"]) == (4080, 5000)  # the peak starts at what was live
    del a, b, d
