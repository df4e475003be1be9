"""Claims: FSDP2 over more ranks than experts shards the stacked expert tensors on dim 1 (llm_anatomy/distributed/
strategies.py shard_placement, torchtitan's rule; calculator/fsdp_shards.py fsdp_shard_dim states it for the
predictions): a 3-D (E, 2I, H) or (E, H, I) with E < W whose dim 1 W divides is Shard(1), everything else Shard(0).

  gloo, 4 processes, fsdp (strategies.wrap)   hypothesis-drawn MoE configs with 2 or 3 experts (the baseline
                            model: its stacked experts), widths aligned and not, so that both stacked tensors, one
                            or neither take dim 1 (W not dividing dim 1 keeps FSDP2's padded dim 0), under the fp32,
                            bf16 and amp policies: every collective of both steps on every rank, and each rank's
                            parameter/gradient/optimizer bytes after each step, equal the prediction exactly; the
                            placement each tensor got is the rule's; the loss and every gradient of one step equal
                            one process's on the four ranks' batches (fp32, test_expert_parallel's GRAD_TOL: the
                            reduction order only); each rank's live storage at the backward's and the optimizer
                            step's ends of a step after the first exact on every draw (settled), and on two configs
                            whose experts dominate the Block the step peak within test_distributed's 3% of
                            per_rank_peak; the efficient gpt-oss-like model's loss on each rank under bf16 and
                            amp equals one process's bf16 model's (under amp with the RoPE tables cast to bf16
                            per Block, as FSDP2's cast_forward_inputs casts them)
  fake process group, 256 ranks   Mixtral-8x7B (8 experts), one rank: its parameter bytes and one Block's
                            all-gather bytes exactly as predicted
The ep < world layout's experts over efsdp (El < efsdp: dim 1) are test_expert_parallel_dp.py's and
test_ep_memory_dp.py's draws with one expert per ep rank. All gloo scenarios run in ONE spawn, on the one-worker
gloo backend (distributed/settled.py).
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import strategies as st

from llm_anatomy.calculator.comm import collective_counts, estimate_distributed
from llm_anatomy.calculator.fsdp_shards import fsdp_shard_dim
from llm_anatomy.calculator.sharding import per_rank_memory, per_rank_peak
from llm_anatomy.calculator.tp_memory import MESH_RANK_BYTES
from llm_anatomy.config import ModelConfig, Run
from validations.configs import draw_examples
from validations.draw_notes import draw_note
from validations.moe_reference import moe_configs
from validations.test_expert_parallel import GRAD_TOL, _rel

WORLD = 4
N_DRAWS = 21  # the dtype policies in turn, seven each
DTYPES = ("fp32", "bf16", "amp")
GRAD_CFGS = [  # E = 2 < 4: gate_up (2, 32, 16) and down (2, 16, 16) on dim 1; gpt-oss's (3, 24, 24) / (3, 24, 12)
    ModelConfig(name="fsdpx-grad-swiglu", hidden=16, layers=2, heads=2, intermediate=32, vocab=48, experts=2,
                experts_per_token=2, expert_intermediate=16, shared_experts=1, shared_intermediate=8,
                router_bias=True, router_aux_coef=0.01),
    ModelConfig(name="fsdpx-grad-gptoss", hidden=24, layers=2, heads=2, intermediate=32, vocab=40, mlp="gpt-oss",
                experts=3, experts_per_token=2, expert_intermediate=12, router="topk-softmax", expert_bias=True),
]
GRAD_RUN = Run(batch=2, seq=6, dtype="fp32")
PEAK_SCENARIOS = {  # a Block whose experts dominate it, so their copies show in the peak
    "peak-amp": dict(cfg=ModelConfig(name="fsdpx-peak", hidden=32, layers=2, heads=2, intermediate=32, vocab=64,
                                     experts=2, experts_per_token=1, expert_intermediate=256),
                     run=Run(batch=1, seq=8, dtype="amp")),
    "peak-fp32": dict(cfg=ModelConfig(name="fsdpx-peak-fp32", hidden=32, layers=3, heads=2, intermediate=32,
                                      vocab=64, experts=3, experts_per_token=2, expert_intermediate=128),
                      run=Run(batch=2, seq=8, dtype="fp32")),
}


@st.composite
def fsdp_moe_cases(draw) -> dict:
    cfg = draw(moe_configs(max_experts=3, layers=draw(st.integers(1, 2))))
    run = Run(batch=draw(st.integers(1, 2)), seq=draw(st.integers(2, 8)))
    return dict(cfg=replace(cfg, name="fsdpx-draw"), run=run, strategy="fsdp", steps=2,
                optimizer=draw(st.sampled_from(["adamw", "sgd"])))


def _scenarios() -> dict[str, dict]:
    out = {f"draw-{i}": dict(c, run=replace(c["run"], dtype=DTYPES[i % 3]))
           for i, c in enumerate(draw_examples(fsdp_moe_cases(), N_DRAWS, seed_=6100))}
    out.update({f"grads-{c.name}": dict(kind="grads", cfg=c, run=GRAD_RUN) for c in GRAD_CFGS})
    out.update({f"loss-{d}": dict(kind="loss", cfg=GRAD_CFGS[1], run=replace(GRAD_RUN, dtype=d))
                for d in ("bf16", "amp")})
    out.update({name: dict(sc, kind="peaks", strategy="fsdp", steps=2) for name, sc in PEAK_SCENARIOS.items()})
    return out


def _grads(cfg: ModelConfig, run: Run) -> dict:
    """One step of wrap(fsdp) on this rank: its loss, every gradient whole, and each parameter's shard dim."""
    import torch.distributed as dist

    from llm_anatomy.distributed.strategies import wrap
    from llm_anatomy.models import build_model, make_batch

    model = wrap(build_model(cfg, "baseline", seed=0), "fsdp")
    ids, targets = make_batch(cfg, run, seed=1 + dist.get_rank())
    loss = model(ids, targets)
    loss.backward()
    return dict(loss=loss.item(), grads={n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()},
                dims={n: p.placements[0].dim for n, p in model.named_parameters()})


