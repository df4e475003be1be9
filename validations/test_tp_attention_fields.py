"""Claims: gpt-oss's attention fields under tensor parallel (+ sequence parallel) and TP x FSDP2, both variants
(llm_anatomy/distributed/tensor_parallel.py): the sinks Shard(0) with the heads, a sliding window's additive mask
replicated (one (S, S) mask, the same on every rank), o's bias Replicate under RowwiseParallel (added once: DTensor
hands each rank bias / tp into the partial sums, and the reduce-scatter adds them up). Predicted per rank by
llm_anatomy.calculator.tensor_parallel, measured on gloo ranks (distributed.mesh_step).

  gloo, 2 processes    TP 2 on drawn dense configs with sinks, windows and o's bias; a TP 2 loss curve per variant
  gloo, 4 processes    TP 4 and TP 2 x FSDP 2 on drawn configs; a 2 x 2 loss curve per variant
  every rank, every step: params/grads/optimizer bytes, saved bytes per component, (mesh dim, op, dtype, bytes) -> calls
  bad input            OLMoE's whole q/k norm (qk_norm_whole) refused in one line
All the draws of one world size, both variants, run in ONE spawn (a module-scoped fixture), so the file stays fast.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from llm_anatomy.calculator.mesh import Mesh
from llm_anatomy.calculator.mesh import check_mesh as plan_check
from llm_anatomy.calculator.tensor_parallel import check_mesh, tp_unit_shapes
from llm_anatomy.config import ConfigError, ModelConfig, Run
from validations.configs import draw_examples
from validations.test_tensor_parallel import (CURVE_TOL, check_collectives, check_fake_pg, check_rank_bytes,
                                              check_saved)
from validations.train_cases import one_process_losses

N_DRAWS = 20  # per mesh, the variants taking turns
VARIANTS = ("baseline", "efficient")
MESHES = {2: [("tp2", 2, 1)], 4: [("tp4", 4, 1), ("tp2xdp2", 2, 2)]}


@st.composite
def field_cases(draw, tp: int, dp: int) -> dict:
    """A dense config the plan can shard over tp with gpt-oss's attention fields (at least one of sinks, a window
    on all or the even layers, o's bias), and a run whose seq splits over tp; per-head q/k norms (Qwen3's) and a q/k/v
    bias drawn alongside, widths drawn so that FSDP's dim-0 shards of the TP-local tensors (the sinks' heads / tp
    included) pad."""
    kv = tp * draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    sinks, o_bias, windowed = draw(st.sampled_from([(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)
                                                    if a or b or c]))
    seq = tp * draw(st.integers(1, 6))
    window = draw(st.integers(1, seq)) if windowed else None
    qk_norm = draw(st.booleans())
    cfg = ModelConfig(name=f"tp{tp}-fields", hidden=draw(st.integers(4, 48)) if qk_norm else heads * head_dim,
                      layers=draw(st.integers(1, 2)), heads=heads, kv_heads=kv, head_dim=head_dim,
                      intermediate=tp * draw(st.integers(1, 24)), vocab=tp * draw(st.integers(1, 80)),
                      mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])), qkv_bias=draw(st.booleans()),
                      tie_embeddings=draw(st.booleans()), qk_norm=qk_norm, attn_sinks=bool(sinks),
                      o_bias=bool(o_bias), window=window,
                      window_pattern=draw(st.sampled_from(["all", "even"])) if window else "all")
    dtypes = ["fp32", "bf16", "amp"] if dp > 1 else ["fp32", "bf16"]
    run = Run(batch=draw(st.integers(1, 3)), seq=seq, dtype=draw(st.sampled_from(dtypes)))
    # one step: the fields add no state across steps (test_tensor_parallel.py's two-step draws cover the plan's)
    case = dict(cfg=cfg, run=run, tp=tp, steps=1, optimizer=draw(st.sampled_from(["adamw", "sgd"])))
    if dp > 1:
        case.update(reshard_after_forward=draw(st.booleans()),
                    reduce_dtype=draw(st.sampled_from(["auto", "float32", "bfloat16"])))
    return case


# the loss curves: fp32, a learning rate that moves the loss, four steps; every field on, GQA, the even layers
# windowed (window 5 of seq 16: the window masks real keys)
CURVE_CFG = ModelConfig(name="tp-gptoss-curve", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
                        vocab=256, qkv_bias=True, o_bias=True, attn_sinks=True, window=5, window_pattern="even")
CURVE = dict(cfg=CURVE_CFG, run=Run(batch=2, seq=16, dtype="fp32"), tp=2, steps=4, lr=1e-2)


def _scenarios(world: int) -> dict[str, dict]:
    """N_DRAWS configs per mesh, the variants taking turns (half each); a loss curve per variant."""
    out = {}
    for name, tp, dp in MESHES[world]:
        for i, case in enumerate(draw_examples(field_cases(tp, dp), N_DRAWS, seed_=4800 + 10 * tp + dp)):
            variant = VARIANTS[i % len(VARIANTS)]
            out[f"{variant}-{name}-{i}"] = dict(case, dp=dp, variant=variant)
    for variant in VARIANTS:
        out[f"{variant}-curve"] = dict(CURVE, dp=world // 2, variant=variant)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def mesh_run(request):
    from llm_anatomy.distributed.mesh_step import train
    from llm_anatomy.distributed.train_step import spawn_named

    world = request.param
    scen = _scenarios(world)
    return world, scen, spawn_named(world, scen, fn=train)


def _draws(scen: dict, variant: str) -> dict:
    return {k: v for k, v in scen.items() if v["variant"] == variant and not k.endswith("-curve")}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_fields_collectives_exact(mesh_run, variant, claims):
    """Every collective of every step on every rank, with the mesh dim it ran on, equals the prediction: the sinks
    (Shard(0)) and o's bias (Replicate) add none to the plan's."""
    world, scen, res = mesh_run
    draws = _draws(scen, variant)
    assert len(draws) == N_DRAWS // len(VARIANTS) * len(MESHES[world])
    check_collectives(world, draws, res, claims, variant)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_fields_rank_bytes_exact(mesh_run, variant, claims):
    """Each rank's parameter, gradient and optimizer-state bytes after every step equal the prediction: the sinks
    heads / tp per rank, o's bias whole on every rank (FSDP then shards both over dp)."""
    world, scen, res = mesh_run
    check_rank_bytes(world, _draws(scen, variant), res, claims, variant)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_fields_saved_bytes_per_component_exact(mesh_run, variant, claims):
    """What each rank's forward saves for backward, per component (local storage), equals tp_saved: the sinks'
    softmax column (baseline) or SDPA's sink key (efficient) on the rank's heads, the window's mask whole."""
    world, scen, res = mesh_run
    check_saved(world, _draws(scen, variant), res, claims, variant)


