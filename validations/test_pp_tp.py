"""Claims: tensor parallel inside pipeline stages (PP x TP, x FSDP2) on a ("pp", "dp", "tp") DeviceMesh, predicted
per rank (llm_anatomy.calculator.pipeline_parallel with tp) against what each gloo rank did and held
(llm_anatomy.distributed.pipeline_step.train_pp with tp, distributed/pipeline_tp.py).

  gloo, 4 processes   PP 2 x TP 2 with Schedule1F1B and with ScheduleInterleaved1F1B, 20 drawn configs each
                      (gpt-oss's sinks, sliding windows and o bias drawn among them)
    per rank, every step: params / grads / optimizer bytes, every collective (mesh dim, op, dtype, bytes) ->
    calls (TP's, the sequence-sharded sends / recvs; step 1 with torch's warm-up vote), the most bytes of saved
    activations held at once, and the most (stage, micro-batch) chunks holding them
  loss curve          PP 2 x TP 2 (both schedules) against the single-process run on the same batch: the PP
                      tests' float64 rule (validations/test_pipeline_parallel.py) or TP's CURVE_TOL
                      (validations/test_tensor_parallel.py), whichever is looser, since TP reorders the sums
  fake process group  pp 4 x dp 8 x tp 8 (256 ranks): a rank of the first and of the last stage, exact as above
  anatomy train       --tp 2 --pp 2 on 4 gloo ranks (spawned, and once under torchrun): loss curve, evals and gradient norms against one process
                      (validations/test_train_mesh.py's run and tolerances), the checkpoint's 3-D mesh, a same-mesh
                      resume repeating the run bit for bit, and a resume on another mesh refused in one line
  bad input           one line, exit 2
The drawn scenarios run in ONE spawn, the anatomy train runs in another (module-scoped fixtures).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import strategies as st

from llm_anatomy.calculator.pipeline_parallel import pp_collectives, pp_rank_memory
from llm_anatomy.calculator.pipeline_schedule import in_flight, saved_peak
from llm_anatomy.calculator.tensor_parallel import grouped_counts
from llm_anatomy.config import ModelConfig, Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.test_tensor_parallel import CURVE_TOL
from validations.train_cases import cache, one_thread, reference_losses  # noqa: F401 (module fixtures)

N = 20  # drawn configs per schedule
PP, TP = 2, 2


@st.composite
def pp_tp_cases(draw, schedule: str) -> dict:
    """A config the TP plan can shard (heads, kv_heads, intermediate, vocab multiples of tp; seq too), cut into
    pp x virtual stages, balanced or at drawn cut points."""
    virtual = 1 if schedule == "1f1b" else 2
    stages = PP * virtual
    kv = TP * draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    qk_norm = draw(st.booleans())
    seq = TP * draw(st.integers(1, 4))
    window = draw(st.one_of(st.none(), st.integers(1, seq)))  # gpt-oss's attention fields: sinks, window, o bias
    cfg = ModelConfig(name="pp-tp-draw", hidden=draw(st.integers(4, 24)) if qk_norm else heads * head_dim,
                      layers=draw(st.integers(stages, stages + 2)), heads=heads, kv_heads=kv, head_dim=head_dim,
                      intermediate=TP * draw(st.integers(1, 16)), vocab=TP * draw(st.integers(1, 40)),
                      mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])), qkv_bias=draw(st.booleans()),
                      qk_norm=qk_norm, attn_sinks=draw(st.booleans()), o_bias=draw(st.booleans()), window=window,
                      window_pattern=draw(st.sampled_from(["all", "even"])) if window else "all")
    if schedule == "1f1b":
        micro = draw(st.integers(PP, 2 * PP))
    else:  # torch's flexible interleaving: a multiple of its rounds, max(1, m // pp)
        micro = draw(st.sampled_from([m for m in range(1, 2 * PP + 1) if m % max(1, m // PP) == 0]))
    run = Run(batch=micro * draw(st.integers(1, 2)), seq=seq,
              dtype=draw(st.sampled_from(["fp32", "bf16"])))
    split = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, cfg.layers - 1), min_size=stages - 1, max_size=stages - 1,
                                    unique=True)))
        edges = [0, *cuts, cfg.layers]
        split = [b - a for a, b in zip(edges, edges[1:])]
    return dict(cfg=cfg, run=run, pp=PP, tp=TP, schedule=schedule, microbatches=micro, virtual=virtual,
                split=split, steps=2, optimizer=draw(st.sampled_from(["adamw", "sgd"])))


def _distinct(schedule: str, seed: int) -> list[dict]:
    """N scenarios with distinct model configs (derandomized draws repeat themselves: draw more)."""
    out, seen = [], set()
    for sc in draw_examples(pp_tp_cases(schedule), 5 * N, seed):
        if len(out) < N and sc["cfg"] not in seen:
            seen.add(sc["cfg"])
            out.append(sc)
    return out


LOSS_CFG = ModelConfig(name="pp-tp-loss", hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=96)
LOSS_RUN = Run(batch=4, seq=16, dtype="fp32")
LOSS_STEPS = 5
LOSS = {"loss-1f1b": dict(cfg=LOSS_CFG, run=LOSS_RUN, pp=PP, tp=TP, schedule="1f1b", microbatches=4,
                          steps=LOSS_STEPS),
        "loss-interleaved": dict(cfg=LOSS_CFG, run=LOSS_RUN, pp=PP, tp=TP, schedule="interleaved-1f1b", virtual=2,
                                 microbatches=4, steps=LOSS_STEPS)}


@pytest.fixture(scope="module")
def gloo_pp2_tp2() -> dict:
    """{group: [(scenario, [records per rank])]}, and {loss name: [records per rank]}, from one 4-rank spawn."""
    from llm_anatomy.distributed.pipeline_step import spawn

    groups = {"1f1b": _distinct("1f1b", 34), "interleaved-1f1b": _distinct("interleaved-1f1b", 35)}
    flat = [sc for g in groups.values() for sc in g] + list(LOSS.values())
    res = spawn(PP * TP, flat)
    out, i = {}, 0
    for name, scs in groups.items():
        out[name] = [(sc, [res[r][i + k] for r in range(PP * TP)]) for k, sc in enumerate(scs)]
        i += len(scs)
    for k, name in enumerate(LOSS):
        out[name] = [res[r][i + k] for r in range(PP * TP)]
    return out


def _check_rank(claims, sc: dict, rec: dict) -> None:
    pr, note = rec["pp_rank"], draw_note(sc, rec)
    common = dict(virtual=sc["virtual"], split=sc["split"], tp=sc["tp"], variant=sc.get("variant", "baseline"))
    kw = dict(config=sc["cfg"].name, variant=f"{common['variant']} pp x tp", device="cpu", note=note)
    mem = pp_rank_memory(sc["cfg"], sc["run"], sc["pp"], pr, sc.get("dp", 1), dp_rank=rec["dp_rank"],
                         optimizer=sc["optimizer"], **common)
    for what, component in (("params", "comm"), ("grads", "comm"), ("optimizer", "optimizer")):
        claims.check(f"pp x tp per-rank {what} bytes", component=component, predicted=mem[what],
                     measured=rec["memory"][what], unit="B", **kw)
    pred = grouped_counts(pp_collectives(sc["cfg"], sc["run"], sc["pp"], pr, sc.get("dp", 1), schedule=sc["schedule"],
                                         microbatches=sc["microbatches"], step=rec["step"],
                                         optimizer=sc["optimizer"], **common))
    meas = {(g, op, dt, b): n for g, op, dt, b, n in rec["by_dim"]}
    claims.check("pp x tp collectives per step", component="comm", predicted=sum(pred.values()),
                 measured=sum(meas.values()), unit="calls", **kw)
    assert meas == pred, f"{note}: (dim, op, dtype, bytes) -> calls differ\n measured  {meas}\n predicted {pred}"
    claims.check("pp x tp saved activations held at the peak", component="activations",
                 predicted=saved_peak(sc["cfg"], sc["run"], sc["pp"], pr, microbatches=sc["microbatches"],
                                      schedule=sc["schedule"], **common),
                 measured=rec["saved_peak"], unit="B", **kw)
    claims.check("pp x tp chunks in flight at the peak", component="activations",
                 predicted=in_flight(sc["schedule"], sc["pp"], pr, sc["microbatches"], sc["virtual"]),
                 measured=rec["chunks_peak"], unit="chunks", **kw)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_gloo_pp2_tp2_per_rank_exact(gloo_pp2_tp2, schedule, claims):
    check_scenarios(claims, gloo_pp2_tp2[schedule])


def check_scenarios(claims, scenarios: list) -> None:
    """At least N distinct drawn configs, tp the inner mesh dim, every step of every rank checked (_check_rank)."""
    assert len({sc["cfg"] for sc, _ in scenarios}) >= N  # distinct drawn configs
    for sc, ranks in scenarios:
        assert [recs[0]["tp_rank"] for recs in ranks] == [0, 1, 0, 1]  # tp is the inner mesh dim
        for recs in ranks:
            assert len(recs) == sc["steps"]
            for rec in recs:
                _check_rank(claims, sc, rec)


def curve_bound(fp32_err: float) -> float:
    """The loosest relative error against float64 that the PP and TP tests allow: twice the one-process fp32 run's
    own error (or twice one fp32 rounding), or TP's CURVE_TOL against that fp32 run plus its own error."""
    return max(2 * max(fp32_err, 2.0 ** -24), CURVE_TOL + fp32_err)


