"""`anatomy train`'s optimizer: adamw by default, what each variant runs (the implementation the calculator
times), and the checkpoint's record of it."""
from __future__ import annotations

import json

import pytest
import torch

from llm_anatomy.train import cli
from llm_anatomy.train.loop import TrainOptions
from validations import train_cases

SHAPE = train_cases.SHAPE
one_thread, cache = train_cases.one_thread, train_cases.cache  # the module fixtures


@pytest.mark.parametrize("variant", ["baseline", "efficient"])
@pytest.mark.parametrize("name", ["adamw", "ademamix"])
def test_each_variant_runs_the_optimizer_the_calculator_times(name, variant):
    """make_optimizer on CUDA builds what llm_anatomy/calculator/optimizer.py: implementation() names (and the
    timing model times): torch's fused AdamW for either variant; AdEMAMix's loop for the baseline and its
    compiled foreach step for the efficient variant. adamw is the default."""
    from llm_anatomy.calculator.optimizer import implementation
    from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix
    from llm_anatomy.optim.efficient import compiled_ademamix_foreach_
    from llm_anatomy.train.loop import make_optimizer

    assert TrainOptions().optimizer == "adamw" and cli.parser().parse_args([]).optimizer == "adamw"
    model = torch.nn.Linear(4, 4)
    opt = make_optimizer(name, variant, model, TrainOptions(), torch.device("cuda"))  # built, never stepped
    impl = implementation(name, variant)
    if impl == "adamw":
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    elif impl == "ademamix-loop":
        assert type(opt) is AdEMAMix
    else:
        assert impl == "ademamix-compiled" and type(opt) is FusedAdEMAMix
        assert opt._kernel(torch.device("cuda")) is compiled_ademamix_foreach_()


def test_resume_with_another_optimizer_is_one_line(cache, tmp_path, capsys):
    """The checkpoint records its optimizer: resuming it under another is refused in one line, exit 2."""
    ck = tmp_path / "ck"
    common = [*SHAPE, "--dtype", "fp32", "--steps", "2", "--eval-every", "0", "--cache-dir", str(cache),
              "--ckpt-dir", str(ck), "--progress", "none"]
    assert cli.main(common) == 0
    assert json.loads((ck / "train_log.json").read_text())["optimizer"] == "adamw"
    capsys.readouterr()
    assert cli.main([*common, "--steps", "3", "--optimizer", "ademamix", "--resume"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "with the efficient variant and adamw" in err and "Traceback" not in err, err
