"""Mixture-of-experts and gpt-oss configs through the per-rank parameter figures: FSDP's per-rank bytes and unit
buffers and DDP's buckets equal the same figures built tensor by tensor over every layer (param_layout's list,
which test_moe_saved.py checks against the model's named_parameters), and they cost the same counted work at
ten layers and at a million (test_distributed_depth.py's rule: per distinct shape, never per layer).

The stacked expert tensors (E, 2I, H) and (E, H, I) shard on their first dimension, the experts, as FSDP2's
Shard(0) does. (The fake-process-group simulation cannot run an MoE model: its routing loop's torch.where has a
data-dependent shape, which fake tensors refuse.)
"""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

import llm_anatomy.calculator.comm as comm
import llm_anatomy.calculator.sharding as sharding
from llm_anatomy.config import ModelConfig, Run
from validations import test_distributed_depth as depth
from validations.test_distributed_depth import counted_work

moe_configs = st.builds(
    lambda h, experts, k, width, shared, bias, sinks, layers: ModelConfig(
        name="hypothesis-moe-sharding", hidden=8 * h, layers=layers, heads=4, kv_heads=2, intermediate=16,
        vocab=97, experts=experts, experts_per_token=min(k, experts), expert_intermediate=width,
        shared_experts=shared, shared_intermediate=8 if shared else None, router_bias=bias, expert_bias=bias,
        qkv_bias=bias, o_bias=bias, attn_sinks=sinks),
    st.integers(1, 8), st.integers(2, 64), st.integers(1, 8), st.integers(1, 200), st.integers(0, 2),
    st.booleans(), st.booleans(), st.integers(1, 40))


@settings(max_examples=60, deadline=None)
@given(cfg=moe_configs, world=st.integers(1, 256), rank_frac=st.floats(0, 1),
       cap=st.sampled_from([None, 0.001, 0.01, 0.3]))
def test_per_rank_figures_are_the_sums_over_every_tensor(cfg, world, rank_frac, cap):
    """test_distributed_depth's two checks, each run as written there, on a drawn MoE or gpt-oss config."""
    depth.test_per_rank_bytes_and_fsdp_buffers_are_the_sums_over_every_tensor.hypothesis.inner_test(
        cfg, world, rank_frac)
    for dtype in ("amp", "bf16"):
        depth.test_ddp_buckets_by_runs_are_the_buckets_walked_tensor_by_tensor.hypothesis.inner_test(cfg, dtype, cap)


def test_per_rank_figures_cost_the_same_at_ten_layers_and_a_million():
    cfg = ModelConfig(name="moe-deep", hidden=32, layers=10, heads=4, kv_heads=2, intermediate=16, vocab=97,
                      experts=8, experts_per_token=2, shared_experts=1, router_bias=True, expert_bias=True,
                      attn_sinks=True, o_bias=True, qkv_bias=True, window=8, window_pattern="even")
    run, work = Run(batch=1, seq=16, dtype="amp"), {}
    for layers in (10, 1000, 1_000_000):
        c = dataclasses.replace(cfg, layers=layers)
        with counted_work() as per_figure:
            sharding.per_rank_memory(c, run, 64, "fsdp")
            comm.fsdp_collectives(c, run, 64)
            comm.ddp_collectives(c, run)
        work[layers] = {k: max(v) for k, v in per_figure.items()}
    assert set(work[1_000_000]) == set(work[10]) and all(n > 0 for n in work[1_000_000].values())
    for key, n in work[1_000_000].items():  # DDP's bucket walk stops once the Blocks' buckets repeat
        assert n <= work[10][key] + 8, key