# ---- the loss curve against one process --------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LOSS))
def test_pp2_tp2_loss_curve_matches_one_process(gloo_pp2_tp2, name, claims):
    """Both TP ranks of the last stage report the same loss each step; its error against the same model in
    float64 is within the looser of the PP tests' rule (twice the one-process fp32 run's own error, or twice one
    fp32 rounding) and TP's CURVE_TOL per step against the one-process fp32 run (TP sums each row-parallel matmul
    as partials, then across ranks)."""
    ranks = gloo_pp2_tp2[name]
    last = [[r["loss"] for r in recs] for recs in ranks[TP:]]  # pipeline rank 1: global ranks 2, 3
    assert all(r["loss"] is None for recs in ranks[:TP] for r in recs)
    assert last[0] == last[1] and len(last[0]) == LOSS_STEPS
    pipe = last[0]
    ref32, ref64 = (reference_losses(LOSS_CFG, LOSS_RUN, LOSS_STEPS, dt) for dt in (torch.float32, torch.float64))
    err = lambda xs, ref: max(abs(x - y) / abs(y) for x, y in zip(xs, ref))  # noqa: E731
    assert pipe[-1] < pipe[0]  # it trains
    bound = curve_bound(err(ref32, ref64))
    claims.within("PP 2 x TP 2 loss curve, relative error against float64", low=0.0, high=bound,
                  measured=err(pipe, ref64), component="loss", config=LOSS_CFG.name, variant=f"baseline {name}",
                  unit="rel", note=f"pp x tp {pipe}, one process fp32 {ref32}, float64 {ref64}")
    assert err(pipe, ref64) <= bound, f"pp x tp {pipe}\n one process fp32 {ref32}\n float64 {ref64}"


