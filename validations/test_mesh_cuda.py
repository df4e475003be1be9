"""Claims: the tensor-parallel and pipeline-parallel code paths run on a mesh of world size 1 in one process, on
CUDA with NCCL (the one GPU lent: the `gpu` cases) and on gloo/CPU (the same cases, so they run anywhere), and train
as the single-process model does.

  the ("pp", "dp", "tp") = (1, 1, 1) mesh over a process group of one rank, its rendezvous a FileStore in a
  temporary folder; every case STEPS AdamW steps on one batch, fp32:
  TP       mesh_step.train with the plan applied on the one-rank tp mesh (apply_tp(one_rank=True): DTensor
           parameters, sequence-parallel norms, the vocab-sharded head's loss under loss_parallel), baseline and
           efficient (its fused rows in rank order, the baseline head)
  PP       pipeline_step.train_pp, 1F1B (one stage) and interleaved 1F1B (two stages on the one rank, handed over
           in-process by torch.distributed.pipelining), baseline and efficient
  TP x PP  the same with the TP plan applied before the stages are cut (baseline: TP inside stages runs the baseline)
  each     every step's loss equals the single-process model's (same weights, same batch) within LOSS_TOL, and the
           rank's parameter, gradient and optimizer bytes after each step equal the calculator's exactly
           (tp_rank_memory, pp_rank_memory at tp = pp = dp = 1)
"""
from __future__ import annotations

import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from llm_anatomy.calculator.pipeline_parallel import pp_rank_memory
from llm_anatomy.calculator.tensor_parallel import tp_rank_memory
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.distributed import mesh_step, pipeline_tp, tensor_parallel
from llm_anatomy.distributed.pipeline_step import train_pp
from llm_anatomy.distributed.train_step import make_optimizer
from llm_anatomy.models import build_model, make_batch
from validations.train_cases import one_process_losses

CFG = ModelConfig(name="mesh-one-rank", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=256,
                  tie_embeddings=False)  # untied: the pipeline holds the embedding and the head on different stages
RUN = Run(batch=4, seq=16, dtype="fp32")
STEPS, LR, MICROBATCHES = 3, 1e-2, 2
# reduction order only, in fp32: loss_parallel's cross-entropy takes the log-sum-exp in its own steps, a pipeline
# averages its micro-batches' losses and sums their gradients, where one process reduces the whole batch at once
LOSS_TOL = 1e-5
SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2}  # schedule -> stages per rank


@pytest.fixture(scope="module")
def device(request, tmp_path_factory):
    """A process group of world size 1 in this process: NCCL on CUDA, gloo on CPU (request.param, each test's
    parametrisation: the cuda case is marked gpu on the test itself, where scripts/suite_parts.py reads it)."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    cuda = request.param == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("one-rank") / "store"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    yield torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.destroy_process_group()


@pytest.fixture
def plan_on_one_rank(monkeypatch):
    """The TP plan applied on a one-rank tp mesh, and its loss under loss_parallel (loss_context's choice at tp > 1):
    apply_tp(one_rank=True) wherever the engine applies it."""
    forced = functools.partial(tensor_parallel.apply_tp, one_rank=True)
    monkeypatch.setattr(tensor_parallel, "apply_tp", forced)
    monkeypatch.setattr(pipeline_tp, "apply_tp", forced)
    with loss_parallel():
        yield


def _single(variant: str, device: torch.device) -> list[float]:
    model = build_model(CFG, variant, device=device, seed=0)
    ids, targets = make_batch(CFG, RUN, device, seed=1)
    return one_process_losses(model, make_optimizer("adamw", model.parameters(), LR), ids, targets, STEPS)


def _assert_loss_parallel_ran(recs: list[dict], key: str) -> None:
    """The plan ran: every step's loss_parallel all-reduced its reductions over the tp mesh dim (a one-rank
    collective; the pipeline's hand-overs on one rank are none)."""
    for rec in recs:
        ops = {(c[0], c[1]) for c in rec[key]}
        assert ("tp", "all_reduce") in ops, f"step {rec['step']}: no all-reduce over tp in {rec[key]}"


def _check(claims, recs: list[dict], variant: str, device: torch.device, path: str, predicted: dict) -> None:
    single = _single(variant, device)
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    assert len(recs) == STEPS
    for rec, ref in zip(recs, single):
        note = f"{path}, world size 1 on {device.type}, fp32, step {rec['step']}"
        claims.check(f"one-rank mesh loss ({path}) vs one process", component="loss", config=CFG.name,
                     variant=variant, device=device.type, predicted=ref, measured=rec["loss"], tolerance=LOSS_TOL,
                     unit="nats", note=note)
        for k in ("params", "grads", "optimizer"):
            claims.check(f"one-rank mesh {k} bytes ({path})", component="memory", config=CFG.name,
                         variant=variant, device=device.type, predicted=predicted[k], measured=rec["memory"][k],
                         unit="B", note=note)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
def test_tp_path_on_one_rank(device, plan_on_one_rank, variant, claims):
    recs = mesh_step.train(CFG, RUN, 1, steps=STEPS, lr=LR, variant=variant, trace_saved=False)
    _assert_loss_parallel_ran(recs, "collectives")
    _check(claims, recs, variant, device, "tp", tp_rank_memory(CFG, RUN, 1, 1, variant=variant))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp_path_on_one_rank(device, schedule, variant, claims):
    v = SCHEDULES[schedule]
    recs = train_pp(CFG, RUN, pp=1, schedule=schedule, microbatches=MICROBATCHES, virtual=v, variant=variant,
                    steps=STEPS, lr=LR)
    _check(claims, recs, variant, device, f"pp {schedule}", pp_rank_memory(CFG, RUN, 1, 0, virtual=v,
                                                                            variant=variant))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tp_x_pp_path_on_one_rank(device, plan_on_one_rank, schedule, claims):
    v = SCHEDULES[schedule]
    recs = train_pp(CFG, RUN, pp=1, tp=1, schedule=schedule, microbatches=MICROBATCHES, virtual=v, steps=STEPS,
                    lr=LR)
    _assert_loss_parallel_ran(recs, "by_dim")
    _check(claims, recs, "baseline", device, f"tp x pp {schedule}", pp_rank_memory(CFG, RUN, 1, 0, virtual=v, tp=1))
