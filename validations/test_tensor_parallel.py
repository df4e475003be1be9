"""Claims: tensor parallel (+ sequence parallel) and TP x FSDP2 on a (dp, tp) DeviceMesh, predicted per rank
(llm_anatomy.calculator.tensor_parallel) vs what DTensor and FSDP2 do (llm_anatomy.distributed.mesh_step).

  gloo, 2 processes    TP 2 on hypothesis-drawn configs and runs
  gloo, 4 processes    TP 4, and TP 2 x FSDP 2, on hypothesis-drawn configs and runs; a 2 x 2 loss curve
  every rank, every step: params/grads/optimizer bytes, and (mesh dim, op, dtype, bytes) -> calls
  bad input            one-line ConfigError naming the field
All the draws of one world size run in ONE spawn (a module-scoped fixture), so the file stays fast.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import strategies as st

from llm_anatomy.calculator.tensor_parallel import (check_mesh, check_run, grouped_counts, tp_collectives,
                                                    tp_rank_memory, tp_saved)
from llm_anatomy.config import PRESETS, ConfigError, ModelConfig, Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.train_cases import one_process_losses

N_DRAWS = 20  # per mesh


@st.composite
def tp_cases(draw, tp: int, dp: int) -> dict:
    """A config the plan can shard over tp (heads, kv_heads, intermediate, vocab multiples of tp), and a run whose
    seq splits over tp; head_dim and widths are drawn so that FSDP's dim-0 shards of the TP-local tensors pad."""
    kv = tp * draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    qk_norm = draw(st.booleans())  # Qwen3: per-head q/k norms, and a hidden width apart from heads x head_dim
    hidden = draw(st.integers(4, 48)) if qk_norm else heads * head_dim
    cfg = ModelConfig(name=f"tp{tp}-draw", hidden=hidden, layers=draw(st.integers(1, 2)), heads=heads, kv_heads=kv,
                      head_dim=head_dim, intermediate=tp * draw(st.integers(1, 24)),
                      vocab=tp * draw(st.integers(1, 80)), mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])),
                      qkv_bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()), qk_norm=qk_norm)
    dtypes = ["fp32", "bf16", "amp"] if dp > 1 else ["fp32", "bf16"]
    run = Run(batch=draw(st.integers(1, 3)), seq=tp * draw(st.integers(1, 6)), dtype=draw(st.sampled_from(dtypes)))
    case = dict(cfg=cfg, run=run, tp=tp, steps=2, optimizer=draw(st.sampled_from(["adamw", "sgd"])))
    if dp > 1:  # FSDP's options: its collectives' dtypes and the backward's re-gather
        case.update(reshard_after_forward=draw(st.booleans()),
                    reduce_dtype=draw(st.sampled_from(["auto", "float32", "bfloat16"])))
    return case


# the 2 x 2 loss curve: fp32, a learning rate that moves the loss, four steps
CURVE_CFG = ModelConfig(name="tp-curve", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=256)
CURVE = dict(cfg=CURVE_CFG, run=Run(batch=2, seq=16, dtype="fp32"), tp=2, steps=4, lr=1e-2)
# reduction order only: TP sums each row-parallel matmul as hidden/tp partials then across ranks, and FSDP averages
# the dp ranks' gradients where one process sums the whole batch, so step 1 differs by about one fp32 ulp (2^-23
# relative); Adam's normalised update (lr x m / sqrt(v)) turns last-bit gradient differences into weight differences
# of order lr x eps that compound step by step. 1e-5 relative is ~80 ulp at step 4 (docs/parallelism.md).
CURVE_TOL = 1e-5

MESHES = {2: [("tp2", 2, 1)], 4: [("tp4", 4, 1), ("tp2xdp2", 2, 2)]}


def mesh_draws(world: int, seed: int) -> dict[str, dict]:
    """N_DRAWS cases of each mesh of this world size, named "<mesh>-<i>", each with its dp."""
    out = {}
    for name, tp, dp in MESHES[world]:
        for i, case in enumerate(draw_examples(tp_cases(tp, dp), N_DRAWS, seed_=seed + 10 * tp + dp)):
            out[f"{name}-{i}"] = dict(case, dp=dp)
    return out


