"""Claims: the efficient variant under tensor parallel (+ sequence parallel) and TP x FSDP2, its fused kernels on
column shards (llm_anatomy/distributed/tensor_parallel.py, tp_layout.py, tp_kernels.py), predicted per rank by
llm_anatomy.calculator.tensor_parallel (variant="efficient") and measured on gloo ranks (distributed.mesh_step).

  gloo, 2 processes    TP 2 on hypothesis-drawn configs and runs; a TP 2 loss curve against the one-process efficient
                       model; the gathered state dict loads into one-process models of both variants' keys; the
                       Triton kernels (TRITON_INTERPRET=1) on the ranks' shards against one process on the same kernels
  gloo, 4 processes    TP 4, and TP 2 x FSDP 2, on hypothesis-drawn configs and runs
  every rank, every step: params/grads/optimizer bytes, saved bytes per component, (mesh dim, op, dtype, bytes) -> calls
  fake process group   one rank of a 64- and a 256-rank mesh: collectives and bytes
The draws are test_tensor_parallel.py's (tp_cases); all the draws of one world size run in ONE spawn.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from llm_anatomy.calculator.tensor_parallel import tp_rank_memory
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.kernels import INTERPRET
from validations.kernel_cases import needs_interpreter
from validations.test_tensor_parallel import (CURVE_CFG, MESHES, N_DRAWS, OK, check_collectives, check_fake_pg,
                                              check_rank_bytes, check_saved, mesh_draws)
from validations.train_cases import one_process_losses

VARIANT = "efficient"
# TP 2 alone (no FSDP averaging): the row-parallel matmuls' partial sums are the only reduction-order difference
CURVE = dict(cfg=CURVE_CFG, run=Run(batch=2, seq=16, dtype="fp32"), tp=2, steps=4, lr=1e-2)
CURVE_TOL = 1e-5  # relative: reduction order only (test_tensor_parallel.py's CURVE_TOL says why)
STATE = dict(cfg=ModelConfig(name="tp-state", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=64,
                             qkv_bias=True, qk_norm=True, head_dim=8), run=Run(batch=2, seq=8, dtype="fp32"), lr=0.1)
# the Triton kernels (TRITON_INTERPRET=1) on each rank's shards: qk-norm, GQA, a qkv bias, gpt-oss's activation
TRITON = dict(cfg=ModelConfig(name="tp-triton", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=32, vocab=64,
                              qkv_bias=True, qk_norm=True, head_dim=8, mlp="gpt-oss"),
              run=Run(batch=1, seq=8, dtype="fp32"), tp=2, steps=2, lr=1e-2)
STATE_TOL = 1e-6  # one SGD step: the weights differ by lr x the gradient's reduction-order ulps


def _state_after_one_step(cfg: ModelConfig, run: Run, lr: float) -> dict:
    """One SGD step of the efficient model on a TP-only mesh of the world; the state dict gathered to one process."""
    import torch.distributed as dist

    from llm_anatomy.distributed.tensor_parallel import build_mesh, loss_context, parallelize
    from llm_anatomy.distributed.tp_layout import one_process_state_dict
    from llm_anatomy.models import build_model, make_batch

    tp = dist.get_world_size()
    model = parallelize(build_model(cfg, VARIANT, seed=0), build_mesh(1, tp))
    ids, targets = make_batch(cfg, run, seed=1)
    with loss_context(tp):
        model(ids, targets).backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {k: v.tolist() for k, v in one_process_state_dict(model, tp).items()}


def _scenario(kind: str = "train", **kw):
    """A spawned rank's scenario: mesh_step.train on the efficient variant (kind "triton": its ops through the Triton
    kernels, interpreted on CPU), or the gathered state dict."""
    from llm_anatomy.distributed.mesh_step import train
    from llm_anatomy.kernels import triton_on_cpu

    if kind == "state":
        return _state_after_one_step(**kw)
    with triton_on_cpu() if kind == "triton" else contextlib.nullcontext():
        return train(variant=VARIANT, **kw)


def _scenarios(world: int) -> dict[str, dict]:
    out = mesh_draws(world, 4750)
    if world == 2:
        out["curve"] = dict(CURVE, dp=1)
        out["state"] = dict(STATE, kind="state")
        if INTERPRET:  # the Triton kernels run on CPU ranks under the interpreter only
            out["triton"] = dict(TRITON, kind="triton", dp=1)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def mesh_run(request):
    from llm_anatomy.distributed.train_step import spawn_named

    world = request.param
    scen = _scenarios(world)
    return world, scen, spawn_named(world, scen, fn=_scenario)


def _draws(scen: dict) -> dict:
    return {k: v for k, v in scen.items() if k not in ("curve", "state", "triton")}


@pytest.mark.distributed
def test_tp_efficient_collectives_exact(mesh_run, claims):
    """Every collective of every step on every rank, with the mesh dim it ran on, equals the prediction."""
    world, scen, res = mesh_run
    assert len(_draws(scen)) >= N_DRAWS * len(MESHES[world])
    check_collectives(world, _draws(scen), res, claims, VARIANT)


@pytest.mark.distributed
def test_tp_efficient_rank_bytes_exact(mesh_run, claims):
    """Each rank's parameter, gradient and optimizer-state bytes after every step equal the prediction (the fused
    qkv and gate_up are one tensor each: FSDP pads and the optimizer keeps state per tensor)."""
    world, scen, res = mesh_run
    check_rank_bytes(world, _draws(scen), res, claims, VARIANT)


@pytest.mark.distributed
def test_tp_efficient_saved_bytes_per_component_exact(mesh_run, claims):
    """What each rank's forward saves for backward, per component (local storage), equals tp_saved: the fused
    kernels' saves on the rank's heads and columns, the norms' on its sequence shard, the baseline's loss."""
    world, scen, res = mesh_run
    check_saved(world, _draws(scen), res, claims, VARIANT)


def _two_ranks(mesh_run, what: str) -> dict:
    """The results of the 2-rank spawn (the TP 2 scenarios run there only)."""
    world, _, res = mesh_run
    if world != 2:
        pytest.skip(f"{what} runs on 2 ranks")
    return res


def _one_process(sc: dict):
    """(the one-process efficient model, ids, targets) that rank 0 of the scenario starts from."""
    from llm_anatomy.models import build_model, make_batch

    return (build_model(sc["cfg"], VARIANT, seed=0), *make_batch(sc["cfg"], sc["run"], seed=1))


@pytest.mark.distributed
def test_tp_efficient_loss_curve_matches_single_process(mesh_run, claims):
    """TP 2 (fp32): every rank's loss equals the one-process efficient model's at every step within CURVE_TOL."""
    from llm_anatomy.distributed.train_step import make_optimizer

    res = _two_ranks(mesh_run, "the TP 2 curve")
    model, ids, targets = _one_process(CURVE)
    single = one_process_losses(model, make_optimizer("adamw", model.parameters(), CURVE["lr"]), ids, targets,
                                CURVE["steps"])
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    for step in range(CURVE["steps"]):
        per = [res["curve"][r][step]["loss"] for r in range(2)]
        assert per[0] == per[1], f"TP ranks disagree at step {step + 1}: {per}"
        claims.check("tp (efficient) loss vs one process", component="loss", config=CURVE["cfg"].name,
                     variant=VARIANT, predicted=single[step], measured=per[0], tolerance=CURVE_TOL, unit="nats",
                     note=f"TP 2, fp32, step {step + 1}")


@pytest.mark.distributed
def test_tp_efficient_state_dict_loads_into_one_process(mesh_run):
    """The rank-order permutation is a layout: after one SGD step on TP 2, the gathered state dict loads into a
    one-process efficient model (and, split by to_baseline_names, a baseline one) and equals the one-process step."""
    from llm_anatomy.efficient.transformer import to_baseline_names
    from llm_anatomy.models import build_model

    res, cfg = _two_ranks(mesh_run, "the state dict"), STATE["cfg"]
    ref, ids, targets = _one_process(STATE)
    ref(ids, targets).backward()
    torch.optim.SGD(ref.parameters(), lr=STATE["lr"]).step()
    for r in range(2):
        got = {k: torch.tensor(v) for k, v in res["state"][r].items()}
        one = build_model(cfg, VARIANT, seed=None)
        one.load_state_dict(got)  # strict: the same keys and shapes
        for k, want in ref.state_dict().items():
            torch.testing.assert_close(one.state_dict()[k], want, rtol=STATE_TOL, atol=STATE_TOL,
                                       msg=lambda m: f"rank {r}, {k}: {m}")
        build_model(cfg, "baseline", seed=None).load_state_dict(to_baseline_names(got, cfg))


@pytest.mark.parametrize("model, tp, dp, rank", [("llama3-8b", 4, 16, 37), ("Qwen3-0.6B", 8, 32, 100)],
                         ids=["llama3-8b-tp4xdp16", "qwen3-0.6b-tp8xdp32"])
def test_efficient_fake_pg_large_mesh_exact(model, tp, dp, rank, claims):
    """One rank of a 64- and a 256-rank mesh (Qwen3-0.6B: tied, qk_norm) on the fake process group: DTensor and
    FSDP2 run the efficient model's plan, fused rows and norm sharding rules included; its collectives and bytes
    equal the prediction."""
    check_fake_pg(model, tp, dp, rank, claims, VARIANT)


@needs_interpreter
@pytest.mark.distributed
def test_tp_efficient_triton_kernels_on_shards(mesh_run, claims):
    """The fused Triton kernels (rms_norm through its sharding rule, rope_qkv and swiglu_packed on the local
    columns) on TP 2 ranks: every rank's loss equals the one-process efficient model's on the same kernels within
    CURVE_TOL, at every step."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.kernels import triton_on_cpu

    res = _two_ranks(mesh_run, "the Triton scenario")
    model, ids, targets = _one_process(TRITON)
    with triton_on_cpu():
        single = one_process_losses(model, make_optimizer("adamw", model.parameters(), TRITON["lr"]), ids, targets,
                                    TRITON["steps"])
    for step in range(TRITON["steps"]):
        for r in range(2):
            claims.check("tp (efficient, Triton kernels) loss vs one process", component="loss",
                         config=TRITON["cfg"].name, variant=VARIANT, predicted=single[step],
                         measured=res["triton"][r][step]["loss"], tolerance=CURVE_TOL, unit="nats",
                         note=f"TP 2, fp32, rank {r}, step {step + 1}, TRITON_INTERPRET=1")


def test_efficient_refusals_one_line():
    """The efficient option the plan does not shard (the lean block): one line naming the option; recompute runs
    (validations/test_tp_recompute_efficient.py)."""
    from llm_anatomy.calculator.tensor_parallel import check_run

    run = Run(batch=1, seq=8, dtype="fp32", lean=True)
    with pytest.raises(ConfigError, match="--no-lean") as e:
        check_run(run, 2, 1, VARIANT)
    assert "\n" not in str(e.value)
    check_run(run, 1, 1, VARIANT)  # one rank: nothing to shard
    for rc in ("mlp", "full"):
        check_run(Run(batch=1, seq=8, dtype="fp32", recompute=rc), 2, 1, VARIANT)
    with pytest.raises(ConfigError, match="heads=3"):
        tp_rank_memory(ModelConfig(hidden=24, layers=1, heads=3, intermediate=64, vocab=128),
                       Run(batch=1, seq=8, dtype="fp32"), 2, variant=VARIANT)
    assert tp_rank_memory(OK, Run(batch=1, seq=8, dtype="fp32"), 2, variant=VARIANT)["params"] > 0