def _efficient_loss(cfg: ModelConfig, run: Run) -> float:
    """The efficient model under wrap(fsdp) and the run's MixedPrecisionPolicy: this rank's loss, forward only."""
    import torch.distributed as dist

    from llm_anatomy.distributed.strategies import default_mixed_precision, wrap
    from llm_anatomy.models import build_model, make_batch

    pd, rd = default_mixed_precision(run)
    model = build_model(cfg, "efficient", seed=0, dtype=torch.bfloat16 if run.dtype == "bf16" else None)
    model = wrap(model, "fsdp", param_dtype=pd, reduce_dtype=rd)
    with torch.no_grad():
        return model(*make_batch(cfg, run, seed=1 + dist.get_rank())).item()


def _scenario(kind: str = "train", **kw):
    from llm_anatomy.distributed.peak import peaks
    from llm_anatomy.distributed.settled import SettledStorage
    from llm_anatomy.distributed.train_step import train

    if kind == "peaks":  # phase ends read settled (distributed/settled.py)
        return peaks(**kw, storage=SettledStorage)
    if kind == "grads":
        return _grads(**kw)
    if kind == "loss":
        return _efficient_loss(**kw)
    return dict(steps=train(**kw), phases=peaks(kw["cfg"], kw["run"], "fsdp", steps=2, optimizer=kw["optimizer"],
                                                storage=SettledStorage))


@pytest.fixture(scope="module")
def fsdpx_run():
    from llm_anatomy.distributed.settled import spawn_settled

    scen = _scenarios()
    res = spawn_settled(WORLD, list(scen.values()), _scenario)  # one-worker gloo ranks: settled phase ends
    return scen, {name: [res[r][i] for r in range(WORLD)] for i, name in enumerate(scen)}


def _draws(scen: dict) -> dict:
    return {k: v for k, v in scen.items() if k.startswith("draw-")}


def _dims(cfg: ModelConfig) -> tuple[int, int]:
    """(gate_up's, down's) shard dim over WORLD."""
    E, H, I = cfg.experts, cfg.hidden, cfg.expert_intermediate
    return fsdp_shard_dim((E, 2 * I, H), WORLD), fsdp_shard_dim((E, H, I), WORLD)