def _scenarios(world: int) -> dict[str, dict]:
    out = mesh_draws(world, 4700)
    if world == 4:
        out["curve"] = dict(CURVE, dp=2)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def mesh_run(request):
    from llm_anatomy.distributed.mesh_step import train
    from llm_anatomy.distributed.train_step import spawn_named

    world = request.param
    scen = _scenarios(world)
    return world, scen, spawn_named(world, scen, fn=train)


def check_collectives(world: int, scen: dict, res: dict, claims, variant: str = "baseline") -> None:
    """Every collective of every step on every rank, with its mesh dim, against tp_collectives."""
    for name, sc in scen.items():
        # mesh_step's "auto" is the dtype policy's choice (amp: bf16 all-gathers, fp32 reduce-scatters)
        pd, rd = {"amp": ("bfloat16", "float32")}.get(sc["run"].dtype, (None, None))
        rd = rd if sc.get("reduce_dtype", "auto") == "auto" else sc["reduce_dtype"]
        pred = grouped_counts(tp_collectives(sc["cfg"], sc["run"], sc["tp"], sc["dp"],
                                             optimizer=sc.get("optimizer", "adamw"), param_dtype=pd, reduce_dtype=rd,
                                             reshard_after_forward=sc.get("reshard_after_forward", True),
                                             variant=variant))
        for r in range(world):
            for rec in res[name][r]:
                meas = {tuple(k[:3]) + (k[3],): n for *k, n in rec["collectives"]}
                note = f"{name}: {draw_note(sc, rank=r, step=rec['step'])}"
                claims.check("tp collective calls per step", component="comm", config=sc["cfg"].name,
                             variant=variant, predicted=sum(pred.values()), measured=sum(meas.values()),
                             unit="calls", note=note)
                assert meas == pred, f"{note}: (dim, op, dtype, bytes) -> calls differ\n meas {meas}\n pred {pred}"


def check_rank_bytes(world: int, scen: dict, res: dict, claims, variant: str = "baseline") -> None:
    """Each rank's params/grads/optimizer bytes after every step against tp_rank_memory."""
    for name, sc in scen.items():
        for r in range(world):
            pred = tp_rank_memory(sc["cfg"], sc["run"], sc["tp"], sc["dp"], rank=r,
                                  optimizer=sc.get("optimizer", "adamw"), variant=variant)
            for rec in res[name][r]:
                for what in ("params", "grads", "optimizer"):
                    claims.check(f"tp per-rank {what} bytes", component="comm", config=sc["cfg"].name,
                                 variant=variant, predicted=pred[what], measured=rec["memory"][what], unit="B",
                                 note=f"{name}: {draw_note(sc, rank=r, after_step=rec['step'])}")


def check_saved(world: int, scen: dict, res: dict, claims, variant: str = "baseline") -> None:
    """Each rank's step-1 saved bytes per component (local storage) against tp_saved."""
    for name, sc in scen.items():
        pred = tp_saved(sc["cfg"], sc["run"], variant, sc["tp"], sc["dp"])["total"]
        for r in range(world):
            meas = res[name][r][0]["saved"]
            for comp in sorted(set(pred) | set(meas)):
                claims.check("tp per-rank saved bytes", component=comp, config=sc["cfg"].name, variant=variant,
                             predicted=pred.get(comp, 0), measured=meas.get(comp, 0), unit="B",
                             note=f"{name}: {draw_note(sc, rank=r)}")


@pytest.mark.distributed
def test_tp_collectives_exact(mesh_run, claims):
    """Every collective of every step on every rank, with the mesh dim it ran on, equals the prediction."""
    world, scen, res = mesh_run
    assert len(scen) >= N_DRAWS * len(MESHES[world])
    check_collectives(world, scen, res, claims)


@pytest.mark.distributed
def test_tp_rank_bytes_exact(mesh_run, claims):
    """Each rank's parameter, gradient and optimizer-state bytes after every step equal the prediction."""
    check_rank_bytes(*mesh_run, claims)


@pytest.mark.distributed
def test_tp_saved_bytes_per_component_exact(mesh_run, claims):
    """What each rank's forward saves for backward, per component (local storage), equals tp_saved."""
    check_saved(*mesh_run, claims)


