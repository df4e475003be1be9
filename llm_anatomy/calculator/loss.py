"""lm_head + cross-entropy. Baseline: the full (B*S, V) logits, upcast to fp32. Efficient: a fused linear CE."""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy import kernel_shapes


def params(cfg: ModelConfig) -> int:
    return 0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden  # a tied head is the embedding's matrix


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    dt, T, H, V = dtypes(run), run.tokens, cfg.hidden, cfg.vocab
    saved = linears_saved("loss", T, H, {"lm_head": V}, dt, 1, dt.residual)
    saved += [
        Saved("loss.log_probs", (T, V), "float32", 1, "log_softmax keeps its output; nll_loss reads it too"),
        Saved("loss.targets", (run.batch, run.seq), "int64", 1, "nll_loss keeps the targets"),
        Saved("loss.total_weight", (), "float32", 1, "nll_loss keeps the count it divided by"),
    ]
    f = 2 * T * H * V
    return Component("loss", 1, params(cfg), f, 2 * f, f, 2 * f, T * V * 5, saved)


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    """Fused linear CE, ours or Liger's (Run.loss_impl): the forward already computes both gradients, so the
    counter sees all three matmuls (logits, grad_input, grad_weight) in forward and none in backward (our
    custom op carries a FlopCounterMode formula saying so). The model convention keeps the usual 1:2 split,
    since it counts work by role, not by when it runs. Saved: the two gradients and nothing else, under
    either kernel (llm_anatomy/kernels/linear_ce.py: ctx.save_for_backward(grad_x, grad_w)); its transients are
    the memory phases' (calculator/memory.py)."""
    dt, T, H, V = dtypes(run), run.tokens, cfg.hidden, cfg.vocab
    # ours: grad_w keeps its (V', H) accumulator's storage where the vocabulary is padded (kernel_shapes.LCE_ALIGN),
    # else it is that (V, H) buffer; Liger's is (V, H)
    Vg = V if run.loss_impl == "liger" else kernel_shapes.lce_vocab(V, kernel_shapes.LCE_ALIGN)
    saved = [Saved("loss.grad_input", (T, H), dt.compute, 1, "computed in forward, scaled in backward"),
             Saved("loss.grad_weight", (Vg, H), dt.param, 1, "computed in forward, in the weight's dtype")]
    f = 2 * T * H * V
    return Component("loss", 1, params(cfg), 3 * f, 0, f, 2 * f, T * V * 5, saved)
