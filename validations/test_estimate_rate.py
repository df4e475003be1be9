"""What keeps a full estimate with time fast (`anatomy estimate --gpu`, each `anatomy plan` candidate), asserted
on counted work, never on a wall clock: one calculator estimate per answer, read by memory and time; the kernel
terms priced and the backward stages walked the same number of times at 8 layers and at 4,096; a profile file
parsed and fitted once per process, its op tables prepared once; a model's kernel layout (timing/layout.py)
built once and reused at every micro-batch, and its key deciding every field it reads. bench/estimate_rate.py
measures the rate itself."""
from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import pytest

import llm_anatomy.calculator as calculator
import llm_anatomy.calculator.memory as memory
import llm_anatomy.calculator.timing as timing
import llm_anatomy.calculator.timing.layout as layout
import llm_anatomy.calculator.timing.lookup as lookup
import llm_anatomy.calculator.timing.registry as registry
import llm_anatomy.calculator.timing.roofline as roofline
from llm_anatomy.calculator.backward import Walk
from llm_anatomy.cli_estimate import estimate_all
from llm_anatomy.config import ModelConfig, Run

LLAMA = ModelConfig.from_name("llama3-8b")
CASES = {"efficient": ("none", "mlp", "full"), "baseline": ("none",)}


@contextmanager
def counting(*targets: tuple[object, str]):
    """Count the calls of each (owner, attribute) while the block runs; the functions still run."""
    calls: Counter = Counter()
    patches = []
    for owner, name in targets:
        fn = getattr(owner, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        patches.append(mock.patch.object(owner, name, wrapped))
    for p in patches:
        p.start()
    try:
        yield calls
    finally:
        for p in reversed(patches):
            p.stop()


def _work(cfg: ModelConfig, run: Run, variant: str) -> Counter:
    estimate_all(cfg, run, variant, gpu="h200-measured")  # the profile loaded, its tables prepared
    with counting((timing, "step_terms"), (roofline, "kernel_terms"), (registry, "efficiency"), (Walk, "peak"),
                  (Walk, "alloc")) as calls:
        out = estimate_all(cfg, run, variant, gpu="h200-measured")
    assert out["time"]["step_s"] > 0
    calls["entries"] = len(timing.kernels(cfg, run, variant))
    return calls


@pytest.mark.parametrize("variant,recompute", [(v, r) for v, rs in CASES.items() for r in rs],
                         ids=lambda x: str(x))
def test_estimate_work_does_not_grow_with_the_layers(variant, recompute):
    """Kernels priced (matmuls and SDPA one by one, calibrated ops' efficiencies), walk stages and allocations:
    the same counts at 8, 32 and 4,096 layers."""
    run = Run(1, 4096, recompute=recompute)
    counts = {L: _work(dataclasses.replace(LLAMA, layers=L), run, variant) for L in (8, 32, 4096)}
    assert counts[8] == counts[32] == counts[4096]
    assert counts[32]["step_terms"] == 1  # the step's kernels priced in one pass, each entry once:
    assert 0 < counts[32]["kernel_terms"] + counts[32]["efficiency"] <= counts[32]["entries"]
    assert counts[32]["peak"] > 0


@pytest.mark.parametrize("variant,recompute", [(v, r) for v, rs in CASES.items() for r in rs],
                         ids=lambda x: str(x))
def test_a_layout_is_built_once_per_model(variant, recompute):
    """A new micro-batch (a new Run, as each `anatomy plan` candidate) builds no kernel layout: the order, slots
    and host figures of a model's kernels are laid out at its first estimate only."""
    estimate_all(LLAMA, Run(1, 4096, recompute=recompute), variant, gpu="h200-measured")
    with counting((layout, "build")) as calls:
        for b in (2, 3, 5, 7):
            estimate_all(LLAMA, Run(b, 4096, recompute=recompute), variant, gpu="h200-measured")
    assert calls["build"] == 0
    with counting((layout, "build")) as calls:  # another model: laid out anew
        estimate_all(dataclasses.replace(LLAMA, layers=31), Run(2, 4096, recompute=recompute), variant,
                     gpu="h200-measured")
    assert calls["build"] == 1


def test_the_layout_key_decides_the_layout():
    """Every run whose kernel list shares a layout key (and length) has the same entries in every field a layout
    reads: over shapes where the loss's chunks and the embedding backward's launches change with the tokens."""
    from llm_anatomy.config import LOSS_IMPLS

    cfgs = (LLAMA, ModelConfig.from_name("qwen2.5-0.5b"), ModelConfig.from_name("seed"),
            ModelConfig(hidden=384, layers=3, heads=6, kv_heads=3, intermediate=1000, vocab=50257, mlp="gpt-oss",
                        tie_embeddings=True, qkv_bias=True))
    shapes = [(b, s) for b in (1, 2, 3, 5, 8, 13, 64) for s in (128, 511, 1024, 3000, 4096, 8192)]
    seen: dict[tuple, list] = {}
    for cfg in cfgs:
        for variant, rcs in CASES.items():
            for rc in rcs:
                for loss in LOSS_IMPLS:
                    for dtype in ("amp", "bf16"):
                        for opt in ("adamw", "ademamix", None):
                            for b, s in shapes:
                                run = Run(b, s, dtype, recompute=rc, loss_impl=loss)
                                ks = timing.kernels(cfg, run, variant, None, opt)
                                k = (layout.key(cfg, run, variant, None, opt), len(ks))
                                sk = [layout.skeleton(x) for x in ks]
                                assert seen.setdefault(k, sk) == sk, (k, run)
    assert len(seen) > 100


@pytest.mark.parametrize("variant", list(CASES))
def test_one_calculator_estimate_per_answer(variant):
    """estimate_all computes the calculator's estimate once; the memory phases and the time model read it."""
    run = Run(2, 2048)
    estimate_all(LLAMA, run, variant, gpu="h200-measured")
    with counting((calculator, "estimate"), (memory, "estimate"), (timing, "estimate")) as calls:
        estimate_all(LLAMA, run, variant, gpu="h200-measured")
    assert sum(calls.values()) == 1


def test_a_profile_is_read_and_prepared_once():
    """A second estimate parses no profile file, fits nothing and prepares no op table again, at any batch."""
    estimate_all(LLAMA, Run(1, 4096), "efficient", gpu="h200-measured")
    estimate_all(LLAMA, Run(1, 4096), "baseline", gpu="h200-measured")
    with counting((lookup, "from_measured"), (lookup, "check_measured"), (registry, "_table")) as calls:
        for b in (1, 3):
            for v in CASES:
                estimate_all(LLAMA, Run(b, 4096), v, gpu="h200-measured")
    assert sum(calls.values()) == 0


def test_the_shared_estimate_changes_no_figure():
    """Memory phases and time given the shared estimate equal those computed on their own."""
    run = Run(2, 1024, recompute="mlp")
    est = calculator.estimate(LLAMA, run, "efficient", device="cuda")
    assert memory.phases(LLAMA, run, "efficient", "adamw", est=est) == memory.phases(LLAMA, run, "efficient", "adamw")
    a = timing.estimate_time(LLAMA, run, "efficient", est=est)
    assert a == timing.estimate_time(LLAMA, run, "efficient")
    assert a["kernels"] and len(a["kernels"]) == a["cost"]["kernel_entries"]


@pytest.mark.parametrize("variant,recompute", [(v, r) for v, rs in CASES.items() for r in rs],
                         ids=lambda x: str(x))
def test_the_lean_paths_change_no_figure(variant, recompute):
    """What estimate_all skips changes no figure it keeps: the memory phases without their stage list (the walk
    finds its peak without listing the candidates) equal the full phases less that list; the step time without
    kernel rows equals the time with them less the rows, at a micro-batch laid out before and at a new one."""
    cfg = dataclasses.replace(LLAMA, layers=9)  # a model no other test lays out
    for b in (3, 1, 3):  # 1 and 3: the embedding backward's launch counts differ (timing/layout.py's patterns)
        run = Run(b, 2048, recompute=recompute)
        lean = memory.phases(cfg, run, variant, "adamw", stages=False)
        full = memory.phases(cfg, run, variant, "adamw")
        assert full.pop("backward_stages") and lean == full
        lean = timing.estimate_time(cfg, run, variant, with_kernels=False)  # first: a count pattern new to the layout
        rows = timing.estimate_time(cfg, run, variant, with_kernels=True)
        assert rows.pop("kernels") and lean == rows
