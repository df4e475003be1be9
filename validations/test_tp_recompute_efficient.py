"""Claims: the efficient variant under tensor parallel (+ sequence parallel) and TP x FSDP2 with activation recompute,
"mlp" and "full" (efficient/attention.py, mlp.py, transformer.py's BlockCheckpoint; the plan of
distributed/tensor_parallel.py's efficient_block_plan), predicted per rank by llm_anatomy.calculator.tensor_parallel
and measured on gloo ranks (distributed.mesh_step).

  gloo, 2 processes    TP 2 on 20 hypothesis-drawn configs and runs, the policies in turn; a TP 2 loss curve per
                       policy against the one-process efficient model with the same policy
  gloo, 4 processes    TP 4, and TP 2 x FSDP 2, on 20 drawn configs and runs each, the policies in turn; a 2 x 2
                       loss curve per policy against one process on both dp ranks' batches
  every rank, every step: params/grads/optimizer bytes, saved bytes per component (the checkpoints' kept residual
  stream on the rank's seq / tp rows), (mesh dim, op, dtype, bytes) -> calls (backward's re-runs gather again)
  live storage         the same draws: forward, backward and optimizer end of the second step exact on every rank
                       (calculator/tp_memory.py)
  fake process group   one rank of a 64-rank mesh per policy: collectives and bytes
The draws are test_tensor_parallel.py's (tp_cases) with a policy. Everything one world size measures (each draw's
step, its phases and the curves) runs in ONE spawn of the one-worker gloo backend that the phases need
(distributed/settled.py); a draw is drawn once and measured by both.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llm_anatomy.config import Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.test_tensor_parallel import (CURVE_CFG, MESHES, N_DRAWS, check_collectives, check_fake_pg,
                                              check_rank_bytes, check_saved, tp_cases)
from validations.train_cases import one_process_losses

VARIANT = "efficient"
POLICIES = ("mlp", "full")
CURVE_TOL = 1e-5  # relative: reduction order only (test_tensor_parallel.py's CURVE_TOL says why)
CURVE = dict(cfg=CURVE_CFG, run=Run(batch=2, seq=16, dtype="fp32"), tp=2, steps=4, lr=1e-2)


def _draws(world: int) -> dict[str, dict]:
    """N_DRAWS cases of each mesh of this world size, the policies taking turns, named "<mesh>-<policy>-<i>", each
    with its dp."""
    out = {}
    for name, tp, dp in MESHES[world]:
        for i, case in enumerate(draw_examples(tp_cases(tp, dp), N_DRAWS, seed_=4850 + 10 * tp + dp)):
            rc = POLICIES[i % len(POLICIES)]
            # one step: the step's records (every collective, the bytes after it, the saved) are step 1's
            out[f"{name}-{rc}-{i}"] = dict(case, run=replace(case["run"], recompute=rc), steps=1, dp=dp)
    return out


def _scenario(**kw):
    """A spawned rank's scenario: mesh_step.train on the efficient variant."""
    from llm_anatomy.distributed.mesh_step import train

    return train(variant=VARIANT, **kw)


def _phase_scenario(case: dict) -> dict:
    """A draw's live-storage run (mesh_peak.tp_peaks): two steps, the second's phases."""
    sc = dict(fn="tp", cfg=case["cfg"], run=case["run"], tp=case["tp"], optimizer=case["optimizer"], variant=VARIANT)
    if case["dp"] > 1:
        sc["reshard_after_forward"] = case["reshard_after_forward"]
    return sc


def _scenarios(world: int) -> dict[str, dict]:
    out = _draws(world)
    dp = world // CURVE["tp"]
    for rc in POLICIES:
        out[f"curve-{rc}"] = dict(CURVE, run=replace(CURVE["run"], recompute=rc), dp=dp)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def mesh_run(request):
    """(world, {name: step scenario}, {name: [records per rank]}, {name: [phases per rank]}): each draw's step and
    its phases, and the curves, from one spawn."""
    from llm_anatomy.distributed.mesh_peak import spawn_mesh_peaks

    world = request.param
    scen = _scenarios(world)
    drawn = _drawn(scen)
    # the phases first, as in a spawn of their own: a fresh process, the first one run twice (spawn_mesh_peaks)
    flat = ([_phase_scenario(sc) for sc in drawn.values()]
            + [dict({k: v for k, v in sc.items() if k != "dp"}, fn=_scenario) for sc in scen.values()])
    res = spawn_mesh_peaks(world, flat)
    phases = {name: [res[r][i] for r in range(world)] for i, name in enumerate(drawn)}
    steps = {name: [res[r][len(drawn) + i] for r in range(world)] for i, name in enumerate(scen)}
    return world, scen, steps, phases


def _drawn(scen: dict) -> dict:
    return {k: v for k, v in scen.items() if not k.startswith("curve")}


