"""The calculator's memory for our fused linear cross-entropy against the committed H200 records
(bench/loss_memory.py, records.LOSS_MEMORY: the seed and two real configs, efficient model, amp, no optimizer).

Each record holds measurements only; the predictions are made here from the record's config and run:
  * the bytes autograd saves for the loss op alone (grad_fn.saved_tensors of x (T, H) bf16 and the fp32
    head weight, storage level): exact, a discrete quantity;
  * the whole step's peak (max_memory_allocated inside forward and backward, expandable segments, as the
    memory probe's claims are measured): within ±1%.
"""
from __future__ import annotations

import json

import pytest

from llm_anatomy import records
from llm_anatomy.calculator import estimate
from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import ModelConfig, Run

PEAK_TOL = 0.01  # the bound for the step peak with the new loss on the H200
IDS = [p.stem.removeprefix("loss-memory-") for p in records.LOSS_MEMORY]


def _load(path):
    rec = json.loads(path.read_text())
    return rec, ModelConfig.from_name(rec["preset"]), Run.from_record(rec)


def test_the_records_are_ours_and_measured_only():
    """Every record ran our loss under expandable segments and stores no calculator figure."""
    for path in records.LOSS_MEMORY:
        rec, _, run = _load(path)
        assert run.loss_impl == "anatomy" and rec["variant"] == "efficient", path.name
        assert rec["allocator"] == "expandable_segments:True", path.name
        assert not any("predict" in k for k in (*rec, *rec["loss_alone"])), path.name


@pytest.mark.parametrize("path", records.LOSS_MEMORY, ids=IDS)
def test_loss_saved_bytes_exact(path, claims):
    rec, cfg, run = _load(path)
    pred = sum(s.bytes for s in estimate(cfg, run, "efficient", device="cuda").components["loss"].saved)
    claims.check("memory.saved by our fused linear CE (the op alone)", component="loss",
                 config=f"{rec['preset']}/B{run.batch}S{run.seq}", variant="efficient", predicted=pred,
                 measured=rec["loss_alone"]["saved"], device="cuda (recorded)", unit="B",
                 note=f"{records.rel(path)}: {rec['gpu']}, bench/loss_memory.py")


@pytest.mark.parametrize("path", records.LOSS_MEMORY, ids=IDS)
def test_step_peak_with_our_loss_within_1pct(path, claims):
    rec, cfg, run = _load(path)
    ph = phases(cfg, run, "efficient", optimizer=None, device="cuda")  # bench/loss_memory.py: forward + backward
    pred = max(ph["forward_peak"] or 0, ph["backward_peak"])
    measured = max(p["peak"] for p in rec["phases"] if p["name"] in ("forward", "backward"))
    assert measured == rec["step_peak"]
    claims.check("memory.peak of a fwd+bwd step with our fused linear CE", component="model",
                 config=f"{rec['preset']}/B{run.batch}S{run.seq}", variant="efficient", predicted=pred,
                 measured=measured, tolerance=PEAK_TOL, device="cuda (recorded)", unit="B",
                 note=f"{records.rel(path)}: {rec['gpu']}, expandable segments, bench/loss_memory.py")
