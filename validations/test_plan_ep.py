"""Claims: `anatomy plan` searches expert parallel for mixture-of-experts configs (plan_mesh.py, calculator/ep_mesh.py).

  - the EP meshes are the ones the engine runs: dp = the GPUs and every ep >= 2 dividing both the GPUs and the experts
    (ep = dp the 1-D composition, ep < dp the (efsdp, ep) mesh); they are searched under
    every dtype and recompute the engine runs (amp, the default, included); what ep_mesh.check refuses (the
    baseline variant, GPUs that do not divide the experts) is skipped, and said, never raised
  - where EP pays (Mixtral-8x7B on 8 H100s, bf16, seq 1,024) the winner is an EP mesh, faster than data
    parallelism, and its peak is calculator/ep_memory.py's heaviest rank exactly
  - a step's parts add up: the all-to-alls per MoE layer (forward 3, backward 2, and under recompute the forward's 3
    again; rows in the compute dtype, bf16 under amp) over the ep group's link, one host sync per layer, FSDP2's
    exposed collectives (for ep < dp the experts' over efsdp too, on their strided group's link), the optimizer's
    share
  - a plan's EP rows' per-rank parameter, gradient and optimizer bytes are calculator/expert_parallel.rank_memory's
    (the engine's, validations/test_expert_parallel_dp.py) for ep < dp too; Qwen3-30B-A3B on 256 H100s (8 per node)
    lists EP meshes with ep < 256
  - 8 GPUs answer in under 1 s, 1,024 in under 5 s
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from llm_anatomy.calculator import comm, ep_mesh
from llm_anatomy.calculator import mesh as M
from llm_anatomy.calculator.ep_memory import ep_phases
from llm_anatomy.calculator.sharding import BYTES
from llm_anatomy.cli import main
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.hf_config import from_hf_config
from llm_anatomy.plan import plan
from llm_anatomy.plan_mesh import meshes
from validations.hf_configs import HF_CONFIGS

QWEN = from_hf_config(HF_CONFIGS["Qwen3-30B-A3B"])
MIXTRAL = from_hf_config(HF_CONFIGS["Mixtral-8x7B-v0.1"])
SMALL = ModelConfig(name="ep-plan-small", hidden=512, layers=4, heads=8, intermediate=1024, vocab=4096, experts=16,
                    experts_per_token=2, expert_intermediate=256)


def test_the_ep_meshes_are_every_common_divisor():
    assert [(m.ep, m.dp, m.tp, m.pp) for m in meshes(SMALL, 8, 8)] == [(8, 8, 1, 1), (4, 8, 1, 1), (2, 8, 1, 1)]
    assert [(m.ep, m.dp) for m in meshes(SMALL, 16, 8)] == [(16, 16), (8, 16), (4, 16), (2, 16)]
    assert [(m.ep, m.dp) for m in meshes(SMALL, 64, 8)] == [(16, 64), (8, 64), (4, 64), (2, 64)]  # efsdp 4 .. 32
    assert meshes(SMALL, 1, 8) == [] and [m.ep for m in meshes(SMALL, 6, 8)] == [2]
    assert meshes(replace(SMALL, experts=3, experts_per_token=1), 8, 8) == []
    assert M.Mesh(256, ep=64).label() == "dp 256 x ep 64"


def test_ep_below_dp_rows_hold_the_engines_bytes():
    """Each EP row's rank (rank 0, the heaviest) holds exactly expert_parallel.rank_memory's parameter, gradient and
    optimizer bytes in ep_memory's phases (on CPU, where the allocator does not round), ep < dp as ep = dp."""
    from llm_anatomy.calculator import expert_parallel as ep_calc

    out = plan(SMALL, gpu="H100", seq=1024, gpus_n=16, dtype="bf16")
    rows = [r for r in out["meshes"] if r["ep"] > 1]
    assert {r["ep"] for r in rows} == {2, 4, 8, 16}
    for r in rows:
        run = Run(batch=r["micro_batch"], seq=1024, dtype="bf16", recompute=r["recompute"])
        world = None if r["ep"] == r["dp"] else r["dp"]
        for rank in (0, r["dp"] - 1):
            ph = ep_phases(SMALL, run, r["ep"], rank=rank, dp=r["dp"], device="cpu")
            mem = ep_calc.rank_memory(SMALL, run, r["ep"], rank, world=world)
            assert (ph["params"], ph["grads"], ph["optimizer"]) == (
                mem["params"], mem["grads"], mem["optimizer"]), (r["mesh"], rank)
        assert r["peak_bytes"] == ep_phases(SMALL, run, r["ep"], dp=r["dp"], device="cuda")["peak"]


