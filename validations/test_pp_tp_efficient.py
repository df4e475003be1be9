"""Claims: the efficient variant (its plain block) with tensor parallel inside pipeline stages, on a ("pp", "dp", "tp")
DeviceMesh (distributed/pipeline_tp.py: the efficient TP layout and vocab-parallel fused head applied to the whole
model, then cut into stages), predicted per rank (llm_anatomy.calculator.pipeline_parallel, pipeline_schedule with
variant "efficient" and tp) against what each gloo rank did and held (distributed/pipeline_step.train_pp).

  gloo, 4 processes   PP 2 x TP 2 with Schedule1F1B and with ScheduleInterleaved1F1B, 20 drawn configs each
                      (test_pp_tp.py's draws: gpt-oss's sinks, sliding windows and o bias, Qwen3's q/k norms, q/k/v
                      bias, uneven splits; with recompute none, mlp or full drawn)
    per rank, every step: params / grads / optimizer bytes, every collective (mesh dim, op, dtype, bytes) -> calls
    (the fused head's three fp32 all-reduces per chunk, recompute's re-run all-gathers and reduce-scatters), the
    most bytes of saved activations held at once, the most (stage, micro-batch) chunks holding them
  phase ends          PP 2 x TP 2, 20 draws of both variants and schedules: each rank's live storage after the
                      schedule's step and after the optimizer step (distributed/mesh_peak.pp_peaks), exact
                      (calculator/tp_memory.pp_phases with tp)
  loss curve          PP 2 x TP 2 (1f1b without recompute, interleaved under recompute mlp) against the one-process
                      efficient model on the same batch, within TP's CURVE_TOL per step (reduction order only)
  fake process group  pp 4 x dp 8 x tp 8 under amp (FSDP2's bf16 parameters) and recompute mlp: a rank of the
                      first and of the last stage, exact as above
  anatomy train       --variant efficient --tp 2 --pp 2 under torchrun on 4 gloo ranks: losses, evals and gradient
                      norms against the one-process efficient run within CURVE_TOL; resumed from its step-2
                      checkpoint (spawned) it repeats steps 3 and 4 bit for bit
The drawn scenarios, the phase draws, the loss curves and the resume run in ONE spawn (the one-worker gloo backend
the phase ends are read on), after the one torchrun launch.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import strategies as st

from llm_anatomy.config import Run
from llm_anatomy.mesh_rules import SCHEDULES
from validations.test_pipeline_parallel import _distinct
from validations.test_pp_tp import (LOSS_CFG, LOSS_RUN, LOSS_STEPS, PP, TP, N, _check_rank, check_scenarios,
                                     pp_tp_cases)
from validations.test_tensor_parallel import CURVE_TOL
from validations.train_cases import cache, one_process_losses, one_thread  # noqa: F401 (module fixtures)


@st.composite
def efficient_cases(draw, schedule: str) -> dict:
    """test_pp_tp.py's draw, run by the efficient variant under a drawn recompute policy."""
    sc = draw(pp_tp_cases(schedule))
    run = replace(sc["run"], recompute=draw(st.sampled_from(["none", "mlp", "full"])))
    return dict(sc, run=run, variant="efficient")


LOSS = {"loss-1f1b": dict(cfg=LOSS_CFG, run=LOSS_RUN, pp=PP, tp=TP, schedule="1f1b", microbatches=4,
                          steps=LOSS_STEPS, variant="efficient"),
        "loss-interleaved": dict(cfg=LOSS_CFG, run=replace(LOSS_RUN, recompute="mlp"), pp=PP, tp=TP,
                                 schedule="interleaved-1f1b", virtual=2, microbatches=4, steps=LOSS_STEPS,
                                 variant="efficient")}


@st.composite
def phase_cases(draw) -> dict:
    """A PP 2 x TP 2 draw of either variant and schedule, for the phase ends."""
    variant, schedule = draw(st.sampled_from(["baseline", "efficient"])), draw(st.sampled_from(SCHEDULES))
    return draw(efficient_cases(schedule)) if variant == "efficient" else draw(pp_tp_cases(schedule))


def _scenario(args: list[str] | None = None, phases: bool = False, **kw):
    """One scenario on a spawned rank: an `anatomy train` command line (args), the live-storage phases of
    distributed/mesh_peak.pp_peaks (phases), else train_pp's records."""
    from llm_anatomy.distributed.mesh_peak import pp_peaks
    from llm_anatomy.distributed.pipeline_step import train_pp
    from validations.test_train_mesh import _rank_cli

    if args is not None:
        return _rank_cli(args)
    return pp_peaks(**kw) if phases else train_pp(**kw)


