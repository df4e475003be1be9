"""Claims: the vocab-parallel fused linear cross-entropy (llm_anatomy/kernels/linear_ce_tp.py), the efficient model's
head under tensor parallel (llm_anatomy/distributed/tp_head.py), on gloo ranks against one process.

  the op, 2 and 4 ranks   hypothesis-drawn (T, H, V, ignored targets, label smoothing, chunk, reduction): every rank's
                          loss equals linear_cross_entropy's on the whole weight, the ranks' d(x) summed and each rank's
                          d(W) rows equal its gradients (fp32), on the plain-torch row passes and (TRITON_INTERPRET=1)
                          the Triton ones, rows of more than one kernel block included; the all-reduces (three per
                          chunk, four with smoothing) and their bytes; the allocations of the Triton path (its row passes' outputs allocated, their
                          kernels not launched, as test_linear_ce.py's table test; the fake process group) equal
                          calculator.tensor_parallel.vocab_parallel_ce_bytes, peak and saved, to the byte
  the model, 2 ranks      TP 2 with B x S over two chunks of the head: its collectives equal tp_collectives (three
                          all-reduces per chunk); a tied model's loss curve equals one process's
  the model, 4 ranks      TP 4 and TP 2 x FSDP 2 loss curves (fp32) equal the one-process efficient model's
  evaluation              no_grad and reduction "none" on the ranks equal one process
The 20+ drawn model configs per mesh (saved bytes per component, collectives, per-rank bytes) are
test_tensor_parallel_efficient.py's, which run this head.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st

from llm_anatomy.calculator.tensor_parallel import grouped_counts, tp_collectives, vocab_parallel_ce_bytes
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.kernel_shapes import LCE_ROW_BLOCK
from llm_anatomy.kernels import INTERPRET
from llm_anatomy.kernels.linear_ce import linear_cross_entropy
from validations.configs import draw_examples
from validations.test_tensor_parallel_efficient import CURVE_TOL
from validations.train_cases import one_process_losses

N_OP_DRAWS = 12  # per world size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# two chunks of the head on each rank: 4,096 rows (kernel_shapes.C_MIN) and 16
CHUNKED = dict(cfg=ModelConfig(name="tp-head-chunks", hidden=8, layers=1, heads=2, kv_heads=2, intermediate=8,
                               vocab=64), run=Run(batch=1, seq=4112, dtype="fp32"), tp=2, steps=1, trace_saved=False)
TIED = dict(cfg=ModelConfig(name="tp-head-tied", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=96,
                            tie_embeddings=True), run=Run(batch=2, seq=8, dtype="fp32"), steps=3, lr=1e-2)
CURVE = dict(cfg=ModelConfig(name="tp-head-curve", hidden=64, layers=2, heads=4, kv_heads=4, intermediate=96,
                             vocab=256), run=Run(batch=2, seq=16, dtype="fp32"), steps=4, lr=1e-2)


@st.composite
def op_cases(draw, world: int) -> dict:
    T = draw(st.integers(1, 40))
    return dict(T=T, H=draw(st.integers(1, 24)), V=world * draw(st.integers(1, 40)), seed=draw(st.integers(0, 99)),
                ignored=draw(st.sampled_from([0.0, 0.3, 1.0])), eps=draw(st.sampled_from([0.0, 0.1])),
                chunk=draw(st.sampled_from([0, 1, 3, 16])), reduction=draw(st.sampled_from(["mean", "sum"])),
                dtype=draw(st.sampled_from(["fp32", "bf16"])))


def _tensors(c: dict):
    """x (T, H), the whole weight (V, H), targets (T,) with a share ignored: the same on every rank and in the test."""
    g = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["T"], c["H"], generator=g)
    w = torch.randn(c["V"], c["H"], generator=g) / c["H"] ** 0.5
    t = torch.randint(0, c["V"], (c["T"],), generator=g)
    t[torch.rand(c["T"], generator=g) < c["ignored"]] = -100
    return x, w, t


def _op_rank(case: dict) -> list[dict]:
    """A spawned rank's run of the op on its rows (case "triton": its Triton row passes, interpreted): loss, the
    row losses, d(x) summed over the ranks, its d(W) rows, the collectives."""
    from llm_anatomy.kernels import triton_on_cpu

    with triton_on_cpu() if case.get("triton") else contextlib.nullcontext():
        return _op_run(case)


def _op_run(case: dict) -> list[dict]:
    from llm_anatomy.distributed.counting import CollectiveCounter
    from llm_anatomy.kernels import linear_ce_tp as tp_ce

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w, t = _tensors(case)
    dt, Vr = DTYPES[case["dtype"]], case["V"] // world
    x, wr = x.to(dt).requires_grad_(), w[rank * Vr:(rank + 1) * Vr].to(dt).requires_grad_()
    args = (rank * Vr, case["V"], dist.group.WORLD)
    kw = dict(label_smoothing=case["eps"], reduction=case["reduction"], chunk=case["chunk"])
    with CollectiveCounter() as counter:
        loss = tp_ce.vocab_parallel_linear_cross_entropy(x, wr, t, *args, **kw)
    loss.backward()
    gx = x.grad.float()
    dist.all_reduce(gx)
    with torch.no_grad():
        rows = tp_ce.vocab_parallel_linear_cross_entropy(x, wr, t, *args, **dict(kw, reduction="none"))
    return [dict(loss=float(loss.detach()), rows=rows.tolist(), gx=gx.tolist(), gw=wr.grad.float().tolist(),
                 collectives=[[*k, n] for k, n in sorted(counter.counts().items())])]


def _model_rank(kind: str, **kw) -> list[dict]:
    """A spawned rank's efficient-model scenario: mesh_step.train, or the op's cases."""
    from llm_anatomy.distributed.mesh_step import train

    return _op_rank(kw) if kind == "op" else train(variant="efficient", **kw)


def _scenarios(world: int) -> dict[str, dict]:
    draws = draw_examples(op_cases(world), N_OP_DRAWS, 4800 + world)
    out = {f"op-{i}": dict(c, kind="op") for i, c in enumerate(draws)}
    if INTERPRET:  # the Triton row passes on the fp32 draws, and on rows of more than one LCE_ROW_BLOCK per rank
        out |= {f"op-{i}-triton": dict(c, kind="op", triton=True) for i, c in enumerate(draws) if c["dtype"] == "fp32"}
        out["op-blocks-triton"] = dict(T=3, H=4, V=world * (LCE_ROW_BLOCK + 8), seed=7, ignored=0.3, eps=0.1, chunk=2,
                                       reduction="mean", dtype="fp32", kind="op", triton=True)
    if world == 2:
        out["chunks"] = dict(CHUNKED, kind="train")
        out["tied"] = dict(TIED, tp=2, kind="train")
    else:
        out["tp4"] = dict(CURVE, tp=4, kind="train")
        out["tp2xdp2"] = dict(CURVE, tp=2, kind="train")
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def ranks(request):
    from llm_anatomy.distributed.train_step import spawn_named

    world = request.param
    scen = _scenarios(world)
    return world, scen, spawn_named(world, scen, fn=_model_rank)


def _ops(ranks):
    world, scen, res = ranks
    return [(name, sc, [res[name][r][0] for r in range(world)]) for name, sc in scen.items() if sc["kind"] == "op"]


def _reference(c: dict):
    """linear_cross_entropy on the whole weight in one process: loss, d(x), d(W), the row losses."""
    x, w, t = _tensors(c)
    dt = DTYPES[c["dtype"]]
    x, w = x.to(dt).requires_grad_(), w.to(dt).requires_grad_()
    loss = linear_cross_entropy(x, w, t, label_smoothing=c["eps"], reduction=c["reduction"], chunk=c["chunk"])
    loss.backward()
    with torch.no_grad():
        rows = linear_cross_entropy(x, w, t, label_smoothing=c["eps"], reduction="none")
    return float(loss.detach()), x.grad.float(), w.grad.float(), rows


def _close(got, want, what: str) -> None:
    """Reduction order only: within CURVE_TOL relative to the largest magnitude of the reference."""
    want = torch.as_tensor(want, dtype=torch.float64)
    tol = CURVE_TOL * max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), want, rtol=0, atol=tol, msg=what)


@pytest.mark.distributed
def test_op_equals_one_process(ranks, claims):
    """fp32: every rank's loss and row losses, the ranks' summed d(x) and each rank's d(W) rows equal
    linear_cross_entropy on the whole weight within CURVE_TOL (relative to the reference's largest magnitude)."""
    world = ranks[0]
    checked = 0
    for name, c, per in _ops(ranks):
        if c["dtype"] != "fp32":
            continue
        loss, gx, gw, rows = _reference(c)
        Vr = c["V"] // world
        for r, got in enumerate(per):
            note = f"{name}: {c}, rank {r} of {world}"
            claims.check("vocab-parallel linear CE loss vs one process", component="loss", config=name,
                         variant="efficient", predicted=loss, measured=got["loss"], tolerance=CURVE_TOL, unit="nats",
                         note=note)
            _close(got["rows"], rows, f"{note}: row losses")
            _close(got["gx"], gx, f"{note}: d(x)")
            _close(got["gw"], gw[r * Vr:(r + 1) * Vr], f"{note}: d(W) rows")
        checked += 1
    assert checked >= 3, f"only {checked} fp32 draws"


@pytest.mark.distributed
def test_op_collectives(ranks):
    """Three fp32 all-reduces per chunk (the max, the sum of exp, the target logit), a fourth with label smoothing
    (Σz), each of the chunk's rows, in the training call; nothing else."""
    for name, c, per in _ops(ranks):
        C = c["chunk"] or c["T"]  # the rule's chunk is every row at these sizes
        want: dict = {}
        for s in range(0, c["T"], C):
            key = ("all_reduce", "float32", 4 * min(C, c["T"] - s))
            want[key] = want.get(key, 0) + 3 + (c["eps"] != 0)
        for r, got in enumerate(per):
            assert {tuple(k[:3]): k[3] for k in got["collectives"]} == want, f"{name}: {c}, rank {r}"


def _triton_path_bytes(c: dict, world: int, rank: int) -> dict:
    """Rank `rank`'s allocations in one training call of the op on the Triton path: its row passes' outputs are
    allocated, their kernels (which allocate nothing) not launched, and the all-reduces run on the fake process
    group, whose work holds no buffer past its wait (gloo's threads release theirs on the machine's time)."""
    from llm_anatomy.distributed.simulate import fake_process_group
    from llm_anatomy.kernels import linear_ce_tp as tp_ce
    from llm_anatomy.measure.liveness import LiveStorage

    x, w, t = _tensors(c)
    dt, Vr = DTYPES[c["dtype"]], c["V"] // world
    x, w = x.to(dt), w[rank * Vr:(rank + 1) * Vr].to(dt)
    stub = (lambda lc, yl, smooth: tp_ce.stats_outputs(lc.shape[0], smooth, lc.device), lambda *a: None)
    live = LiveStorage()
    live.track(x, w, t)
    base = live.allocated
    with fake_process_group(world, rank), live:
        out = tp_ce._forward(x, w, t, rank * Vr, c["V"], dist.group.WORLD, -100, c["eps"], c["reduction"], c["chunk"],
                             True, rows=stub)
        ph = live.phase("forward")
    return dict(peak=ph["peak"] - base, held=ph["allocated"] - base,
                saved=sum(o.untyped_storage().nbytes() for o in out[1:]))


@pytest.mark.parametrize("world", [2, 4])
def test_op_bytes_are_the_calculators(world, claims):
    """The Triton path's allocations on the first and last rank (x and the weight in one dtype: CPU has no
    bf16 x bf16 -> fp32 GEMM for the native grad_w accumulation), on 2 x 12 drawn cases: the call's peak, its saved
    grad_x and grad_w, and what it leaves (those and the loss) equal vocab_parallel_ce_bytes to the byte."""
    for i, c in enumerate(draw_examples(op_cases(world), N_OP_DRAWS, 4800 + world)):
        b = DTYPES[c["dtype"]].itemsize
        pred = vocab_parallel_ce_bytes(c["T"], c["H"], c["V"] // world, b, b, chunk=c["chunk"],
                                       smoothing=c["eps"] != 0)
        for rank in (0, world - 1):
            got, note = _triton_path_bytes(c, world, rank), f"op-{i}: {c}, rank {rank} of {world}"
            claims.check("vocab-parallel linear CE peak bytes", component="loss", config=f"op-{i}",
                         variant="efficient", predicted=pred["peak"], measured=got["peak"], unit="B", note=note)
            assert got["saved"] == pred["saved"], note
            assert got["held"] == pred["saved"] + 4, note


@pytest.mark.distributed
def test_model_head_chunks_collectives(ranks, claims):
    """TP 2 with B x S = 4,112 rows: the head runs two chunks (4,096 and 16 rows) and issues three all-reduces for
    each; every collective of the step equals tp_collectives (efficient)."""
    world, scen, res = ranks
    if world != 2:
        pytest.skip("TP 2")
    sc = scen["chunks"]
    pred = grouped_counts(tp_collectives(sc["cfg"], sc["run"], 2, variant="efficient"))
    assert pred[("tp", "all_reduce", "float32", 4 * 4096)] == 3 and pred[("tp", "all_reduce", "float32", 64)] == 3
    for r in range(2):
        meas = {tuple(k[:3]) + (k[3],): n for *k, n in res["chunks"][r][0]["collectives"]}
        claims.check("tp collective calls per step", component="comm", config=sc["cfg"].name, variant="efficient",
                     predicted=sum(pred.values()), measured=sum(meas.values()), unit="calls", note=f"rank {r}")
        assert meas == pred, f"rank {r}\n meas {meas}\n pred {pred}"


def _one_process_curve(sc: dict, dp: int = 1) -> list[float]:
    """The same steps in one process: the dp ranks' batches side by side, the efficient model, AdamW."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    model = build_model(sc["cfg"], "efficient", seed=0)
    batches = [make_batch(sc["cfg"], sc["run"], seed=1 + r) for r in range(dp)]
    ids, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    return one_process_losses(model, make_optimizer("adamw", model.parameters(), sc["lr"]), ids, targets, sc["steps"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tied", "tp4", "tp2xdp2"])
def test_model_curve_matches_one_process(ranks, name, claims):
    """fp32 loss curves through the vocab-parallel head against the one-process efficient model, within CURVE_TOL:
    TP 2 with tied embeddings (the head reads the embedding's Shard(0) table), TP 4, and TP 2 x FSDP 2 (the mean
    of the dp ranks' losses); the TP ranks of one dp rank agree exactly."""
    world, scen, res = ranks
    if name not in scen:
        pytest.skip(f"{name} runs on the other world size")
    sc, tp = scen[name], scen[name]["tp"]
    dp = world // tp
    single = _one_process_curve(sc, dp)
    assert single[-1] < single[0] - 0.05, f"the curve must move to mean anything: {single}"
    for step in range(sc["steps"]):
        per = [res[name][r][step]["loss"] for r in range(world)]
        groups = [per[d * tp:(d + 1) * tp] for d in range(dp)]
        assert all(len(set(g)) == 1 for g in groups), f"TP ranks disagree at step {step + 1}: {per}"
        claims.check("tp (efficient, vocab-parallel head) loss vs one process", component="loss",
                     config=sc["cfg"].name, variant="efficient", predicted=single[step],
                     measured=sum(g[0] for g in groups) / dp, tolerance=CURVE_TOL, unit="nats",
                     note=f"{name}, fp32, step {step + 1}")


def test_liger_loss_refused_under_tp():
    """Liger's loss has no vocab-parallel form here: one line naming the option, from the engine's head swap and
    from the calculator's rule (mesh_rules.check_run); one rank takes it."""
    from types import SimpleNamespace

    from llm_anatomy.distributed.tp_head import use_vocab_parallel_head
    from llm_anatomy.mesh_rules import check_run

    liger = Run(batch=1, seq=8, dtype="fp32", loss_impl="liger")
    for refuse in (lambda: use_vocab_parallel_head(SimpleNamespace(head=SimpleNamespace(impl="liger")), None),
                   lambda: check_run(liger, 2, 1, "efficient"),
                   lambda: tp_collectives(CURVE["cfg"], liger, 2, variant="efficient")):
        with pytest.raises(ConfigError, match="loss_impl anatomy") as e:
            refuse()
        assert "\n" not in str(e.value)
    check_run(liger, 1, 2, "efficient")
