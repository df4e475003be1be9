"""lm_head + softmax + NLL fused in token chunks: the (B·S, V) logits never exist. Two implementations,
picked by LMHeadLoss(impl=...) (Transformer(loss_impl=...), Run.loss_impl in the calculator):

  "anatomy" (default): our op, anatomy::linear_cross_entropy (llm_anatomy/kernels/linear_ce.py). Triton row
      kernel on CUDA, plain-torch reference on CPU; a custom op, so torch.compile traces it.
  "liger": Liger-Kernel's LigerFusedLinearCrossEntropyFunction wherever Triton runs (CUDA, or CPU inside
      llm_anatomy.kernels.triton_on_cpu()); elsewhere a plain-torch mirror of its algorithm with the same
      saved tensors. Run eagerly (torch.compiler.disable).

Both compute the gradients in forward (the loss is a mean, so d(loss)/d(logits) = (softmax - onehot)/n
is known chunk by chunk) and save only grad_input (T, H) in the input's dtype and grad_weight (V, H) in
the weight's dtype: backward scales them by the incoming scalar, in place (Liger's CPU mirror: new copies).

Where each wins (H200, forward + backward of the loss alone, bench/linear_ce.py, reports/h200/kernels/
linear-ce.json: ours 10.75 ms vs Liger's 14.74 ms at V = 32k, 43.10 vs 68.70 ms at V = 128k):
  ours:  no host sync (the target count and the scale stay device tensors; backward multiplies by the
         incoming gradient instead of testing it against 1), so the host runs ahead of the GPU; the fp32
         head weight cast to bf16 once per step (Liger casts it twice: once cached by autocast, once per
         chunk for x @ Wᵀ); chunks of up to 4,096 rows, which keep the per-chunk grad_weight accumulation
         small beside the GEMMs; torch.compile traces it.
  Liger: a smaller logits chunk (about the size of the (T, H) input, against up to 4,096 rows within
         max(1 GiB, T·H·2) bytes for ours), so a lower forward peak where that outweighs its second weight
         cast: the calculator puts ours 0.37 GiB above it at llama3.2-1b B4 S4096 (V = 128k), 62 MiB at
         tinyllama-1.1b B8 S2048 (docs/memory.md); no scaling passes in backward when the incoming
         gradient is exactly 1 (ours always scales, 2·(T·H·c + V·H·p) bytes); and its other options
         (logit softcapping, z-loss, a bias, class weights, returning the accuracy), which ours lacks.
State dict: the same `lm_head.weight` as the baseline, under either."""
from __future__ import annotations

import torch
from torch import nn

from llm_anatomy.config import LOSS_IMPLS, ConfigError
from llm_anatomy import kernel_shapes
from llm_anatomy.kernel_shapes import chunk_rows
from llm_anatomy.kernels._dispatch import cpu_uses_triton
from llm_anatomy.kernels.linear_ce import IGNORE_INDEX, linear_cross_entropy


class _ChunkedLinearCE(torch.autograd.Function):
    """The plain-torch mirror of Liger's fused linear CE (mean reduction, ignore_index -100)."""

    @staticmethod
    def forward(ctx, x, weight, targets):  # x: (T, H), weight: (V, H), targets: (T,)
        T, V = x.shape[0], weight.shape[0]
        n = (targets != IGNORE_INDEX).sum().clamp(min=1)
        grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        step = chunk_rows(T, x.shape[1], V)
        for s in range(0, T, step):
            xc, tc = x[s:s + step], targets[s:s + step]
            logits = (xc @ weight.t()).float()  # (chunk, V): the only V-wide tensor, transient
            valid = tc != IGNORE_INDEX
            tgt = tc.clamp(min=0)
            lse = logits.logsumexp(-1)
            loss += ((lse - logits.gather(1, tgt[:, None])[:, 0]) * valid).sum()
            g = torch.softmax(logits, -1)
            g[torch.arange(len(tc), device=x.device), tgt] -= 1.0
            g = (g * (valid[:, None] / n)).to(xc.dtype)  # x is the matmul dtype under every policy
            grad_x[s:s + step] = g @ weight  # autocast casts the weight (cached) under amp
            grad_w += g.t() @ xc  # accumulates in the weight's dtype
        ctx.save_for_backward(grad_x, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None


def _liger_per_token_losses(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Evaluation only (no autograd): (T,) fp32 losses, chunk by chunk as the mirror's forward computes them."""
    out = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    step = chunk_rows(x.shape[0], x.shape[1], weight.shape[0])
    for s in range(0, x.shape[0], step):
        logits = (x[s:s + step] @ weight.t()).float()
        tc = targets[s:s + step]
        out[s:s + step] = (logits.logsumexp(-1) - logits.gather(1, tc.clamp(min=0)[:, None])[:, 0]) * (tc != IGNORE_INDEX)
    return out


@torch.compiler.disable  # Liger's addmm(out_dtype=, out=) fails under fake tensors (torch 2.11): run it eagerly
def liger_linear_ce(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    reduction: str = "mean") -> torch.Tensor:
    """Liger's fused linear CE. x: (T, H), weight: (V, H), targets: (T,) -> mean loss (fp32 scalar), or
    (T,) losses for "none"."""
    if reduction == "none":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise ValueError("reduction='none' is for evaluation: run it under torch.no_grad()")
        if x.is_cuda:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            return LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets, None, None, IGNORE_INDEX, 0.0,
                                                              0.0, "none")[0]
        return _liger_per_token_losses(x, weight, targets)
    if x.is_cuda or cpu_uses_triton():
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets)[0]
    return _ChunkedLinearCE.apply(x, weight, targets)


def linear_ce(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
              impl: str = "anatomy") -> torch.Tensor:
    """x: (T, H), weight: (V, H), targets: (T,) -> mean loss (fp32 scalar), or (T,) losses for "none"
    (evaluation). impl: "anatomy" (our op) or "liger"."""
    if impl == "liger":
        return liger_linear_ce(x, weight, targets, reduction)
    return linear_cross_entropy(x, weight, targets, IGNORE_INDEX, 0.0, reduction, align=kernel_shapes.LCE_ALIGN)


class LMHeadLoss(nn.Module):
    component = "loss"

    def __init__(self, hidden: int, vocab: int, impl: str = "anatomy"):
        super().__init__()
        if impl not in LOSS_IMPLS:
            raise ConfigError(f"loss_impl must be one of {', '.join(LOSS_IMPLS)}, got {impl!r}")
        self.impl = impl
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        # x: (B, S, H), targets: (B, S)
        return linear_ce(x.reshape(-1, x.shape[-1]), self.lm_head.weight, targets.reshape(-1), reduction, self.impl)
