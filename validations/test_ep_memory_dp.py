"""Claims: a rank's memory phases under expert parallel over a sub-group of the data-parallel ranks, ep < world
(the (efsdp, ep) mesh of llm_anatomy/distributed/expert_parallel.py), predicted by llm_anatomy.calculator.ep_memory
(dp = world) vs live storage on settled gloo ranks (llm_anatomy.distributed.mesh_peak.ep_peaks).

  gloo, 4 processes as (efsdp 2, ep 2)   test_ep_memory's drawn configs on the grouped-GEMM path (El = 1 to 4
                            experts per ep rank: the experts' efsdp shards empty, even and uneven), forced routing
                            balanced and skewed, its SETTINGS in turn (bf16, amp; recompute none, mlp and full)
  every rank, the last of two steps, each boundary read settled (distributed/settled.py):
    forward end, backward end and optimizer end exact; the step's peak an upper bound within test_ep_memory's
    EP_PEAK_SLACK (EP_PEAK_SLACK_AMP under amp): these draws, every rank, 1.15x to 1.81x
All draws run in ONE spawn.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from llm_anatomy.calculator.ep_memory import ep_phases
from llm_anatomy.calculator.moe import skewed
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.test_ep_memory import EP_PEAK_SLACK, EP_PEAK_SLACK_AMP, N_DRAWS, SETTINGS, ep_memory_cases

WORLD, EP = 4, 2  # efsdp = 2


@pytest.fixture(scope="module")
def epdp_mem():
    from llm_anatomy.distributed.mesh_peak import spawn_mesh_peaks

    scen = [dict(sc, run=replace(sc["run"], dtype=d, recompute=rc), ep=EP)
            for sc, (d, rc) in zip(draw_examples(ep_memory_cases(EP), N_DRAWS, seed_=5810), SETTINGS * N_DRAWS)]
    return scen, spawn_mesh_peaks(WORLD, scen, fn="ep")


def _pred(sc: dict, r: int) -> dict:
    hist = skewed(sc["cfg"], sc["run"]) if sc["route"] == "skewed" else None
    return ep_phases(sc["cfg"], sc["run"], EP, rank=r, hist=hist, optimizer=sc["optimizer"], device="cpu", dp=WORLD)


@pytest.mark.distributed
def test_epdp_phase_ends_exact_and_peak_a_bound(epdp_mem, claims):
    """Forward end, backward end and optimizer end equal the prediction on every rank; the step's peak is at most
    the prediction, and the prediction at most the slack times it."""
    scen, res = epdp_mem
    assert len(scen) >= N_DRAWS and {sc["route"] for sc in scen} == {"balanced", "skewed"}
    assert {(sc["run"].dtype, sc["run"].recompute) for sc in scen} == set(SETTINGS)
    assert {sc["cfg"].experts // EP for sc in scen} >= {1, 2, 3}  # efsdp shards empty, even, uneven
    for i, sc in enumerate(scen):
        for r in range(WORLD):
            ph = {p["name"]: p for p in res[r][i]}
            pred = _pred(sc, r)
            note = f"efsdp x ep 2 x 2: {draw_note(sc, rank=r)}, route {sc['route']}, R_d {pred['received']}"
            for phase, measured in (("forward_end", ph["forward"]["allocated"]),
                                    ("backward_end", ph["backward"]["allocated"]),
                                    ("optimizer_end", ph["zero_grad"]["allocated"])):
                claims.check(f"ep<dp rank {phase.replace('_', ' ')} bytes", component="memory",
                             config=sc["cfg"].name, variant="efficient", predicted=pred[phase], measured=measured,
                             unit="B", note=note)
            measured = max(p["peak"] for p in res[r][i])
            claims.check("ep<dp rank step peak (upper bound)", component="memory", config=sc["cfg"].name,
                         variant="efficient", predicted=pred["peak"], measured=measured,
                         tolerance=(EP_PEAK_SLACK_AMP if sc["run"].dtype == "amp" else EP_PEAK_SLACK) - 1, unit="B",
                         note=f"{note}; predicted at {pred['peak_at']}")
            assert measured <= pred["peak"], f"{note}: measured {measured} B over the bound {pred['peak']} B"