def test_qwen3_30b_on_256_h100s_plans_ep_below_dp():
    out = plan(QWEN, gpu="H100", seq=4096, gpus_n=256, dtype="bf16", gpus_per_node=8)
    below = [r for r in out["meshes"] if 1 < r["ep"] < 256]
    assert below and all(r["dp"] == 256 and r["mesh"] == f"dp 256 x ep {r['ep']}" for r in below)
    assert {r["ep"] for r in out["meshes"]} <= {2, 4, 8, 16, 32, 64, 128}  # 256 does not divide 128 experts


def test_where_ep_pays_the_winner_is_an_ep_mesh_priced_by_its_rank_peak():
    out = plan(MIXTRAL, gpu="H100", seq=1024, gpus_n=8, dtype="bf16")
    w = out["mesh_winner"]
    assert w is not None and w["ep"] > 1 and w["tokens_per_s"] > out["best"]["tokens_per_s"]
    run = Run(batch=w["micro_batch"], seq=1024, dtype="bf16", lean=w["lean"])
    ph = ep_phases(MIXTRAL, run, w["ep"], dp=w["dp"], device="cuda")
    assert w["peak_bytes"] == ph["peak"] <= out["budget_bytes"]
    assert ph["peak"] >= max(ph["forward_end"], ph["backward_end"]) > ph["optimizer_end"]
    bigger = ep_phases(MIXTRAL, replace(run, batch=run.batch + 1), w["ep"], dp=w["dp"], device="cuda")["peak"]
    assert bigger > out["budget_bytes"] or out["meshes"][0]["micro_batch"] == w["micro_batch"]
    assert w["skewed_peak_bytes"] > w["peak_bytes"]  # rank 0 receives ep x the rows
    assert {r["recompute"] for r in out["meshes"]} == {"none", "mlp", "full"}
    for r in out["meshes"]:
        assert r["peak_bytes"] <= out["budget_bytes"]


def test_ep_is_searched_under_amp_and_recompute():
    """The default dtype, amp, searches EP under every recompute, each row priced by ep_memory's amp phases."""
    out = plan(SMALL, gpu="H100", seq=1024, gpus_n=8)  # dtype amp by default
    assert out["ep_skipped"] == [] and {r["recompute"] for r in out["meshes"] if r["ep"] > 1} == {"none", "mlp", "full"}
    for r in out["meshes"]:
        run = Run(batch=r["micro_batch"], seq=1024, dtype="amp", recompute=r["recompute"])
        assert r["peak_bytes"] == ep_phases(SMALL, run, r["ep"], dp=r["dp"], device="cuda")["peak"]


def test_refused_combinations_are_skipped_and_said(capsys):
    """What ep_mesh.check refuses (here the baseline variant) is skipped: one line saying why, and the plan still
    answers."""
    out = plan(SMALL, gpu="H100", seq=1024, gpus_n=8, variant="baseline")
    assert out["meshes"] == [] and any("efficient" in x for x in out["ep_skipped"])
    assert out["best"] is not None
    assert main(["plan", "--hf-config", str(HF_CONFIGS["Qwen3-30B-A3B"].parent), "--gpu", "H100", "--gpus", "8",
                 "--variant", "baseline"]) == 0
    text = capsys.readouterr().out
    assert "expert parallel not searched: " in text and "verdict:" in text


