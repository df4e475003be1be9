"""The efficient model's head and loss under tensor parallel: the vocab-parallel fused linear cross-entropy
(kernels/linear_ce_tp.py) on the rank's rows of lm_head.

ColwiseParallel on head.lm_head (distributed/tensor_parallel.py's plan) makes its (V, H) weight a DTensor Shard(0) over
tp, and a tied head shares the embedding's Shard(0) table; VocabParallelHead never calls lm_head, it reads the
weight's local rows. Its input, the final norm's sequence-sharded (B, S / tp, H) output, is all-gathered
(redistribute to Replicate, an all-gather of B x S x H elements) and handed to the op as a plain tensor whose
gradient is Partial (to_local's grad_placements): the op's grad_x is the rank's partial sum over its vocabulary
rows, and the redistribution's backward reduce-scatters it to the sequence shards. The weight's gradient is the
rank's rows' whole gradient, Shard(0) as the weight. The loss is a plain fp32 tensor, the same on every rank.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from llm_anatomy import kernel_shapes
from llm_anatomy.config import ConfigError
from llm_anatomy.kernels._dispatch import autocast_dtype
from llm_anatomy.kernels.linear_ce import IGNORE_INDEX
from llm_anatomy.kernels.linear_ce_tp import vocab_parallel_linear_cross_entropy


class VocabParallelHead(nn.Module):
    """lm_head (its weight Shard(0) over the 1-D tp mesh) + the vocab-parallel fused linear cross-entropy."""

    component = "loss"

    def __init__(self, lm_head: nn.Linear, vocab: int, tp_mesh):
        super().__init__()
        self.lm_head = lm_head  # the same parameter: state dict key head.lm_head.weight, tied if it was
        self.vocab = vocab
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        w = self.lm_head.weight
        if not isinstance(x, DTensor) or not isinstance(w, DTensor) or tuple(w.placements) != (Shard(0),):
            raise RuntimeError("VocabParallelHead wants a DTensor input and lm_head's weight Shard(0) over tp")
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])  # (B, S, H) whole
        wl = w.to_local()  # (V / tp, H): this rank's vocabulary rows
        start = self.tp_mesh.get_local_rank() * wl.shape[0]
        dt = autocast_dtype(x)  # autocast: x in its dtype, the weight as it is (the op casts it once)
        off = torch.autocast(x.device.type, enabled=False) if dt is not None else contextlib.nullcontext()
        with off:
            return vocab_parallel_linear_cross_entropy(x if dt is None else x.to(dt), wl, targets, start, self.vocab,
                                                       self.tp_mesh.get_group(), IGNORE_INDEX, 0.0, reduction,
                                                       align=kernel_shapes.LCE_ALIGN)


def use_vocab_parallel_head(model: nn.Module, tp_mesh) -> None:
    """Swap the efficient model's head for VocabParallelHead on the same (already parallelized) lm_head. Refuses,
    in one line, Liger's loss, which has no vocab-parallel form here."""
    impl = getattr(model.head, "impl", "anatomy")
    if impl != "anatomy":
        raise ConfigError(f"tp > 1 runs the efficient variant's own fused loss (loss_impl anatomy), not {impl!r}")
    model.head = VocabParallelHead(model.head.lm_head, model.cfg.vocab, tp_mesh)