def _one_process_losses(variant: str, dp: int) -> list[float]:
    """CURVE in one process: the dp ranks' batches side by side, one model, plain AdamW."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    cfg, run = CURVE["cfg"], CURVE["run"]
    model = build_model(cfg, variant, seed=0)
    opt = make_optimizer("adamw", model.parameters(), CURVE["lr"])
    batches = [make_batch(cfg, run, seed=1 + r) for r in range(dp)]
    ids, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    return one_process_losses(model, opt, ids, targets, CURVE["steps"])


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_fields_loss_curve_matches_single_process(mesh_run, variant, claims):
    """TP 2 (2 ranks) and TP 2 x FSDP 2 (4 ranks), fp32, every field on: the mean of the dp ranks' losses equals the
    one-process run's at every step within test_tensor_parallel's CURVE_TOL (reduction order only); the TP ranks of
    one dp rank agree exactly."""
    world, _, res = mesh_run
    dp, ranks = world // 2, res[f"{variant}-curve"]
    single = _one_process_losses(variant, dp)
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    for step in range(CURVE["steps"]):
        per = [ranks[r][step]["loss"] for r in range(world)]
        assert all(per[2 * d] == per[2 * d + 1] for d in range(dp)), f"TP ranks disagree at step {step + 1}: {per}"
        mesh = sum(per[2 * d] for d in range(dp)) / dp
        claims.check("tp (gpt-oss attention) loss vs one process", component="loss", config=CURVE_CFG.name,
                     variant=variant, predicted=single[step], measured=mesh, tolerance=CURVE_TOL, unit="nats",
                     note=f"{'TP 2' if dp == 1 else '2 x 2 (TP x FSDP)'}, fp32, step {step + 1}")


# gpt-oss-20b's attention at full width over a dense MLP (its MoE layers are refused under tp): 64 heads of 64 over
# 8 kv heads, sinks, a window of 128 on the even layers, q/k/v and o biases, its 201,088-token vocabulary
GPTOSS_DENSE = ModelConfig(name="gpt-oss-20b-dense", hidden=2880, layers=4, heads=64, kv_heads=8, head_dim=64,
                           intermediate=2880, vocab=201088, mlp="gpt-oss", qkv_bias=True, o_bias=True,
                           attn_sinks=True, window=128, window_pattern="even", rope_theta=150000.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fake_pg_gptoss_dense_exact(variant, claims):
    """One rank of tp 8 x dp 16 (128 ranks) on the fake process group: DTensor and FSDP2 run the plan, sinks and o's
    bias included, at gpt-oss-20b's attention widths; its collectives and bytes equal the prediction."""
    check_fake_pg(GPTOSS_DENSE, 8, 16, 45, claims, variant)


def test_fields_local_shapes():
    """The calculator's TP-local tensors: the sinks split with the heads, o's bias whole."""
    cfg = CURVE_CFG
    for variant in VARIANTS:
        block = dict(tp_unit_shapes(cfg, 2, variant)[1][1])
        sinks, bias = block["layers.0.attn.sinks"], block["layers.0.attn.o.bias"]
        assert sinks == (cfg.heads // 2,) and bias == (cfg.hidden,), block


def test_whole_qk_norm_refused_one_line():
    """OLMoE's whole q/k norm spans every head: tp > 1 refuses it in one line naming the field; one rank runs it."""
    cfg = ModelConfig(name="olmoe-attn", hidden=64, layers=1, heads=4, intermediate=32, vocab=128, qk_norm=True,
                      qk_norm_whole=True)
    for variant in VARIANTS:
        with pytest.raises(ConfigError, match="qk_norm_whole") as e:
            check_mesh(cfg, 2, variant=variant)
        assert "\n" not in str(e.value)
        check_mesh(cfg, 1, variant=variant)
    with pytest.raises(ConfigError, match="qk_norm_whole") as e:  # the planner refuses the mesh alike
        plan_check(cfg, Mesh(dp=2, tp=2))
    assert "\n" not in str(e.value)
    plan_check(cfg, Mesh(dp=4))