def test_the_cli_prints_ep_in_the_mesh_and_why(capsys):
    assert main(["plan", "--hf-config", str(HF_CONFIGS["Mixtral-8x7B-v0.1"].parent), "--gpu", "H100", "--gpus", "8",
                 "--seq", "1024", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    verdict = next(line for line in text.splitlines() if line.startswith("verdict:"))
    assert " x ep " in verdict and "tokens/s" in verdict
    assert "its step: " in text and "expert-parallel all-to-alls" in text and "skewed" in text


def test_a_step_adds_up():
    run = Run(batch=2, seq=1024, dtype="bf16")
    c, L, H = BYTES["bfloat16"], SMALL.layers, SMALL.hidden
    N = run.tokens * SMALL.experts_per_token
    for ep, dp, per_node in ((4, 4, 8), (8, 16, 4)):
        t = ep_mesh.step_time(SMALL, run, "H100", ep, dp, gpus_per_node=per_node)
        lk = comm.link("H100", ep if ep <= per_node else per_node + 1, per_node)
        one = lambda n: lk["alpha_us"] * 1e-6 + n * (ep - 1) / ep / (lk["GBps"] * 1e9)  # noqa: E731
        assert t["ep_comm_s"] == pytest.approx(L * (one(SMALL.experts * 4) + 4 * one(N * H * c)), rel=1e-12)
        assert t["step_s"] == pytest.approx(t["compute_s"] + t["ep_comm_s"] + t["host_sync_s"] + t["dp_exposed_s"]
                                            + t["optimizer_s"], rel=1e-12)
        assert t["host_sync_s"] > 0 and t["dp_exposed_s"] >= 0
        # amp sends bf16 rows (FSDP2's gathered parameters); recompute's re-run sends the forward's three again
        t = ep_mesh.step_time(SMALL, replace(run, dtype="amp", recompute="mlp"), "H100", ep, dp, gpus_per_node=per_node)
        assert t["ep_comm_s"] == pytest.approx(L * (2 * one(SMALL.experts * 4) + 6 * one(N * H * c)), rel=1e-12)
    # ep < dp: the experts' collectives over efsdp join FSDP2's rows under the same overlap rule, on a strided group
    run = Run(batch=2, seq=1024, dtype="bf16")
    t = ep_mesh.step_time(SMALL, run, "H100", 4, 16, gpus_per_node=8)
    assert t["dp_exposed_s"] >= ep_mesh.step_time(SMALL, run, "H100", 16, 16, gpus_per_node=8)["dp_exposed_s"]
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["ep_comm_s"] + t["host_sync_s"] + t["dp_exposed_s"]
                                        + t["optimizer_s"], rel=1e-12)
    assert comm.collective_time("all_gather", 2**26, 4, "H100", 8, span=13) > comm.collective_time(
        "all_gather", 2**26, 4, "H100", 8)  # 4 ranks 4 apart span two nodes of 8: the NIC
    near, far = (ep_mesh.all_to_all_time(2**26, 16, "H100", g) for g in (16, 8))
    assert far > near  # 16 ranks over two nodes of 8: the NIC, not NVLink
    m = M.step_time(SMALL, run, "efficient", "H100", M.Mesh(8, ep=8), 3)
    one = ep_mesh.step_time(SMALL, run, "H100", 8, 8)
    assert m["step_s"] == pytest.approx(3 * (one["step_s"] - one["optimizer_s"]) + one["optimizer_s"], rel=1e-12)


@pytest.mark.parametrize("call,says", [
    (lambda: ep_mesh.step_time(SMALL, Run(1, 64, "bf16"), "H100", 3, 3), "ep must be"),
    (lambda: ep_mesh.step_time(SMALL, Run(1, 64, "bf16"), "H100", 4, 6), "dp=6"),
    (lambda: ep_mesh.rank_peak(SMALL, Run(1, 64, "amp", lean=True), 2, 2), "lean"),
    (lambda: M.rank_peak(SMALL, Run(1, 64, "bf16"), "efficient", M.Mesh(2, pp=2, ep=2), 2), "tp = pp = 1"),
])
def test_bad_ep_meshes_refused_in_one_line(call, says):
    with pytest.raises(ConfigError, match=says) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("gpus,limit", [(8, 1.0), (1024, 5.0)])
def test_plan_speed(gpus, limit):
    """The fastest of three, caches cleared before each: a bound on a shared machine is a lower bound on speed."""
    def once():
        M._rank_peak.cache_clear()
        ep_mesh._peak.cache_clear()
        ep_mesh._step.cache_clear()
        ep_mesh._compute.cache_clear()
        t0 = time.perf_counter()
        plan(QWEN, gpu="H100", seq=4096, gpus_n=gpus, dtype="bf16")
        return time.perf_counter() - t0
    best = min(once() for _ in range(3))
    assert best < limit, f"{best:.2f} s"


def test_mixtral_on_16_gpus_wins_with_ep_below_dp():
    """16 GPUs do not divide Mixtral's 8 experts, so only ep < dp plans EP: dp 16 x ep 8 keeps the all-to-alls on
    NVLink, gathers the experts over 2 ranks, and beats data parallelism (docs/planning.md's figures)."""
    out = plan(MIXTRAL, gpu="H100", seq=1024, gpus_n=16, dtype="bf16")
    w = out["mesh_winner"]
    assert w is not None and (w["dp"], w["ep"]) == (16, 8) and w["tokens_per_s"] > out["best"]["tokens_per_s"]
    run = Run(batch=w["micro_batch"], seq=1024, dtype="bf16", recompute=w["recompute"])
    assert w["peak_bytes"] == ep_phases(MIXTRAL, run, 8, dp=16, device="cuda")["peak"] <= out["budget_bytes"]
