"""Claims: pipeline parallel (torch.distributed.pipelining, x FSDP2 over dp) per rank, predicted
(llm_anatomy.calculator.pipeline_parallel, .pipeline_schedule) against what each gloo rank did and held.

  gloo, 2 processes   PP 2 with Schedule1F1B and with ScheduleInterleaved1F1B, 20 drawn configs and runs each;
                      PP 1 x FSDP 2 (a rank's stages hand over in memory), 6 drawn
  gloo, 4 processes   PP 4 with both schedules, and PP 2 x FSDP 2 (either schedule), 20 drawn each
    per rank, every step: params / grads / optimizer bytes, every send / recv / FSDP collective
    (op, dtype, bytes) -> calls (step 1 with torch's warm-up vote, step 2 steady), the most bytes of saved
    activations held at once, and the most (stage, micro-batch) chunks holding them
  loss curve          a 2-stage pipeline (both schedules) against the single-process run on the same batch and
                      micro-batches; the tolerance is the house rule for numerical agreement: within twice the
                      single-process fp32 run's own error against the same run in float64
  bad input           one-line ConfigError naming the field
All drawn scenarios of a world size run in ONE spawn (module-scoped fixture), so the file stays fast.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import strategies as st

from llm_anatomy.calculator.comm import collective_counts
from llm_anatomy.calculator.pipeline_parallel import pp_collectives, pp_rank_memory
from llm_anatomy.calculator.pipeline_schedule import bubble_fraction, in_flight, order, saved_peak
from llm_anatomy.mesh_rules import stage_layers
from llm_anatomy.config import ConfigError, ModelConfig, Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.train_cases import reference_losses

N = 20  # drawn scenarios per claim group


@st.composite
def pipeline_scenarios(draw, pp: int, dp: int, schedule: str | None = None, variant: str | None = None,
                       dtype: str | None = None) -> dict:
    schedule = schedule or draw(st.sampled_from(["1f1b", "interleaved-1f1b"]))
    virtual = 1 if schedule == "1f1b" else draw(st.integers(2, 3))
    stages = pp * virtual
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    variant = variant or draw(st.sampled_from(["baseline", "efficient"]))
    cfg = ModelConfig(name="hypothesis-pp", hidden=heads * draw(st.sampled_from([4, 8])),
                      layers=draw(st.integers(stages, stages + 3)), heads=heads, kv_heads=kv,
                      intermediate=draw(st.integers(1, 64)), vocab=draw(st.integers(2, 300)),
                      qkv_bias=draw(st.booleans()), mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])))
    if schedule == "1f1b":
        micro = draw(st.integers(pp, 2 * pp + 1))
    else:  # torch's flexible interleaving: a multiple of its rounds, max(1, m // pp)
        micro = draw(st.sampled_from([m for m in range(1, 3 * pp + 1) if m % max(1, m // pp) == 0]))
    dtypes = ["fp32", "bf16"] + (["amp"] if dp > 1 else [])
    run = Run(batch=micro * draw(st.integers(1, 2)), seq=draw(st.integers(1, 12)), dtype=dtype or draw(st.sampled_from(dtypes)),
              recompute=draw(st.sampled_from(["none", "mlp", "full"])) if variant == "efficient" else "none")
    split = None
    if draw(st.booleans()):  # an uneven split: cut points drawn over the layers
        cuts = sorted(draw(st.lists(st.integers(1, cfg.layers - 1), min_size=stages - 1, max_size=stages - 1,
                                    unique=True))) if stages > 1 else []
        edges = [0, *cuts, cfg.layers]
        split = [b - a for a, b in zip(edges, edges[1:])]
    return dict(cfg=cfg, run=run, pp=pp, dp=dp, schedule=schedule, microbatches=micro, virtual=virtual,
                split=split, variant=variant, steps=2)


def _distinct(strategy, seed: int, n: int = N, seen: set | None = None) -> list[dict]:
    """n scenarios whose model configs are new to `seen` (derandomized draws repeat themselves: draw more)."""
    out, seen = [], set() if seen is None else seen
    for sc in draw_examples(strategy, 5 * n, seed):
        if len(out) < n and sc["cfg"] not in seen:
            seen.add(sc["cfg"])
            out.append(sc)
    return out


def _groups(world: int) -> dict[str, list[dict]]:
    if world == 2:
        return {"pp2-1f1b": _distinct(pipeline_scenarios(2, 1, "1f1b"), 2),
                "pp2-interleaved": _distinct(pipeline_scenarios(2, 1, "interleaved-1f1b"), 3),
                # one pipeline rank (its stages hand over in memory), FSDP over two
                "pp1xfsdp2": _distinct(pipeline_scenarios(1, 2), 9, 6)}
    seen: set = set()
    return {"pp4-1f1b": _distinct(pipeline_scenarios(4, 1, "1f1b"), 4),
            "pp4-interleaved": _distinct(pipeline_scenarios(4, 1, "interleaved-1f1b"), 5),
            # amp is FSDP's MixedPrecisionPolicy: a quarter of the draws each variant under it, the rest free
            "pp2xfsdp2": (_distinct(pipeline_scenarios(2, 2, variant="baseline", dtype="amp"), 6, 5, seen)
                          + _distinct(pipeline_scenarios(2, 2, variant="efficient", dtype="amp"), 7, 5, seen)
                          + _distinct(pipeline_scenarios(2, 2), 8, 10, seen))}


LOSS_CFG = ModelConfig(name="pp-loss", hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=97)
LOSS_RUN = Run(batch=4, seq=16, dtype="fp32")
LOSS_STEPS = 5
LOSS_SCENARIOS = {"loss-1f1b": dict(cfg=LOSS_CFG, run=LOSS_RUN, pp=2, schedule="1f1b", microbatches=4,
                                    steps=LOSS_STEPS),
                  "loss-interleaved": dict(cfg=LOSS_CFG, run=LOSS_RUN, pp=2, schedule="interleaved-1f1b",
                                           virtual=2, microbatches=4, steps=LOSS_STEPS)}


def _spawned(world: int) -> dict:
    """{group: [(scenario, [records per rank])]} (and the loss runs on W=2) from one spawn of `world` processes."""
    from llm_anatomy.distributed.pipeline_step import spawn

    groups = _groups(world)
    flat = [sc for g in groups.values() for sc in g] + (list(LOSS_SCENARIOS.values()) if world == 2 else [])
    res = spawn(world, flat)
    out, i = {}, 0
    for name, scs in groups.items():
        out[name] = [(sc, [res[r][i + k] for r in range(world)]) for k, sc in enumerate(scs)]
        i += len(scs)
    for k, name in enumerate(LOSS_SCENARIOS if world == 2 else ()):
        out[name] = [res[r][i + k] for r in range(world)]
    return out


@pytest.fixture(scope="module")
def gloo_w2():
    return _spawned(2)


@pytest.fixture(scope="module")
def gloo_w4():
    return _spawned(4)


def _check_rank(claims, sc: dict, rec: dict) -> None:
    pr, dr, note = rec["pp_rank"], rec["dp_rank"], draw_note(sc, rec)
    common = dict(virtual=sc["virtual"], split=sc["split"], variant=sc["variant"])
    kw = dict(config=sc["cfg"].name, variant=f"{sc['variant']} pp", device="cpu", note=note)
    mem = pp_rank_memory(sc["cfg"], sc["run"], sc["pp"], pr, sc["dp"], dp_rank=dr, **common)
    for what, component in (("params", "comm"), ("grads", "comm"), ("optimizer", "optimizer")):
        claims.check(f"pipeline per-rank {what} bytes", component=component, predicted=mem[what],
                     measured=rec["memory"][what], unit="B", **kw)
    pred = collective_counts(pp_collectives(sc["cfg"], sc["run"], sc["pp"], pr, sc["dp"], schedule=sc["schedule"],
                                            microbatches=sc["microbatches"], step=rec["step"], **common))
    meas = {(op, dt, b): n for op, dt, b, n in rec["collectives"]}
    claims.check("pipeline sends, recvs and collectives per step", component="comm", predicted=sum(pred.values()),
                 measured=sum(meas.values()), unit="calls", **kw)
    assert meas == pred, f"{note}: (op, dtype, bytes) -> calls differ\n measured  {meas}\n predicted {pred}"
    sched = dict(schedule=sc["schedule"], virtual=sc["virtual"])
    claims.check("pipeline saved activations held at the peak", component="activations",
                 predicted=saved_peak(sc["cfg"], sc["run"], sc["pp"], pr, microbatches=sc["microbatches"],
                                      split=sc["split"], variant=sc["variant"], **sched),
                 measured=rec["saved_peak"], unit="B", **kw)
    claims.check("pipeline chunks in flight at the peak", component="activations",
                 predicted=in_flight(sc["schedule"], sc["pp"], pr, sc["microbatches"], sc["virtual"]),
                 measured=rec["chunks_peak"], unit="chunks", **kw)


def _check_group(claims, scenarios, n: int = N) -> None:
    assert len({sc["cfg"] for sc, _ in scenarios}) >= n  # distinct drawn configs
    for sc, ranks in scenarios:
        for recs in ranks:
            for rec in recs:
                _check_rank(claims, sc, rec)


@pytest.mark.distributed
@pytest.mark.parametrize("group", ["pp2-1f1b", "pp2-interleaved"])
def test_gloo_two_ranks_per_rank_exact(gloo_w2, group, claims):
    _check_group(claims, gloo_w2[group])


@pytest.mark.distributed
def test_gloo_one_pipeline_rank_fsdp_two_exact(gloo_w2, claims):
    _check_group(claims, gloo_w2["pp1xfsdp2"], 6)


@pytest.mark.distributed
@pytest.mark.parametrize("group", ["pp4-1f1b", "pp4-interleaved", "pp2xfsdp2"])
def test_gloo_four_ranks_per_rank_exact(gloo_w4, group, claims):
    _check_group(claims, gloo_w4[group])


# ---- the loss curve of a 2-stage pipeline against one process ------------------------------------------
def _single_process_losses(dtype: torch.dtype) -> list[float]:
    """The same model, batch and optimizer in one process: the whole batch's mean loss each step."""
    return reference_losses(LOSS_CFG, LOSS_RUN, LOSS_STEPS, dtype)  # pipeline_step's batch of dp rank 0


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LOSS_SCENARIOS))
def test_two_stage_loss_curve_matches_one_process(gloo_w2, name, claims):
    """The last stage's loss each step equals the single-process run's within the house rule for numerical
    agreement: its error against the same run in float64 is at most twice the single-process fp32 run's own
    (or twice one fp32 rounding, 2^-24, where that run's is smaller: a loss read as fp32 is no closer).
    (The micro-batch means average to the batch mean and torch's scale_grads divides the summed gradients by
    the micro-batch count, so the runs differ by fp32 rounding only.)"""
    recs = gloo_w2[name][1]  # pipeline rank 1 holds the last stage
    pipe = [r["loss"] for r in recs]
    ref32, ref64 = _single_process_losses(torch.float32), _single_process_losses(torch.float64)
    err = lambda xs: max(abs(x - y) / abs(y) for x, y in zip(xs, ref64))  # noqa: E731
    assert len(pipe) == LOSS_STEPS and all(r["loss"] is None for r in gloo_w2[name][0])
    assert pipe[-1] < pipe[0]  # it trains
    # the losses are fp32 scalars: no agreement is finer than one fp32 rounding (2^-24 relative)
    bound = 2 * max(err(ref32), 2.0 ** -24)
    claims.within("2-stage pipeline loss curve, relative error against float64", low=0.0, high=bound,
                  measured=err(pipe), component="loss", config=LOSS_CFG.name, variant=f"baseline {name}",
                  unit="rel", note=f"pipeline {pipe}, one process fp32 {ref32}, float64 {ref64}")
    assert err(pipe) <= bound, f"pipeline {pipe}\n one process fp32 {ref32}\n float64 {ref64}"


