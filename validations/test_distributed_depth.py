"""The per-rank figures on many ranks cost the same at any depth: sharding, DDP's buckets and FSDP's collectives
are computed per distinct tensor shape of the root and of one Block (every decoder layer of a config has the
same shapes), never per layer. Asserted on counted work, not on a wall clock, and each figure checked equal to
the same figure built the long way, tensor by tensor over every layer (sharding.param_shapes)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import ExitStack, contextmanager
from math import prod
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llm_anatomy.calculator.comm as comm
import llm_anatomy.calculator.param_layout as layout
import llm_anatomy.calculator.sharding as sharding
from llm_anatomy.cli import main
from llm_anatomy.config import ModelConfig, Run

SEED = ModelConfig.from_name("seed")
DEEP = 1_000_000
# the functions whose calls are the work: one call per distinct shape (shard_numel), one per Block walked
# (DDP's bucket fill), one per layout built (units)
WORK = ((sharding, "shard_numel"), (comm, "shard_numel"), (sharding, "_fill"), (sharding, "units"),
        (layout, "units"))
# the per-rank figures a command asks for; each one's work is counted on its own
FIGURES = ((sharding, "per_rank_peak"), (sharding, "per_rank_memory"), (comm, "estimate_distributed"),
           (comm, "ddp_collectives"), (comm, "fsdp_collectives"))


def _listing_refused(cfg):
    raise AssertionError(f"the parameters of all {cfg.layers} layers were listed")


@contextmanager
def counted_work():
    """Yields {(figure, strategy): set of work counts, one per outermost call}; listing every layer's tensors
    fails the test."""
    calls: Counter = Counter()
    per_figure: dict = {}
    depth = [0]

    def counter(fn, name):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    def figure(fn, name):
        def wrapped(*a, **kw):
            before, depth[0] = sum(calls.values()), depth[0] + 1
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    strategy = next((x for x in (*a, *kw.values()) if x in ("ddp", "fsdp")), "-")
                    per_figure.setdefault((name, strategy), set()).add(sum(calls.values()) - before)
        return wrapped

    layout.shape_counts.cache_clear()
    layout.fsdp_unit_shapes.cache_clear()
    with ExitStack() as stack:
        for owner, name in WORK:
            stack.enter_context(mock.patch.object(owner, name, counter(getattr(owner, name), name)))
        for owner, name in FIGURES:
            stack.enter_context(mock.patch.object(owner, name, figure(getattr(owner, name), name)))
        for owner in (layout, sharding):
            stack.enter_context(mock.patch.object(owner, "param_shapes", _listing_refused))
        yield per_figure


def _run(argv: list[str], capsys) -> None:
    assert main(argv) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv", [
    ["estimate", "--preset", "seed", "--world-size", "1024", "--strategy", "fsdp"],
    ["estimate", "--preset", "seed", "--world-size", "2"],  # DDP: the buckets
    ["estimate", "--preset", "seed", "--world-size", "16000", "--variant", "baseline"],
    ["plan", "--preset", "seed", "--gpus", "1024", "--gpu", "h200"],
    ["plan", "--preset", "seed", "--gpus", "2", "--gpu", "h200", "--variant", "baseline"],
], ids=lambda a: " ".join(a[:1] + a[3:]))
def test_a_per_rank_figure_costs_the_same_at_a_thousand_and_a_million_layers(argv, capsys):
    """Each per-rank figure a command computes (peak, memory, collectives, the whole distributed estimate) does
    the same counted work at 1,000 layers and at 1,000,000, no more than a few Blocks of DDP's bucket walk beyond
    its work at 10 (the walk stops once the Blocks' buckets repeat), and no figure lists the layers' tensors."""
    work = {}
    for layers in (10, 1000, DEEP):
        with counted_work() as per_figure:
            _run(argv + ["--layers", str(layers)], capsys)
        work[layers] = {k: max(v) for k, v in per_figure.items()}
    assert work[DEEP] and set(work[DEEP]) <= set(work[1000]) <= set(work[10])  # plan: nothing fits deep, no step timed
    assert work[DEEP] == {k: work[1000][k] for k in work[DEEP]} and all(n > 0 for n in work[DEEP].values())
    for key, n in work[DEEP].items():
        assert n <= work[10][key] + 8, key


# ---- the same figures, built tensor by tensor over every layer (what the counted ones must equal) ----------
def _listed_buckets(cfg: ModelConfig, run: Run, cap) -> list[int]:
    gb = sharding.DTYPE_BYTES[sharding.param_dtype_name(run)]
    limits, k, size, out = sharding.ddp_bucket_limits(cap), 0, 0, []
    for _, shape in reversed(layout.param_shapes(cfg)):
        size += prod(shape) * gb
        if size >= limits[k]:
            out.append(size)
            size, k = 0, min(k + 1, len(limits) - 1)
    return out + ([size] if size else [])


def _listed_memory(cfg: ModelConfig, run: Run, world: int, rank: int) -> tuple[int, int]:
    shards = [sharding.shard_numel(s, world, rank) for _, s in layout.param_shapes(cfg)]
    return sum(p for _, p in shards), sum(lo for lo, _ in shards)


def _listed_units(cfg: ModelConfig, world: int) -> dict[str, int]:
    units: Counter = Counter()
    for name, s in layout.param_shapes(cfg):
        units[".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"] += \
            sharding.shard_numel(s, world, 0)[1]
    assert len({v for k, v in units.items() if k != "root"}) <= 1  # every Block the same
    return units


configs = st.builds(
    lambda h, kv, group, inter, vocab, layers, tie, bias: ModelConfig(
        hidden=2 * h * kv * group, layers=layers, heads=kv * group, kv_heads=kv, intermediate=inter, vocab=vocab,
        tie_embeddings=tie, qkv_bias=bias),
    st.integers(1, 8), st.integers(1, 4), st.integers(1, 3), st.integers(1, 700), st.integers(1, 3000),
    st.integers(1, 400), st.booleans(), st.booleans())


@settings(max_examples=150, deadline=None)
@given(cfg=configs, dtype=st.sampled_from(["amp", "bf16", "fp32"]),
       cap=st.sampled_from([None, 0.001, 0.004, 0.01, 0.05, 0.3]))
def test_ddp_buckets_by_runs_are_the_buckets_walked_tensor_by_tensor(cfg, dtype, cap):
    run = Run(batch=1, seq=16, dtype=dtype)
    runs = sharding.ddp_bucket_runs(cfg, run, cap)
    assert [n for n, k in runs for _ in range(k)] == _listed_buckets(cfg, run, cap)
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # equal neighbours share one run
    rows = comm.ddp_collectives(cfg, run, bucket_cap_mb=cap)
    assert [r["count"] for r in rows] == [k for _, k in runs]


@settings(max_examples=150, deadline=None)
@given(cfg=configs, world=st.integers(1, 4096), rank_frac=st.floats(0, 1))
def test_per_rank_bytes_and_fsdp_buffers_are_the_sums_over_every_tensor(cfg, world, rank_frac):
    world = min(world, max(s[0] for s, _ in layout.shape_counts(cfg)))
    rank = min(world - 1, int(rank_frac * world))
    run = Run(batch=1, seq=16, dtype="amp")
    assert dict(layout.shape_counts(cfg)) == dict(Counter(s for _, s in layout.param_shapes(cfg)))
    m = sharding.per_rank_memory(cfg, run, world, "fsdp", rank=rank)
    assert (m["params_numel"], m["local_numel"]) == _listed_memory(cfg, run, world, rank)
    units = _listed_units(cfg, world)
    rows = {(r["op"], r["phase"], r["units"]): r for r in comm.fsdp_collectives(cfg, run, world)}
    if world > 1:
        assert rows[("all_gather", "forward", "root")]["bytes_each"] == world * units["root"] * 2
        assert rows[("reduce_scatter", "backward", "layers.*")]["bytes_each"] == world * units["layers.0"] * 4
        assert rows[("all_gather", "forward", "layers.*")]["count"] == cfg.layers


def test_a_deep_ddp_model_is_one_run_of_equal_buckets():
    """At a million layers the steady buckets of the seed model are one row with their count, as at a thousand."""
    run = Run(batch=1, seq=16, dtype="amp")
    deep, shallow = (comm.ddp_collectives(dataclasses.replace(SEED, layers=L), run) for L in (DEEP, 1000))
    assert [r["bytes_each"] for r in deep] == [r["bytes_each"] for r in shallow]
    assert sum(r["count"] for r in deep) > DEEP // 3


@pytest.mark.parametrize("pattern,sinks", [("all", False), ("even", True), ("even", False)])
def test_a_stages_mask_kinds_need_no_walk_over_its_layers(pattern, sinks):
    """attention.mask_kinds of a stage (a range of layers) in closed form equals the count over its layers, for every
    stage of every split of 9 layers (so a million-layer stage costs what a small one costs)."""
    from llm_anatomy.calculator.attention import mask_kinds

    cfg = ModelConfig(name="w", hidden=64, layers=9, heads=4, intermediate=96, vocab=128, window=16,
                      window_pattern=pattern, attn_sinks=sinks)
    for a in range(10):
        for b in range(a + 1, 10):
            assert mask_kinds(cfg, range(a, b)) == mask_kinds(cfg, list(range(a, b))), (a, b)