# ---- the fake process group: ranks of a 256-rank mesh ------------------------------------
BIG = dict(pp=4, dp=8, tp=8)
BIG_CFG = ModelConfig(name="pp4-dp8-tp8", hidden=64, layers=9, heads=8, kv_heads=8, intermediate=96, vocab=136,
                      qk_norm=True, head_dim=8)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_fake_pg_pp4_dp8_tp8_exact(schedule, claims):
    """torch's schedule, DTensor and FSDP2 run their own code for a rank of the first and of the last pipeline
    stage of pp 4 x dp 8 x tp 8 (the fake process group, distributed/pipeline_simulate.py) under amp (FSDP's bf16
    parameters, fp32 gradient reduction); each rank's collectives by mesh dim, bytes held, saved peak and chunks
    equal the prediction, steps 1 (with the warm-up vote) and 2."""
    from llm_anatomy.distributed.pipeline_simulate import simulate_ranks

    virtual = 1 if schedule == "1f1b" else 2
    sc = dict(cfg=BIG_CFG, run=Run(batch=8, seq=16, dtype="amp"), schedule=schedule, microbatches=8,
              virtual=virtual, split=None, optimizer="adamw", **BIG)
    # the first and the last pipeline rank (embedding, head and loss_parallel), at different (dp, tp) coordinates
    stage_rank = {0: 5, 3: 3 * 64 + 58}
    recs = simulate_ranks(list(stage_rank.values()), steps=2, **{k: v for k, v in sc.items() if k != "optimizer"})
    for p, r in stage_rank.items():
        assert [x["pp_rank"] for x in recs[r]] == [p, p]
        assert (recs[r][0]["dp_rank"], recs[r][0]["tp_rank"]) == divmod(r % 64, 8)
        for rec in recs[r]:
            _check_rank(claims, sc, rec)