# ---- the split, the schedule's figures, and bad input (pure Python) ------------------------------------
def test_stage_layers_balanced_and_given():
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the remainder goes to the stages without embedding or head first, then stage 0, then the last
    assert [len(s) for s in stage_layers(7, 4)] == [2, 2, 2, 1]
    assert [len(s) for s in stage_layers(6, 4)] == [1, 2, 2, 1]
    assert [len(s) for s in stage_layers(11, 4)] == [3, 3, 3, 2]
    assert [len(s) for s in stage_layers(5, 2, virtual=2)] == [1, 2, 1, 1]
    assert stage_layers(5, 2, split=[4, 1]) == [[0, 1, 2, 3], [4]]


def test_in_flight_and_bubble():
    # 1F1B: stage r warms up with min(m, pp - r) forwards and then alternates, so that is its most in flight
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 2, r, 5) for r in range(2)] == [2, 1]
    # interleaved: (v - 1) m_r + 2 (pp - 1 - r) warm-up forwards, and one more forward before the first backward
    assert [in_flight("interleaved-1f1b", 4, r, 8, 2) for r in range(4)] == [11, 9, 7, 5]
    acts = order("interleaved-1f1b", 2, 0, 4, 2)
    assert sorted(a for a in acts if a[0] == "F") == [("F", s, m) for s in (0, 2) for m in range(4)]
    assert len(acts) == 16
    assert bubble_fraction("1f1b", 4, 8) == 3 / 11
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == 3 / 19


