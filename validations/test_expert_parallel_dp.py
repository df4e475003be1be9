"""Claims: expert parallel over a sub-group of the data-parallel ranks, ep < world (llm_anatomy/distributed/
expert_parallel.py's (efsdp, ep) mesh: the experts split over ep, each ep rank's experts FSDP2-sharded over efsdp,
FSDP2 over every rank on the rest), predicted per rank by llm_anatomy.calculator.expert_parallel (world=...).

  gloo, 4 processes as (efsdp 2, ep 2)   hypothesis-drawn MoE configs (test_expert_parallel's ep_cases: El = 1..4
                            experts per ep rank, so efsdp's dim-0 shards are even, uneven and empty), forced routing
                            balanced and skewed in turn, in the fp32 and bf16 policies without recompute, and the
                            other policies in turn (recompute mlp and full in fp32 and bf16; amp under each
                            recompute): every collective of both steps on every rank (the all-to-alls over ep, the
                            experts' all-gathers and reduce-scatters over efsdp, FSDP2's over all four), each rank's
                            parameter/gradient/optimizer bytes after each step and what its forward saves per
                            component equal the prediction exactly; the loss and every gradient of one step equal
                            one process's on the same global batch (test_expert_parallel's GRAD_TOL in fp32, its
                            AMP_FLOOR rule under amp), the experts' gradients the same on every efsdp rank
  fake process group, 256 ranks as (efsdp 4, ep 64)   Qwen3-30B-A3B (validations/hf_configs.py), one rank: its
                            parameter bytes, and the bytes of one experts all-gather (over efsdp) and one Block's
                            (over every rank), exactly as predicted
All gloo scenarios run in ONE spawn.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from llm_anatomy.calculator import expert_parallel as ep_calc
from llm_anatomy.config import ConfigError, Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.test_expert_parallel import (GRAD_CFGS, GRAD_RUN, GRAD_RUNS, POLICIES, _draws, _ep_grad, _hist,
                                              _scenario, check_amp_vs_float64, check_vs_one_process, ep_cases)

WORLD, EP = 4, 2  # efsdp = 2
N_DRAWS = 20  # fp32 / bf16 without recompute
N_POLICY_DRAWS = 2 * len(POLICIES)  # each other (dtype, recompute) pair twice
ROUTES = ("balanced", "skewed")
# one expert per ep rank: efsdp rank 1's shard is empty (FSDP2 pads it to the chunk of one row); fp32 only (the amp
# rule needs GRAD_CFGS' float64-stable routing)
PAD_CFG = replace(GRAD_CFGS[0], name="epdp-grad-pad", experts=2, experts_per_token=1)


def _scenarios() -> dict[str, dict]:
    out = {f"draw-{i}": dict(c, route=ROUTES[i % 2], ep=EP)
           for i, c in enumerate(draw_examples(ep_cases(EP), N_DRAWS, seed_=5800))}
    for i, c in enumerate(draw_examples(ep_cases(EP), N_POLICY_DRAWS, seed_=5900)):
        d, r = POLICIES[i % len(POLICIES)]
        out[f"draw-policy-{i}"] = dict(c, run=replace(c["run"], dtype=d, recompute=r),
                                       route=ROUTES[i // len(POLICIES) % 2], ep=EP)
    out.update({f"grads-{c.name}-{p}": dict(kind="grads", cfg=c, run=run, ep=EP) for c in GRAD_CFGS
                for p, run in GRAD_RUNS.items()})
    out[f"grads-{PAD_CFG.name}-fp32-none"] = dict(kind="grads", cfg=PAD_CFG, run=GRAD_RUN, ep=EP)
    return out


@pytest.fixture(scope="module")
def epdp_run():
    from llm_anatomy.distributed.train_step import spawn_named

    scen = _scenarios()
    return scen, spawn_named(WORLD, scen, fn=_scenario)


@pytest.mark.distributed
def test_epdp_collectives_bytes_and_saved_exact(epdp_run, claims):
    """Per draw and rank: every collective of each step, the parameter, gradient and optimizer bytes after each
    step, and the forward's saved bytes per component, each equal to the prediction."""
    scen, res = epdp_run
    draws = _draws(scen)
    assert len(draws) >= N_DRAWS + N_POLICY_DRAWS
    assert {(sc["run"].dtype, sc["run"].recompute) for sc in draws.values()} >= set(POLICIES)
    assert {sc["route"] for sc in draws.values()} == set(ROUTES)
    assert {sc["cfg"].experts // EP for sc in draws.values()} >= {1, 2, 3}  # efsdp shards empty, even, uneven
    for name, sc in draws.items():
        cfg, run = sc["cfg"], sc["run"]
        for r in range(WORLD):
            coll = ep_calc.counts(cfg, run, EP, r, _hist(sc), world=WORLD)
            mem = ep_calc.rank_memory(cfg, run, EP, r, sc["optimizer"], world=WORLD)
            for rec in res[name][r]:
                meas = {tuple(k): n for *k, n in rec["collectives"]}
                note = f"{name}: {draw_note(sc, rank=r, step=rec['step'])}, route {sc['route']}, efsdp x ep 2 x 2"
                claims.check("ep<dp collective calls per step", component="comm", config=cfg.name,
                             variant="efficient", predicted=sum(coll.values()), measured=sum(meas.values()),
                             unit="calls", note=note)
                assert meas == coll, f"{note}: (op, dtype, bytes) -> calls differ\n meas {meas}\n pred {coll}"
                for what in ("params", "grads", "optimizer"):
                    claims.check(f"ep<dp per-rank {what} bytes", component="comm", config=cfg.name,
                                 variant="efficient", predicted=mem[what], measured=rec["memory"][what], unit="B",
                                 note=note)
            pred = ep_calc.saved(cfg, run, EP, r, _hist(sc), world=WORLD)
            meas = res[name][r][0]["saved"]
            for comp in sorted(set(meas) | {k for k, v in pred.items() if v}):
                claims.check("ep<dp per-rank saved bytes", component=comp, config=cfg.name, variant="efficient",
                             predicted=pred.get(comp, 0), measured=meas.get(comp, 0), unit="B",
                             note=f"{name}: {draw_note(sc, rank=r)}, route {sc['route']}")


def _whole(got: list, n: str):
    """Parameter n's whole gradient: the experts' rows of ep ranks 0..ep-1 (every efsdp rank holds the same after
    its all-gather), every other one the same on every rank."""
    if ".experts." in n:
        for r in range(EP, WORLD):
            assert got[r]["grads"][n] == got[r % EP]["grads"][n], f"{n}: efsdp ranks of ep rank {r % EP} disagree"
        return _ep_grad(got[:EP], n)
    return _ep_grad(got, n)


@pytest.mark.distributed
@pytest.mark.parametrize("cfg, policy", [(c, p) for c in GRAD_CFGS for p in GRAD_RUNS] + [(PAD_CFG, "fp32-none")],
                         ids=[f"{c.name}-{p}" for c in GRAD_CFGS for p in GRAD_RUNS] + [f"{PAD_CFG.name}-fp32-none"])
def test_epdp_loss_and_grads_match_one_process(epdp_run, cfg, policy, claims):
    """Each rank's loss and every gradient equal one process's on the four ranks' batches: fp32 within GRAD_TOL
    (relative), amp within twice the one-process bf16 model's own error against float64 plus AMP_FLOOR
    (test_expert_parallel's rules): FSDP2's divide factor makes the experts' gradient the mean over every rank."""
    _, res = epdp_run
    got = res[f"grads-{cfg.name}-{policy}"]
    note = f"efsdp x ep 2 x 2, {policy}"
    if policy.startswith("fp32"):
        check_vs_one_process(claims, cfg, WORLD, got, lambda n: _whole(got, n), "ep<dp", note)
        return
    check_amp_vs_float64(claims, cfg, WORLD, got, lambda n: _whole(got, n), "ep<dp", note)


_QWEN_RANK = """
import json, sys
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from llm_anatomy.distributed.counting import CollectiveCounter, storage_bytes
from llm_anatomy.distributed.expert_parallel import ep_mesh, parallelize_experts
from llm_anatomy.distributed.simulate import fake_process_group
from llm_anatomy.hf_config import from_hf_config
from llm_anatomy.models import build_model
from validations.hf_configs import HF_CONFIGS
world, ep, rank = map(int, sys.argv[1:4])
cfg = from_hf_config(HF_CONFIGS["Qwen3-30B-A3B"])
with fake_process_group(world, rank):
    model = build_model(cfg, "efficient", device="meta", seed=None)
    parallelize_experts(model, ep_mesh(world, ep))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # FSDP re-pads each shard as it materializes it
        out = dict(params=storage_bytes(model.parameters()))
        for what, unit in (("experts", model.layers[0].mlp.experts), ("block", model.layers[0])):
            with CollectiveCounter() as c:
                unit.unshard()
            unit.reshard()
            out[what] = [[*k, n] for k, n in c.counts().items()]
print(json.dumps(out))
"""


def test_qwen3_30b_rank_of_256_fake_process_group(claims):
    """One rank of Qwen3-30B-A3B at efsdp 4 x ep 64 (256 ranks, fake process group, fake tensors, in a process of
    its own): its parameter bytes, one experts unit's all-gather (El = 2 experts' padded shards over 4 ranks) and
    one Block's (over 256), exactly as predicted."""
    import json
    import subprocess
    import sys

    from llm_anatomy.hf_config import from_hf_config
    from validations.hf_configs import HF_CONFIGS

    cfg, run, world, ep, rank = from_hf_config(HF_CONFIGS["Qwen3-30B-A3B"]), Run(1, 8, "fp32"), 256, 64, 129
    out = json.loads(subprocess.run([sys.executable, "-c", _QWEN_RANK, str(world), str(ep), str(rank)],
                                    capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()[-1])
    pred = ep_calc.rank_memory(cfg, run, ep, rank, world=world)["params"]
    claims.check("ep<dp per-rank params bytes", component="comm", config=cfg.name, variant="efficient",
                 predicted=pred, measured=out["params"], unit="B", note=f"efsdp x ep 4 x 64, rank {rank}, fake pg")
    rows = ep_calc.collectives(cfg, run, ep, rank, world=world)
    for what, units in (("experts", "experts"), ("block", "layers.*")):
        row = next(x for x in rows if x["op"] == "all_gather" and x["phase"] == "forward" and x["units"] == units)
        assert out[what] == [["all_gather", row["dtype"], row["bytes_each"], 1]], f"{what}: {out[what]} vs {row}"


def test_epdp_refusals_one_line():
    """ep must divide the experts and the world, the rank lie in the world: one line naming the field."""
    cfg = GRAD_CFGS[0]
    for args, kw, says in (((cfg, GRAD_RUN, 4, 0), dict(world=6), "world=6"), ((cfg, GRAD_RUN, 4, 0), dict(world=2),
                           "world=2"), ((cfg, GRAD_RUN, 2, 4), dict(world=4), "rank must")):
        with pytest.raises(ConfigError, match=says) as e:
            ep_calc.rank_memory(*args, **kw)
        assert "\n" not in str(e.value)