# ---- anatomy train --tp 2 --pp 2 ------------------------------------------------------------------------
PPTP = ["--tp", "2", "--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2"]
MESH = "pp 2 (1f1b, 1 stage(s) per rank) x dp 1 x tp 2"


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory) -> dict:
    """One 4-rank spawn: the PP 2 x TP 2 run (checkpoint at step 2), its resume from step 2, and that checkpoint
    resumed as TP 2 x FSDP 2; and the one-process runs it is held to (fp32, float64)."""
    from llm_anatomy.distributed import train_step
    from llm_anatomy.train.data import load_data
    from llm_anatomy.train.loop import TrainOptions, train
    from validations.test_train import _float64_throughout
    from validations.test_train_mesh import CFG, CLIP, FLAGS, STEPS, _rank_cli

    base = tmp_path_factory.mktemp("pp-tp-train")
    common = [*FLAGS, "--cache-dir", str(cache), "--batch", "4"]
    step2 = str(base / "pp2xtp2" / "step-00000002")
    runs = {"pp2xtp2": [*PPTP, "--ckpt-every", "2", "--ckpt-dir", str(base / "pp2xtp2")],
            "resumed": [*PPTP, "--ckpt-dir", str(base / "pp2xtp2"), "--resume", step2, "--out", str(base / "resumed")],
            "on-tp2xdp2": ["--tp", "2", "--ckpt-dir", str(base / "pp2xtp2"), "--resume", step2,
                           "--out", str(base / "on-tp2xdp2")]}
    codes = train_step.spawn(PP * TP, [dict(args=[*common, *a]) for a in runs.values()], fn=_rank_cli)
    out = {name: ([codes[r][i] for r in range(PP * TP)], base / name) for i, name in enumerate(runs)}
    data = load_data(None, CFG.vocab, cache_dir=cache, seq=32)
    for name, pdt in (("fp32", None), ("fp64", "float64")):
        d = base / name
        o = TrainOptions(steps=STEPS, eval_every=2, grad_clip=CLIP, progress="none", plot=False, out=str(d),
                         param_dtype=pdt)
        with _float64_throughout() if pdt else contextlib.nullcontext():
            train(CFG, Run(4, 32, "fp32"), "baseline", data, o)
        out[name] = ([0], d)
    return out


