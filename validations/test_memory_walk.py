"""The phase memory model (anatomy.calculator.memory.phases, device="cpu") against live tensor storage
counted on CPU (anatomy.measure.liveness): forward end, the peak inside backward, backward end and
optimizer end, on the named configs and on hypothesis configs drawn with a fixed seed.

On CPU the figure is tensor-level: exact storage sizes, no allocator rounding and no workspace
inside a kernel. The CUDA side of the same model (512-byte rounding, cuDNN) is checked against the
committed H200 probe in test_memory_model.py. ±3% is the issue's bound for peak memory.
"""
import pytest
from hypothesis import HealthCheck, given, seed, settings

from anatomy.calculator.memory import phases
from anatomy.config import Run
from anatomy.measure.liveness import LiveStorage, measure_phases_live
from validations.configs import NAMED, RUNS, configs, runs

TOL = 0.03


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
    for variant in ("baseline", "efficient"):
        _check(claims, cfg, run, variant, "adamw", f"hypothesis {cfg.to_dict()} {run}")


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
