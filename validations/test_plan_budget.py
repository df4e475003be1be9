"""Claims: `anatomy plan --global-batch` splits each rank's share into micro-batches that fit, accumulating
gradients over the rest, and `--tokens` prices a token budget at the planned speed. Consistency of the plan's own
figures (the speed itself is the timing model's claim, validated elsewhere)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.cli import main
from llm_anatomy.config import ModelConfig
from llm_anatomy.plan import plan, split_global_batch
from llm_anatomy.plan_cli import token_count, tokens_text

SEED = ModelConfig.from_name("seed")


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(1, 64), share=st.integers(1, 512), fitting=st.integers(0, 600))
def test_split_is_the_largest_fitting_divisor(dp, share, fitting):
    m, accum = split_global_batch(dp * share, dp, fitting)
    if fitting == 0:
        assert (m, accum) == (0, 1)
        return
    assert m * accum == share and 1 <= m <= fitting
    assert not any(share % d == 0 for d in range(m + 1, min(share, fitting) + 1))


def test_without_a_global_batch_nothing_accumulates():
    assert split_global_batch(None, 8, 13) == (13, 1)


@pytest.mark.parametrize("gpus,global_batch", [(1, 96), (8, 1024), (4, 12)])
def test_global_batch_is_met_exactly_and_priced_per_optimizer_step(gpus, global_batch):
    free = plan(SEED, gpu="H100", seq=2048, gpus_n=gpus)
    out = plan(SEED, gpu="H100", seq=2048, gpus_n=gpus, global_batch=global_batch)
    for c, f in zip(out["candidates"], free["candidates"]):
        assert (c["strategy"], c["recompute"]) == (f["strategy"], f["recompute"])
        if not c["fits"]:
            continue
        assert c["micro_batch"] * c["accum"] * gpus == global_batch
        assert c["micro_batch"] <= f["micro_batch"]  # never more than fits
        assert c["tokens_per_s"] == pytest.approx(global_batch * 2048 / c["step_s"], rel=1e-12)


def test_a_share_past_what_fits_accumulates():
    cfg = ModelConfig.from_name("llama3-8b")
    kw = dict(gpu="H100", seq=8192, gpus_n=8, strategies=("fsdp",), recomputes=("none",))
    fits = plan(cfg, **kw)["best"]["micro_batch"]
    out = plan(cfg, **kw, global_batch=8 * 4 * fits)["best"]
    assert (out["micro_batch"], out["accum"]) == (fits, 4)


def test_four_micro_steps_cost_four_forward_backwards():
    from llm_anatomy.plan import accumulated

    t = dict(step_s=1.0, optimizer_s=0.25, comm_exposed_s=0.1, model_flops=3e14, peak_flops=1e15)
    a = accumulated(t, 4)
    assert a["step_s"] == pytest.approx(4 * 0.75 + 0.25)
    assert a["comm_exposed_s"] == pytest.approx(0.4)
    assert a["mfu"] == pytest.approx(4 * 3e14 / a["step_s"] / 1e15)
    assert accumulated(t, 1)["step_s"] == pytest.approx(1.0)


def test_token_budget_is_time_at_the_planned_speed():
    out = plan(SEED, gpu="H100", seq=2048, gpus_n=8, tokens=2e12)
    b, bud = out["best"], out["budget"]
    assert bud["seconds"] == pytest.approx(2e12 / b["tokens_per_s"], rel=1e-12)
    assert bud["gpu_hours"] == pytest.approx(bud["seconds"] / 3600 * 8, rel=1e-12)
    assert out["range"]["low"]["budget"]["seconds"] > bud["seconds"] > out["range"]["high"]["budget"]["seconds"]


@pytest.mark.parametrize("text,value", [("15T", 15e12), ("300b", 300e9), ("2e12", 2e12), (" 1.5M ", 1.5e6),
                                        ("7G", 7e9), ("10k", 1e4)])
def test_token_counts_read_as_written(text, value):
    assert token_count(text) == pytest.approx(value)
    assert token_count(tokens_text(value)) == pytest.approx(value, rel=1e-3)


def test_cli_prints_accumulation_and_budget(capsys):
    assert main(["plan", "--preset", "seed", "--gpu", "H100", "--gpus", "8", "--seq", "2048", "--global-batch",
                 "4096", "--tokens", "1T"]) == 0
    text = capsys.readouterr().out
    assert "global batch 4,096 sequences per optimizer step" in text
    assert "to train 1T tokens:" in text and "GPU-hours" in text
    assert main(["plan", "--preset", "seed", "--gpu", "H100", "--gpus", "8", "--global-batch", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 4096 and out["best"]["micro_batch"] * out["best"]["accum"] * 8 == 4096


@pytest.mark.parametrize("argv,says", [
    (["--gpus", "8", "--global-batch", "100"], "does not split evenly over 8"),
    (["--global-batch", "0"], "--global-batch must be a positive"),
    (["--tokens", "abc"], "not a number of tokens"),
    (["--tokens=-5T"], "positive"),
    (["--tokens", "inf"], "positive"),
])
def test_bad_budget_flags_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(["plan", "--preset", "seed", "--gpu", "H100", *argv])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1