@pytest.mark.distributed
def test_train_pp2_tp2_matches_one_process(trained, claims):
    """`anatomy train --tp 2 --pp 2` on 4 ranks: every rank exits 0, the log names the 3-D mesh, and its loss
    curve and evals against float64 are within curve_bound of the one-process fp32 run's own error; its gradient
    norms (the stages' combined, each a TP DTensor norm) within CURVE_TOL of the one-process run's."""
    from validations.test_train_mesh import CFG, _check_norms, _evals, _log, _losses

    codes, d = trained["pp2xtp2"]
    assert codes == [0] * (PP * TP)
    log = _log(d)
    assert log["strategy"] == "pp" and log["mesh"] == MESH
    _check_norms(d, trained["fp32"][1], "pp2xtp2", claims)
    for what in (_losses, _evals):
        got, ref32, ref64 = what(d), what(trained["fp32"][1]), what(trained["fp64"][1])

        def err(xs, ref64=ref64):
            return max(abs(x - y) / abs(y) for x, y in zip(xs, ref64, strict=True))

        claims.within(f"anatomy train --tp 2 --pp 2 {what.__name__[1:]}, relative error against float64",
                      low=0.0, high=curve_bound(err(ref32)), measured=err(got), component="loss", config=CFG.name,
                      variant="baseline", unit="rel", note=f"pp x tp {got}, one process fp32 {ref32}")
        assert err(got) <= curve_bound(err(ref32)), (got, ref32, ref64)


@pytest.mark.distributed
def test_train_pp2_tp2_resume_and_other_mesh(trained):
    """The step-2 checkpoint holds one shard per rank under the 3-D mesh; resumed on the same mesh, the 4 straight
    steps' losses and evals come back bit for bit; resumed as TP 2 x FSDP 2, every rank exits 2 with one line."""
    from validations.test_train_mesh import _evals, _log, _losses

    straight, (codes, resumed) = trained["pp2xtp2"][1], trained["resumed"]
    assert codes == [0] * (PP * TP) and _log(resumed)["start_step"] == 2
    assert _losses(resumed) == _losses(straight) and _evals(resumed) == _evals(straight)
    step2 = straight / "step-00000002"
    assert sorted(p.name for p in step2.glob("shard-*")) == [f"shard-{r:05d}-of-00004.safetensors" for r in range(4)]
    assert json.loads((step2 / "trainer.json").read_text())["layout"] == MESH
    assert trained["on-tp2xdp2"][0] == [2] * (PP * TP)


def test_train_pp_tp_refusals_one_line(cache, tmp_path, capsys, monkeypatch):
    """Before any process group: a mesh that does not divide the world, the efficient variant's lean block under
    TP, seq not divisible by tp; each one line on stderr and exit 2."""
    from llm_anatomy.train import cli
    from validations.test_train_mesh import FLAGS

    monkeypatch.setenv("RANK", "0")
    for world, args, says in [(6, PPTP, "--pp 2 x --tp 2 = 4 ranks does not divide the world size 6"),
                              (4, [*PPTP, "--variant", "efficient", "--lean"], "without its lean block"),
                              (4, [*PPTP, "--seq", "31"], "seq=31 is not divisible by tp=2")]:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        rc = cli.main([*FLAGS, "--batch", "4", "--cache-dir", str(cache), "--out", str(tmp_path), *args])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and says in err, err


@pytest.mark.distributed
def test_torchrun_train_pp2_tp2(trained, cache, tmp_path):
    """The documented launch: torchrun, 4 CPU ranks on gloo, `anatomy train --tp 2 --pp 2`; it exits 0 and its
    losses are the spawned run's (same data, same mesh, deterministic CPU kernels)."""
    from validations.test_train_mesh import FLAGS, _log, _losses

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m",
           "llm_anatomy.cli", "train", *FLAGS, "--batch", "4", *PPTP, "--cache-dir", str(cache),
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert _log(tmp_path)["mesh"] == MESH
    assert _losses(tmp_path) == _losses(trained["pp2xtp2"][1])
