"""scripts/probe_common.run_rows, the loop every H200 probe records its rows with, on CPU: rows in order,
a failing row recorded and skipped, the second pass only after every first, `between` in the header
between the two, and the JSON rewritten after every row (so a run cut short keeps what it measured)."""
import argparse
import json

import torch

from llm_anatomy.config import ModelConfig, Run

from scripts import probe_common


def test_run_rows_order_errors_between_and_header(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "fake GPU")
    calls = []
    cfg = ModelConfig(name="t", hidden=64, layers=1, heads=4, intermediate=96, vocab=128)
    cases = [("a", cfg, Run(1, 8), ("baseline", "efficient"), "adamw"), ("b", cfg, Run(2, 8), ("efficient",), None)]

    def measure(c, run, variant, opt):
        calls.append(("first", run.batch, variant))
        if run.batch == 2:
            raise RuntimeError("out of memory (fake)")
        return dict(ms=1.0)

    def second(c, run, variant, opt):
        calls.append(("second", run.batch, variant))
        return dict(kernels=2.0)

    def between():
        calls.append(("between",))
        return dict(host_step_after=3.0)

    out = tmp_path / "rows.json"
    a = argparse.Namespace(out=str(out), seed=7)
    assert probe_common.run_rows("probe_x", a, cases, measure, lambda row: "ok", second=second, between=between,
                                 host_step_before=4.0) == 0
    assert calls == [("first", 1, "baseline"), ("first", 1, "efficient"), ("first", 2, "efficient"), ("between",),
                     ("second", 1, "baseline"), ("second", 1, "efficient")]
    head = json.loads(out.read_text())
    assert head["gpu"] == "fake GPU" and head["seed"] == 7 and head["command"].startswith("python3 -m scripts.probe_x")
    assert (head["host_step_before"], head["host_step_after"]) == (4.0, 3.0)
    rows = head["rows"]
    assert [(r["config"], r["variant"]) for r in rows] == [("a", "baseline"), ("a", "efficient"), ("b", "efficient")]
    assert rows[0] == dict(rows[0], ms=1.0, kernels=2.0, optimizer="adamw", batch=1, seq=8)
    assert "RuntimeError: out of memory" in rows[2]["error"] and "kernels" not in rows[2]