BAD = [
    (lambda: stage_layers(3, 4), "layers (3) must be at least"),
    (lambda: stage_layers(4, 2, split=[3, 2]), "split must add up"),
    (lambda: stage_layers(4, 2, split=[4]), "split must list 2"),
    (lambda: in_flight("1f1b", 4, 0, 3), "microbatches (3) must be at least pp (4)"),
    (lambda: in_flight("interleaved-1f1b", 4, 0, 9, 2), "multiple of interleaved-1f1b's rounds"),
    (lambda: in_flight("interleaved-1f1b", 2, 0, 2, 1), "virtual must be >= 2"),
    (lambda: in_flight("gpipe", 2, 0, 2), "schedule must be one of"),
    (lambda: in_flight("1f1b", 2, 2, 2), "rank must be in [0, 2)"),
    (lambda: pp_collectives(LOSS_CFG, Run(batch=3, seq=8, dtype="fp32"), 2, 0, microbatches=2), "batch (3)"),
    (lambda: pp_rank_memory(ModelConfig(name="t", hidden=8, layers=2, heads=2, intermediate=8, vocab=9,
                                        tie_embeddings=True), LOSS_RUN, 2, 0), "tie_embeddings"),
    (lambda: pp_rank_memory(LOSS_CFG, Run(batch=2, seq=8, dtype="amp"), 2, 0), "dtype amp"),
    (lambda: pp_rank_memory(LOSS_CFG, LOSS_RUN, 2, 0, 2, dp_rank=2), "dp_rank must be in [0, 2)"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_one_line(i):
    fn, words = BAD[i]
    with pytest.raises(ConfigError) as e:
        fn()
    assert words in str(e.value) and "\n" not in str(e.value)


CLI_SHAPE = ["--hidden", "32", "--layers", "4", "--heads", "4", "--intermediate", "64", "--vocab", "97"]


@pytest.mark.parametrize("argv,words", [
    (["--pp", "2", *CLI_SHAPE], "dtype amp under pipeline parallel"),  # the flags' default dtype is amp
    (["--pp", "2", *CLI_SHAPE, "--dtype", "fp32"], "pp x dp = 2 ranks, but the job has 1"),
    (["--pp", "2", *CLI_SHAPE, "--dtype", "fp32", "--split", "1,x"], "split must be layer counts"),
    (["--pp", "2", *CLI_SHAPE, "--dtype", "fp32", "--schedule", "gpipe"], "schedule must be one of"),
    (["--pp", "x"], "argument --pp: invalid int value"),
], ids=["amp-without-dp", "world", "split", "schedule", "pp-not-int"])
def test_cli_bad_input_one_line(argv, words, capsys, monkeypatch):
    from llm_anatomy.distributed.pipeline_step import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        rc = main.__wrapped__(argv)  # without torchrun's error-file recorder, which wants a real stderr
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.distributed
def test_torchrun_pipeline_two_ranks(tmp_path, claims):
    """The documented launch works on CPU: torchrun, gloo, interleaved 1F1B over 2 ranks, the last stage's loss
    printed each step, and each rank's report exact against the calculator."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "llm_anatomy.distributed.pipeline_step", "--pp", "2", "--schedule", "interleaved-1f1b",
           "--stages-per-rank", "2", *CLI_SHAPE,
           "--batch", "4", "--seq", "8", "--microbatches", "4", "--dtype", "fp32", "--steps", "2",
           "--split", "1,1,1,1", "--report", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         cwd=os.path.dirname(__file__) + "/..")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" loss " in s for s in steps), out.stdout
    cfg = ModelConfig(name="custom", hidden=32, layers=4, heads=4, intermediate=64, vocab=97)
    for r in range(2):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        sc = dict(cfg=cfg, run=Run(batch=4, seq=8, dtype="fp32"), pp=2, dp=1, schedule="interleaved-1f1b",
                  microbatches=4, virtual=2, split=[1, 1, 1, 1], variant="baseline")
        for rec in rep["steps"]:
            _check_rank(claims, sc, rec)