def _single_process_losses(sc: dict, dp: int) -> list[float]:
    """The same steps in one process: the dp ranks' batches side by side, one model, plain AdamW."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    cfg, run = sc["cfg"], sc["run"]
    model = build_model(cfg, "baseline", seed=0)
    opt = make_optimizer("adamw", model.parameters(), sc["lr"])
    batches = [make_batch(cfg, run, seed=1 + r) for r in range(dp)]
    ids, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    return one_process_losses(model, opt, ids, targets, sc["steps"])


@pytest.mark.distributed
def test_tp_fsdp_loss_curve_matches_single_process(mesh_run, claims):
    """2 x 2 (TP x FSDP, fp32): the mean of the dp ranks' losses equals the one-process run's at every step, within
    CURVE_TOL (reduction order only); the TP ranks of one dp rank agree exactly."""
    world, _, res = mesh_run
    if world != 4:
        pytest.skip("the 2 x 2 curve runs on 4 ranks")
    ranks = res["curve"]
    single = _single_process_losses(CURVE, 2)
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    for step in range(CURVE["steps"]):
        per = [ranks[r][step]["loss"] for r in range(4)]
        assert per[0] == per[1] and per[2] == per[3], f"TP ranks disagree at step {step + 1}: {per}"
        mesh = (per[0] + per[2]) / 2
        claims.check("tp x fsdp loss vs one process", component="loss", config=CURVE_CFG.name, variant="baseline",
                     predicted=single[step], measured=mesh, tolerance=CURVE_TOL, unit="nats",
                     note=f"2 x 2 mesh, fp32, step {step + 1}")


@pytest.mark.distributed
def test_torchrun_tp_two_ranks(tmp_path, claims):
    """The documented launch works on CPU: torchrun, gloo, TP 2; rank 0 prints the loss each step, and each rank's
    report holds the predicted collectives and bytes."""
    import json

    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "llm_anatomy.distributed.mesh_step", "--tp", "2", "--hidden", "32", "--layers", "2", "--heads", "4",
           "--kv-heads", "2", "--intermediate", "64", "--vocab", "128", "--batch", "2", "--seq", "8", "--steps", "2",
           "--report", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert sum(line.startswith("step ") and " loss " in line for line in out.stdout.splitlines()) == 2, out.stdout
    cfg = ModelConfig(name="custom", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128)
    run = Run(batch=2, seq=8, dtype="fp32")
    pred = grouped_counts(tp_collectives(cfg, run, 2))
    for r in range(2):
        rec = json.loads((report / f"rank{r}.json").read_text())["steps"][-1]
        meas = {tuple(k[:3]) + (k[3],): n for *k, n in rec["collectives"]}
        assert meas == pred, f"torchrun rank {r}\n meas {meas}\n pred {pred}"
        mem = tp_rank_memory(cfg, run, 2, rank=r)
        for what in ("params", "grads", "optimizer"):
            claims.check(f"tp per-rank {what} bytes", component="comm", config=cfg.name, variant="baseline",
                         predicted=mem[what], measured=rec["memory"][what], unit="B", note=f"torchrun, rank {r}")


# ---- the fake process group: one rank of a 64-, 256- and 1024-rank mesh ---------------------------------------
@pytest.mark.parametrize("model, tp, dp, rank", [("llama3-8b", 4, 16, 37), ("Qwen3-0.6B", 8, 32, 100),
                                                 ("llama3-8b", 8, 128, 1023)],
                         ids=["llama3-8b-tp4xdp16", "qwen3-0.6b-tp8xdp32", "llama3-8b-tp8xdp128"])
def test_fake_pg_large_mesh_exact(model, tp, dp, rank, claims):
    """DTensor and FSDP2 run their own code on fake tensors for one rank of tp x dp; its collectives (by mesh dim)
    and its params/grads/optimizer bytes equal the prediction. Qwen3-0.6B: tied embeddings and per-head q/k norms."""
    check_fake_pg(model, tp, dp, rank, claims)


def check_fake_pg(model: str | ModelConfig, tp: int, dp: int, rank: int, claims, variant: str = "baseline",
                  run: Run | None = None) -> None:
    """One rank of a tp x dp mesh on the fake process group against tp_collectives and tp_rank_memory. model: a
    preset's or a committed HF config's name, or a config; run: B 1, S 16, amp unless given."""
    from llm_anatomy.distributed.mesh_step import simulate
    from llm_anatomy.hf_config import from_hf_config
    from validations.hf_configs import HF_CONFIGS

    if isinstance(model, ModelConfig):
        cfg = model
    else:
        cfg = PRESETS[model] if model in PRESETS else from_hf_config(HF_CONFIGS[model])
    run = run or Run(batch=1, seq=16, dtype="amp")
    rec = simulate(cfg, run, tp, dp, rank=rank, variant=variant)[-1]
    pred = grouped_counts(tp_collectives(cfg, run, tp, dp, variant=variant))
    meas = {tuple(k[:3]) + (k[3],): n for *k, n in rec["collectives"]}
    note = f"fake process group, tp {tp} x dp {dp}, rank {rank}"
    claims.check("tp collective calls per step", component="comm", config=cfg.name, variant=variant,
                 predicted=sum(pred.values()), measured=sum(meas.values()), unit="calls", note=note)
    assert meas == pred, f"{note}\n meas {meas}\n pred {pred}"
    mem = tp_rank_memory(cfg, run, tp, dp, rank=rank, variant=variant)
    for what in ("params", "grads", "optimizer"):
        claims.check(f"tp per-rank {what} bytes", component="comm", config=cfg.name, variant=variant,
                     predicted=mem[what], measured=rec["memory"][what], unit="B", note=note)


# ---- refusals: one line naming the field --------------------------------------------------------------------
OK = ModelConfig(name="ok", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=128)


@pytest.mark.parametrize("cfg, tp, field", [
    (ModelConfig(hidden=24, layers=1, heads=3, intermediate=64, vocab=128), 2, "heads"),
    (ModelConfig(hidden=32, layers=1, heads=4, kv_heads=1, intermediate=64, vocab=128), 2, "kv_heads"),
    (ModelConfig(hidden=32, layers=1, heads=4, intermediate=66, vocab=128), 4, "intermediate"),
    (ModelConfig(hidden=32, layers=1, heads=4, intermediate=64, vocab=127), 2, "vocab"),
])
def test_unshardable_config_refused(cfg, tp, field):
    with pytest.raises(ConfigError, match=field) as e:
        check_mesh(cfg, tp)
    assert "\n" not in str(e.value)


def test_unsupported_mesh_refused():
    for kw, what in ((dict(tp=0), "tp"), (dict(tp=2, cp=2), "cp > 1"), (dict(tp=2, variant="liger"), "baseline and efficient")):
        with pytest.raises(ConfigError, match=what):
            check_mesh(OK, **kw)
    with pytest.raises(ConfigError, match="seq=9"):
        check_run(Run(batch=1, seq=9, dtype="fp32"), 2)
    with pytest.raises(ConfigError, match="amp"):
        check_run(Run(batch=1, seq=8, dtype="amp"), 2, 1)
    with pytest.raises(ConfigError, match="ademamix"):
        tp_collectives(OK, Run(batch=1, seq=8, dtype="fp32"), 2, 1, optimizer="ademamix")
    with pytest.raises(ConfigError, match="rank"):
        tp_rank_memory(OK, Run(batch=1, seq=8, dtype="fp32"), 2, 2, rank=4)


@pytest.mark.parametrize("world, flags, says", [
    ("2", ["--heads", "3", "--hidden", "24"], "heads=3"),
    ("2", ["--heads", "4", "--hidden", "32", "--seq", "7"], "seq=7"),
    ("3", ["--heads", "4", "--hidden", "32"], "divisor of the world size 3"),
])
def test_mesh_step_bad_input_one_line(world, flags, says):
    """Checked before any process group starts: one line on stderr, exit 2."""
    env = dict(os.environ, WORLD_SIZE=world)
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.distributed.mesh_step", "--tp", "2", "--layers", "1",
                          "--intermediate", "64", "--vocab", "128", "--seq", "8", *flags],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