@pytest.mark.distributed
def test_tp_recompute_collectives_exact(mesh_run, claims):
    """Every collective of every step on every rank, with the mesh dim it ran on, equals the prediction: the
    re-runs' all-gathers (and under "full" o's reduce-scatter) count again in backward."""
    world, scen, res, _ = mesh_run
    drawn = _drawn(scen)
    assert len(drawn) == N_DRAWS * len(MESHES[world])
    check_collectives(world, drawn, res, claims, VARIANT)


@pytest.mark.distributed
def test_tp_recompute_rank_bytes_exact(mesh_run, claims):
    """Each rank's parameter, gradient and optimizer-state bytes after every step equal the prediction."""
    world, scen, res, _ = mesh_run
    check_rank_bytes(world, _drawn(scen), res, claims, VARIANT)


@pytest.mark.distributed
def test_tp_recompute_saved_bytes_per_component_exact(mesh_run, claims):
    """What each rank's forward saves for backward, per component (local storage), equals tp_saved: the
    checkpoints keep the residual stream (and under "mlp" the attention branch) on the rank's seq / tp rows, and
    what runs outside them as without recompute."""
    world, scen, res, _ = mesh_run
    check_saved(world, _drawn(scen), res, claims, VARIANT)


def _one_process_losses(rc: str, dp: int) -> list[float]:
    """The curve's steps in one process, the efficient model under the same policy: the dp ranks' batches side by
    side, plain AdamW."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    cfg, run = CURVE["cfg"], CURVE["run"]
    model = build_model(cfg, VARIANT, seed=0, recompute=rc)
    batches = [make_batch(cfg, run, seed=1 + r) for r in range(dp)]
    ids, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    opt = make_optimizer("adamw", model.parameters(), CURVE["lr"])
    return one_process_losses(model, opt, ids, targets, CURVE["steps"])


@pytest.mark.distributed
@pytest.mark.parametrize("rc", POLICIES)
def test_tp_recompute_loss_curve_matches_single_process(mesh_run, rc, claims):
    """TP 2 (world 2) and TP 2 x FSDP 2 (world 4), fp32: the TP ranks of a dp rank agree exactly, and the mean over
    the dp ranks equals the one-process efficient model's loss under the same policy within CURVE_TOL, every step."""
    world, _, res, _ = mesh_run
    dp = world // CURVE["tp"]
    single = _one_process_losses(rc, dp)
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    ranks = res[f"curve-{rc}"]
    for step in range(CURVE["steps"]):
        per = [ranks[r][step]["loss"] for r in range(world)]
        assert all(per[2 * d] == per[2 * d + 1] for d in range(dp)), f"TP ranks disagree at step {step + 1}: {per}"
        mesh = sum(per[2 * d] for d in range(dp)) / dp
        claims.check(f"tp (efficient, recompute {rc}) loss vs one process", component="loss",
                     config=CURVE_CFG.name, variant=VARIANT, predicted=single[step], measured=mesh,
                     tolerance=CURVE_TOL, unit="nats", note=f"TP 2 x dp {dp}, fp32, step {step + 1}")


# ---- the memory phases of a step (calculator/tp_memory.py against distributed/mesh_peak.py's live storage) --------
@pytest.mark.distributed
def test_tp_recompute_phase_ends_exact(mesh_run, claims):
    """Forward end, backward end and optimizer end of a step after the first equal tp_phases on every rank: the
    checkpoints' kept residual stream on the rank's rows, the fused tensors' FSDP shards and optimizer state."""
    from llm_anatomy.calculator.tp_memory import tp_phases

    world, scen, _, res = mesh_run
    drawn = _drawn(scen)
    assert len(drawn) == N_DRAWS * len(MESHES[world])
    for name, sc in drawn.items():
        tp = sc["tp"]
        for r in range(world):
            ph = {p["name"]: p for p in res[name][r]}
            pred = tp_phases(sc["cfg"], sc["run"], tp, world // tp, rank=r, optimizer=sc["optimizer"], device="cpu",
                             reshard_after_forward=sc.get("reshard_after_forward", True), variant=VARIANT)
            note = f"tp {tp} x dp {world // tp}: {draw_note(_phase_scenario(sc), rank=r)}"
            for phase, at, measured in (("forward_end_held", "forward end", ph["forward"]["allocated"]),
                                        ("backward_end", "backward end", ph["backward"]["allocated"]),
                                        ("optimizer_end", "optimizer end", ph["zero_grad"]["allocated"])):
                claims.check(f"tp rank {at} bytes (efficient, recompute)", component="memory",
                             config=sc["cfg"].name, variant=VARIANT, predicted=pred[phase], measured=measured,
                             unit="B", note=note)


@pytest.mark.parametrize("rc", POLICIES)
def test_tp_recompute_fake_pg_large_mesh_exact(rc, claims):
    """One rank of a 64-rank mesh (TP 4 x FSDP 16) on the fake process group under each policy: the re-runs'
    collectives and the rank's bytes equal the prediction."""
    check_fake_pg("llama3-8b", 4, 16, 37, claims, VARIANT, run=Run(batch=1, seq=16, dtype="amp", recompute=rc))