@pytest.fixture(scope="module")
def gloo_efficient(launched) -> dict:
    """{schedule: [(scenario, [records per rank])]}, {loss name: [records per rank]}, "phases": [(scenario, [phases
    per rank])], and "resumed": the ranks' exit codes of the launch's resume from step 2, from one 4-rank spawn on
    the one-worker gloo backend (distributed/settled.py: the phase ends are read settled)."""
    from llm_anatomy.distributed.settled import spawn_settled

    groups = {s: _distinct(efficient_cases(s), seed) for s, seed in (("1f1b", 47), ("interleaved-1f1b", 48))}
    phases = [dict(sc, phases=True) for sc in _distinct(phase_cases(), 49)]
    straight = launched["straight"]
    resume = dict(args=[*launched["args"], "--ckpt-dir", str(straight), "--resume", str(straight / "step-00000002"),
                        "--out", str(launched["resumed"])])
    # the phases follow the other runs: the process's lazy state (the pipeline's first step) exists by then
    flat = [sc for g in groups.values() for sc in g] + list(LOSS.values()) + phases + [resume]
    res = spawn_settled(PP * TP, flat, _scenario, timeout_s=300)
    ranks = [[res[r][i] for r in range(PP * TP)] for i in range(len(flat))]  # per scenario, each rank's result
    n1, n2 = len(groups["1f1b"]), len(groups["interleaved-1f1b"])
    out = dict(zip(LOSS, ranks[n1 + n2:]), resumed=ranks[-1])
    for name, scs, first in (("1f1b", groups["1f1b"], 0), ("interleaved-1f1b", groups["interleaved-1f1b"], n1),
                             ("phases", phases, n1 + n2 + len(LOSS))):
        out[name] = list(zip(scs, ranks[first:first + len(scs)]))
    return out


@pytest.mark.distributed
def test_pp2_tp2_phase_ends_exact(gloo_efficient, claims):
    """After the schedule's step and after the optimizer step (the second step), every rank of PP 2 x TP 2 holds
    the predicted bytes (calculator/tp_memory.pp_phases with tp: the TP-local model state, the receive buffers at
    the sequence shard, the tp sub-mesh's rank tensor), 20 draws of both variants and schedules."""
    from llm_anatomy.calculator.tp_memory import pp_phases
    from validations.draw_notes import draw_note

    scenarios = gloo_efficient["phases"]
    assert len({sc["cfg"] for sc, _ in scenarios}) >= N
    assert {sc.get("variant", "baseline") for sc, _ in scenarios} == {"baseline", "efficient"}
    for sc, ranks in scenarios:
        for r, got in enumerate(ranks):
            ph = {p["name"]: p for p in got}
            pred = pp_phases(sc["cfg"], sc["run"], PP, r // TP, microbatches=sc["microbatches"],
                             schedule=sc["schedule"], virtual=sc["virtual"], split=sc["split"], device="cpu",
                             optimizer=sc["optimizer"], variant=sc.get("variant", "baseline"), tp=TP)
            for phase, measured in (("step_end", ph["step"]["allocated"]),
                                    ("optimizer_end", ph["zero_grad"]["allocated"])):
                claims.check(f"pp x tp rank {phase.replace('_', ' ')} bytes", component="memory",
                             config=sc["cfg"].name, variant=sc.get("variant", "baseline"), predicted=pred[phase],
                             measured=measured, unit="B", note=f"pp 2 x tp 2: {draw_note(sc, rank=r)}")


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_gloo_pp2_tp2_efficient_per_rank_exact(gloo_efficient, schedule, claims):
    scenarios = gloo_efficient[schedule]
    assert {sc["run"].recompute for sc, _ in scenarios} == {"none", "mlp", "full"}
    check_scenarios(claims, scenarios)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LOSS))
