"""An estimate's cost does not grow with the layer count: identical layers are computed once (the kernel
lists carry counts, the host/GPU pipeline composes a layer once, the memory walk shifts the layers between
its ends), and the result is the per-layer computation's: exactly for bytes, to float rounding for times.

The cost is asserted on deterministic quantities (kernel entries, pipeline blocks, walk stages), not on a
wall clock; one generous wall bound, far from what a loaded CI machine takes, guards against a regression
to per-layer work at a million layers."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest

from llm_anatomy.calculator import estimate
from llm_anatomy.calculator.backward import walk
from llm_anatomy.calculator.memory import phases
from llm_anatomy.calculator.timing import estimate_time, pipeline
from llm_anatomy.config import ModelConfig, Run

CONFIGS = {
    "seed": ModelConfig.from_name("seed"),
    "gqa-5": ModelConfig(name="gqa-5", hidden=512, layers=5, heads=8, kv_heads=2, intermediate=1024, vocab=1000),
    "tied-7": ModelConfig(name="tied-7", hidden=256, layers=7, heads=4, intermediate=512, vocab=3000,
                          tie_embeddings=True),
    "llama2-7b": ModelConfig.from_name("llama2-7b"),
}
RUNS = {"B2S512-amp": Run(2, 512, "amp"), "B1S2048-bf16": Run(1, 2048, "bf16"), "B2S512-recompute": Run(2, 512, "amp", "mlp")}


def _per_launch(entries: list, layers: int) -> tuple[list[float], dict]:
    """The pipeline walked launch by launch over every layer (the reference): segment times on an idle
    GPU, and the second of two back-to-back steps."""
    def order(phase):
        return pipeline.expand(pipeline.launch_order(entries, phase, layers))

    h = g = 0.0
    segs: list[list] = []  # [phase, start, end]
    for phase in pipeline.PHASES:
        for e, n in order(phase):
            if not segs or e.kernel.sync or (phase == "optimizer") != (segs[-1][0] == "optimizer"):
                h = g = max(h, g)
                segs.append([phase, h, h])
            for _ in range(n):
                h += e.host_s
                g = max(g, h) + e.gpu_s
            segs[-1][2] = max(g, h)
    h = g = 0.0
    for _ in range(2):
        t0 = max(g, h)
        for phase in pipeline.PHASES:
            if phase == "optimizer":
                t1 = max(g, h)
            for e, n in order(phase):
                if e.kernel.sync:
                    h = g = max(h, g)
                for _ in range(n):
                    h += e.host_s
                    g = max(g, h) + e.gpu_s
    return [end - start for _, start, end in segs], dict(forward_backward_s=t1 - t0, step_s=max(g, h) - t0)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_pipeline_equals_the_per_launch_walk(cfg, variant, run):
    cfg, run = CONFIGS[cfg], RUNS[run]
    if variant == "baseline" and run.recompute != "none":
        pytest.skip("recompute is an option of the efficient variant")
    from types import SimpleNamespace

    from llm_anatomy.calculator import timing

    prof = timing.get("h200-measured")
    ks = timing.kernels(cfg, run, variant)
    rows, segs, steady = timing.predict(ks, prof, timing.host_scale(prof, variant), cfg.layers)
    order = sorted(range(len(ks)), key=lambda i: (pipeline.PHASES.index(ks[i].phase), ks[i].order))
    entries = [SimpleNamespace(kernel=ks[i], gpu_s=r["per_launch_s"], host_s=r["host_s"] / ks[i].count)
               for i, r in zip(order, rows)]
    ref_segs, ref_steady = _per_launch(entries, cfg.layers)
    assert [s["time_s"] for s in segs] == pytest.approx(ref_segs, rel=1e-9)
    assert steady == pytest.approx(ref_steady, rel=1e-9)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_memory_walk_equals_the_per_layer_walk(cfg, variant, run, device):
    """The backward peak, where it is and what it holds, to the byte; every stage the shortcut lists is
    the per-layer walk's stage of the same name."""
    cfg, run = CONFIGS[cfg], RUNS[run]
    if variant == "baseline" and run.recompute != "none":
        pytest.skip("recompute is an option of the efficient variant")
    p = phases(cfg, run, variant, "adamw", device)
    start = {"parameter": p["params"], "input": p["inputs"], "optimizer state": p["optimizer"],
             "activation": p["forward_end"] - p["params"] - p["inputs"] - p["optimizer"]}
    from llm_anatomy.calculator.memory import rounded

    rnd = rounded if device == "cuda" else (lambda n: n)
    full = walk(cfg, run, variant, estimate(cfg, run, variant, device=device), start, rnd, every_layer=True)
    top = max(full, key=lambda st: st.live)
    assert (p["backward_peak"], p["backward_peak_at"], p["backward_peak_by_kind"]) == (top.live, top.name, top.by_kind)
    by_name = {st.name: (st.live, st.by_kind) for st in full}
    assert all(by_name[st["name"]] == (st["live"], st["by_kind"]) for st in p["backward_stages"])


def test_cost_does_not_grow_with_the_layers():
    """The same number of kernel entries, pipeline blocks and walk stages at 32 layers and at 1,000,000."""
    base = ModelConfig.from_name("llama2-7b")
    run = Run(1, 4096, "amp")
    cost = {}
    for L in (32, 1_000_000):
        cfg = dataclasses.replace(base, layers=L)
        t = estimate_time(cfg, run, "efficient", "h200-measured", with_kernels=False)
        cost[L] = (t["cost"], len(phases(cfg, run, "efficient", "adamw")["backward_stages"]))
        assert math.isfinite(t["step_s"])
    assert cost[32] == cost[1_000_000]


def test_a_million_layers_in_far_less_than_a_second():
    """A generous wall bound (the estimate takes milliseconds; a per-layer walk takes minutes)."""
    cfg, run = dataclasses.replace(ModelConfig.from_name("llama2-7b"), layers=1_000_000), Run(1, 4096, "amp")
    estimate_time(cfg, run, "efficient", "h200-measured", with_kernels=False)  # the profile is read once
    t0 = time.process_time()
    estimate_time(cfg, run, "efficient", "h200-measured", with_kernels=False)
    phases(cfg, run, "efficient", "adamw")
    assert time.process_time() - t0 < 2.0
