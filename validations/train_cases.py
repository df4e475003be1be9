"""Shared by the training and checkpoint tests: a tiny model's flags and the module fixtures they both use."""
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