@pytest.mark.distributed
def test_fsdp_experts_collectives_and_rank_bytes_exact(fsdpx_run, claims):
    """Per draw, rank and step: every collective (op, dtype, bytes) -> calls, and the parameter, gradient and
    optimizer bytes after the step, each equal to the prediction."""
    scen, res = fsdpx_run
    draws = _draws(scen)
    assert len(draws) >= 20 and {sc["run"].dtype for sc in draws.values()} == set(DTYPES)
    dims = {_dims(sc["cfg"]) for sc in draws.values()}
    assert (1, 1) in dims and {d for ds in dims for d in ds} == {0, 1}  # dim 1, and W not dividing it: dim 0
    for name, sc in draws.items():
        cfg, run = sc["cfg"], sc["run"]
        for r in range(WORLD):
            e = estimate_distributed(cfg, run, WORLD, "fsdp", rank=r, optimizer=sc["optimizer"])
            pred = collective_counts(e["collectives"])
            for rec in res[name][r]["steps"]:
                note = f"{name}: {draw_note(sc, rank=r, step=rec['step'])}, E {cfg.experts}, dims {_dims(cfg)}"
                meas = {(op, dt, b): n for op, dt, b, n in rec["collectives"]}
                claims.check("fsdp E<W collective bytes per step", component="comm", config=cfg.name,
                             variant="fsdp", predicted=sum(b * n for (_, _, b), n in pred.items()),
                             measured=sum(b * n for (_, _, b), n in meas.items()), unit="B", note=note)
                assert meas == pred, f"{note}: (op, dtype, bytes) -> calls differ\n meas {meas}\n pred {pred}"
                for what in ("params", "grads", "optimizer"):
                    claims.check(f"fsdp E<W per-rank {what} bytes", component="comm", config=cfg.name,
                                 variant="fsdp", predicted=e["memory"][what], measured=rec["memory"][what],
                                 unit="B", note=note)


@functools.cache
def _one_process(cfg: ModelConfig) -> tuple[list[float], dict]:
    """One process on the four ranks' batches: each rank's loss, and the gradients of their mean (float64)."""
    from llm_anatomy.models import build_model, make_batch

    model = build_model(cfg, "baseline", seed=0)
    losses = [model(*make_batch(cfg, GRAD_RUN, seed=1 + r)) for r in range(WORLD)]
    torch.stack(losses).mean().backward()
    return [x.item() for x in losses], {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("cfg", GRAD_CFGS, ids=[c.name for c in GRAD_CFGS])
def test_fsdp_experts_loss_and_grads_match_one_process(fsdpx_run, cfg, claims):
    """The stacked experts take dim 1 (the rule's placement), and each rank's loss and every gradient equal one
    process's on the four batches within GRAD_TOL, relative: FSDP2's dim-1 gather and re-chunked reduce-scatter
    move every element to its place."""
    _, res = fsdpx_run
    got = res[f"grads-{cfg.name}"]
    for r in range(WORLD):
        for n, d in got[r]["dims"].items():
            shape = tuple(torch.tensor(got[r]["grads"][n]).shape)
            assert d == fsdp_shard_dim(shape, WORLD), f"{n} {shape}: Shard({d})"
        assert sum(d for d in got[r]["dims"].values()) == 2 * cfg.layers  # gate_up and down of every Block
    losses, grads = _one_process(cfg)
    for r in range(WORLD):
        claims.check("fsdp E<W loss vs one process", component="loss", config=cfg.name, variant="fsdp",
                     predicted=losses[r], measured=got[r]["loss"], tolerance=GRAD_TOL, unit="nats", note=f"rank {r}")
    for n, g in grads.items():
        parts = [torch.tensor(got[r]["grads"][n], dtype=torch.float64) for r in range(WORLD)]
        assert all(torch.equal(parts[0], q) for q in parts[1:]), f"{n}: ranks disagree"
        claims.within("fsdp E<W gradient vs one process", low=0.0, high=GRAD_TOL, measured=_rel(parts[0], g),
                      component="moe" if ".mlp." in n else "other", config=cfg.name, variant="fsdp",
                      unit="relative", note=f"{n}: |g_fsdp - g_one| / |g_one|")


def _check_phase_ends(claims, sc: dict, phases: list, r: int, note: str) -> None:
    """Live storage at the backward's end and the optimizer step's of a step after the first: the parameters'
    shards, the optimizer state, the ids and targets, the flat sharded gradients and the mesh's rank tensor."""
    m = per_rank_memory(sc["cfg"], sc["run"], WORLD, "fsdp", rank=r, optimizer=sc.get("optimizer", "adamw"))
    end = m["params"] + m["grads"] + m["optimizer"] + 2 * 8 * sc["run"].tokens + MESH_RANK_BYTES * WORLD
    ph = {p["name"]: p for p in phases}
    for phase in ("backward", "optimizer"):
        claims.check(f"fsdp E<W rank {phase} end bytes", component="memory", config=sc["cfg"].name, variant="fsdp",
                     device="cpu", predicted=end, measured=ph[phase]["allocated"], unit="B", note=note)


@pytest.mark.distributed
def test_fsdp_experts_phase_ends_exact(fsdpx_run, claims):
    """Every draw, every rank, settled: the backward's and the optimizer step's ends exact."""
    scen, res = fsdpx_run
    for name, sc in _draws(scen).items():
        for r in range(WORLD):
            note = f"{name}: {draw_note(sc, rank=r)}, dims {_dims(sc['cfg'])}, settled gloo, W={WORLD}"
            _check_phase_ends(claims, sc, res[name][r]["phases"], r, note)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PEAK_SCENARIOS))
