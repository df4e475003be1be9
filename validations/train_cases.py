"""Shared by the training, checkpoint and parallel-engine tests: a tiny model's flags, the module fixtures they use,
and the plain one-process loop the engines' loss curves are held to."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

# a two-layer GQA model small enough for many short runs on 2 CPU cores
SHAPE = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
         "--vocab", "512", "--batch", "4", "--seq", "64", "--device", "cpu", "--progress", "none"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: runs are bit-reproducible and several test processes share the cores fairly."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


def one_process_losses(model, opt, ids, targets, steps: int) -> list[float]:
    """The loss of each of `steps` plain training steps on one batch, in one process (the reference curve)."""
    out = []
    for _ in range(steps):
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def reference_losses(cfg, run, steps: int, dtype: torch.dtype, *, lr: float = 1e-3) -> list[float]:
    """The engines' one-process reference: the baseline built with seed 0 in `dtype`, dp rank 0's batch of the
    spawned harnesses (make_batch seed 1), AdamW at `lr`, `steps` steps."""
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import build_model, make_batch

    model = build_model(cfg, "baseline", seed=0).to(dtype)
    ids, targets = make_batch(cfg, run, seed=1)
    opt = make_optimizer("adamw", model.parameters(), lr)
    return one_process_losses(model, opt, ids, targets, steps)