def test_pp2_tp2_efficient_loss_curve_matches_one_process(gloo_efficient, name, claims):
    """Both TP ranks of the last stage report the same loss each step, within CURVE_TOL of the one-process efficient
    model's (seed 0, dp rank 0's batch, AdamW at 1e-3 on the whole batch: equal micro-batches' mean losses and
    torch's scale_grads give the batch's mean and its gradient)."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    ranks = gloo_efficient[name]
    last = [[r["loss"] for r in recs] for recs in ranks[TP:]]  # pipeline rank 1: global ranks 2, 3
    assert all(r["loss"] is None for recs in ranks[:TP] for r in recs)
    assert last[0] == last[1] and len(last[0]) == LOSS_STEPS
    model = build_model(LOSS_CFG, "efficient", seed=0)
    ids, targets = make_batch(LOSS_CFG, LOSS_RUN, seed=1)
    one = one_process_losses(model, make_optimizer("adamw", model.parameters(), 1e-3), ids, targets, LOSS_STEPS)
    assert one[-1] < one[0]  # it trains
    for step, (got, want) in enumerate(zip(last[0], one, strict=True), 1):
        claims.check("PP 2 x TP 2 (efficient) loss vs one process", component="loss", config=LOSS_CFG.name,
                     variant=f"efficient {name}", predicted=want, measured=got, tolerance=CURVE_TOL, unit="nats",
                     note=f"step {step}, recompute {LOSS[name]['run'].recompute}")


def test_fake_pg_pp4_dp8_tp8_efficient_exact(claims):
    """torch's schedule, DTensor and FSDP2 run the efficient stages of pp 4 x dp 8 x tp 8 (the fake process group,
    distributed/pipeline_simulate.py) under amp and recompute mlp: a rank of the first and of the last stage,
    steps 1 and 2, exact as the gloo ranks."""
    from llm_anatomy.distributed.pipeline_simulate import simulate_ranks
    from validations.test_pp_tp import BIG, BIG_CFG

    sc = dict(cfg=BIG_CFG, run=Run(batch=8, seq=16, dtype="amp", recompute="mlp"), schedule="1f1b", microbatches=8,
              virtual=1, split=None, optimizer="adamw", variant="efficient", **BIG)
    stage_rank = {0: 5, 3: 3 * 64 + 58}
    recs = simulate_ranks(list(stage_rank.values()), steps=2, **sc)
    for p, r in stage_rank.items():
        assert [x["pp_rank"] for x in recs[r]] == [p, p]
        for rec in recs[r]:
            _check_rank(claims, sc, rec)


# ---- anatomy train --variant efficient --tp 2 --pp 2 ----------------------------------------------------------
@pytest.fixture(scope="module")
def launched(cache, tmp_path_factory) -> dict:
    """The one-process efficient run, and the torchrun launch (checkpoint at step 2) whose resume gloo_efficient's
    spawn runs."""
    from llm_anatomy.train.data import load_data
    from llm_anatomy.train.loop import TrainOptions, train
    from validations.test_pp_tp import PPTP
    from validations.test_train_mesh import CFG, CLIP, EFF, FLAGS, STEPS

    base = tmp_path_factory.mktemp("pp-tp-efficient-train")
    args = [*FLAGS, "--cache-dir", str(cache), "--batch", "4", *PPTP, *EFF]
    one = base / "one"
    train(CFG, Run(4, 32, "fp32"), "efficient", load_data(None, CFG.vocab, cache_dir=cache, seq=32),
          TrainOptions(steps=STEPS, eval_every=2, grad_clip=CLIP, progress="none", plot=False, out=str(one)))
    straight = base / "pp2xtp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m",
           "llm_anatomy.cli", "train", *args, "--ckpt-every", "2", "--ckpt-dir", str(straight)]
    launch = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    return dict(args=args, launch=launch, straight=straight, resumed=base / "resumed", one=one)


@pytest.mark.distributed
def test_torchrun_train_pp2_tp2_efficient(launched, claims):
    """`anatomy train --variant efficient --tp 2 --pp 2` under torchrun exits 0 on the 3-D mesh (the lean block off,
    as under --tp alone); its losses, evals and gradient norms follow the one-process efficient run within
    CURVE_TOL."""
    from validations.test_pp_tp import MESH
    from validations.test_train_mesh import CFG, _check_norms, _evals, _log, _losses

    launch, d, one = launched["launch"], launched["straight"], launched["one"]
    assert launch.returncode == 0, launch.stderr[-3000:]
    log = _log(d)
    assert log["strategy"] == "pp" and log["mesh"] == MESH and log["variant"] == "efficient"
    _check_norms(d, one, "pp2xtp2-efficient", claims)
    for got, want in zip(_losses(d) + _evals(d), _losses(one) + _evals(one), strict=True):
        claims.check("anatomy train --tp 2 --pp 2 (efficient) loss vs one process", component="loss",
                     config=CFG.name, variant="efficient", predicted=want, measured=got, tolerance=CURVE_TOL,
                     unit="nats")


@pytest.mark.distributed
def test_train_pp2_tp2_efficient_resume_repeats_the_run(launched, gloo_efficient):
    """Resumed (spawned) from the launch's step-2 per-rank checkpoint on the same mesh, steps 3 and 4 come back bit
    for bit."""
    from validations.test_train_mesh import _evals, _log, _losses

    straight, resumed = launched["straight"], launched["resumed"]
    assert gloo_efficient["resumed"] == [0] * (PP * TP) and _log(resumed)["start_step"] == 2
    assert _losses(resumed) == _losses(straight) and _evals(resumed) == _evals(straight)
    assert sorted(p.name for p in (straight / "step-00000002").glob("shard-*")) == [
        f"shard-{r:05d}-of-00004.safetensors" for r in range(PP * TP)]