def test_fsdp_experts_phase_ends_exact_and_peak(fsdpx_run, name, claims):
    """Two configs whose experts dominate the Block, every rank: the phase ends exact, the step's peak (a
    reduce-scatter's, with the re-chunked gradient's original K) and the forward's (a copy-out's, with the dim-1
    temporaries T) within 3% of per_rank_peak (test_distributed's bound for FSDP's buffers)."""
    _, res = fsdpx_run
    sc = PEAK_SCENARIOS[name]
    for r in range(WORLD):
        note = f"{name}, settled gloo, W={WORLD}, rank {r}, live storage"
        _check_phase_ends(claims, sc, res[name][r], r, note)
        pred = per_rank_peak(sc["cfg"], sc["run"], "baseline", WORLD, "fsdp", rank=r, device="cpu")
        top = max(res[name][r], key=lambda p: p["peak"])
        claims.check("fsdp E<W per-rank step peak", component="comm", config=sc["cfg"].name, variant="fsdp",
                     device="cpu", predicted=pred["peak"], measured=top["peak"], tolerance=0.03, unit="B",
                     note=f"{note}; predicted at {pred['peak_at']}, measured in {top['name']} after {top['peak_op']}")
        # the forward's peak is a copy-out's (the dim-1 temporaries T: without them 12% under on peak-amp)
        fwd = max((c for c in pred["candidates"] if c["at"].startswith("forward")), key=lambda c: c["bytes"])
        ph = next(p for p in res[name][r] if p["name"] == "forward")
        claims.check("fsdp E<W per-rank forward peak", component="comm", config=sc["cfg"].name, variant="fsdp",
                     device="cpu", predicted=fwd["bytes"], measured=ph["peak"], tolerance=0.03, unit="B",
                     note=f"{note}; predicted at {fwd['at']}, measured after {ph['peak_op']}")


_MIXTRAL_RANK = """
import json, sys
from torch._subclasses.fake_tensor import FakeTensorMode
from llm_anatomy.distributed.counting import CollectiveCounter, storage_bytes
from llm_anatomy.distributed.simulate import fake_process_group
from llm_anatomy.distributed.strategies import wrap
from llm_anatomy.hf_config import from_hf_config
from llm_anatomy.models import build_model
from validations.hf_configs import HF_CONFIGS
world, rank = map(int, sys.argv[1:3])
cfg = from_hf_config(HF_CONFIGS["Mixtral-8x7B-v0.1"])
with fake_process_group(world, rank):
    model = wrap(build_model(cfg, "baseline", device="meta", seed=None), "fsdp")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        out = dict(params=storage_bytes(model.parameters()),
                   dims={n: p.placements[0].dim for n, p in model.layers[0].named_parameters()})
        with CollectiveCounter() as c:
            model.layers[0].unshard()
        model.layers[0].reshard()
        out["block"] = [[*k, n] for k, n in c.counts().items()]
print(json.dumps(out))
"""


def test_mixtral_rank_of_256_fake_process_group(claims):
    """One rank of Mixtral-8x7B under FSDP over 256 ranks (fake process group, fake tensors, in a process of its
    own): its stacked experts on dim 1, its parameter bytes and one Block's all-gather exactly as predicted."""
    from llm_anatomy.hf_config import from_hf_config
    from validations.hf_configs import HF_CONFIGS

    cfg, run, world, rank = from_hf_config(HF_CONFIGS["Mixtral-8x7B-v0.1"]), Run(1, 8, "fp32"), 256, 129
    out = json.loads(subprocess.run([sys.executable, "-c", _MIXTRAL_RANK, str(world), str(rank)],
                                    capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()[-1])
    assert out["dims"]["mlp.experts.gate_up"] == out["dims"]["mlp.experts.down"] == 1
    assert sum(out["dims"].values()) == 2
    e = estimate_distributed(cfg, run, world, "fsdp", rank=rank)
    note = f"fsdp fp32, fake pg, W={world}, rank {rank}"
    claims.check("fsdp E<W per-rank params bytes", component="comm", config=cfg.name, variant="fsdp",
                 predicted=e["memory"]["params"], measured=out["params"], unit="B", note=note)
    row = next(x for x in e["collectives"] if x["op"] == "all_gather" and x["phase"] == "forward"
               and x["units"] != "root")
    claims.check("fsdp E<W block all-gather bytes", component="comm", config=cfg.name, variant="fsdp",
                 predicted=row["bytes_each"], measured=out["block"][0][2], unit="B", note=note)
    assert out["block"] == [["all_gather", row["dtype"], row["bytes_each"], 1]], f"{out['block']} vs {row}"


LOSS_TOL = 1e-6  # a twentieth of the RoPE tables' rounding in the amp loss (2e-5); measured: 0 (bit for bit)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bf16", "amp"])
def test_fsdp_efficient_loss_is_one_process_bf16(fsdpx_run, dtype, claims):
    """The efficient gpt-oss-like model (expert biases added after the grouped GEMMs on its bf16 weights) under
    FSDP2: each rank's loss equals one process's bf16 model's on that rank's batch within LOSS_TOL (measured bit
    for bit). bf16: the same computation. amp (fp32 shards, bf16 gathers): the same with the RoPE tables in bf16,
    since FSDP2's MixedPrecisionPolicy casts every floating-point forward input of a unit to its param_dtype
    (cast_forward_inputs) and each Block takes the model's fp32 tables (cos, sin) as inputs; the one-process model
    gets that cast from a pre-hook on each Block, and without it misses by more than LOSS_TOL."""
    from llm_anatomy.models import build_model, make_batch

    _, res = fsdpx_run
    cfg, run = GRAD_CFGS[1], replace(GRAD_RUN, dtype=dtype)
    model = build_model(cfg, "efficient", seed=0, dtype=torch.bfloat16)

    def losses() -> list[float]:
        with torch.no_grad():
            return [model(*make_batch(cfg, run, seed=1 + r)).item() for r in range(WORLD)]

    got = res[f"loss-{dtype}"]
    if dtype == "amp":
        plain = losses()  # fp32 tables
        assert all(abs(plain[r] - got[r]) > LOSS_TOL * abs(got[r]) for r in range(WORLD)), (plain, got)

        def cast(_block, args, kwargs):
            bf16 = lambda t: t.to(torch.bfloat16) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            return tuple(map(bf16, args)), {k: bf16(v) for k, v in kwargs.items()}
        for block in model.layers:
            block.register_forward_pre_hook(cast, with_kwargs=True)
    one = losses()
    for r in range(WORLD):
        claims.check(f"fsdp {dtype} efficient loss vs one process bf16", component="loss", config=cfg.name,
                     variant="efficient", predicted=one[r], measured=got[r], tolerance=LOSS_TOL, unit="nats",
                     note=f"rank {r}" + (", the one process's RoPE tables cast to bf16 per Block" if dtype == "amp"
                                         else ""))
