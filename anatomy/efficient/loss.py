"""The fused linear cross-entropy op, linear_ce: lm_head + softmax + NLL in token chunks; the (B·S, V)
logits never exist.

Liger-Kernel's LigerFusedLinearCrossEntropyFunction runs wherever Triton does (CUDA, or CPU under
TRITON_INTERPRET inside anatomy.kernels.triton_on_cpu()). Elsewhere a plain-torch mirror of the same
algorithm runs, with the same saved tensors, so the CPU suite checks the same memory claims.

Forward computes the gradients (the loss is a mean, so d(loss)/d(logits) = (softmax - onehot)/n is
known chunk by chunk): it keeps grad_input (T, H) in the input's dtype and grad_weight (V, H) in the
weight's dtype for backward, which only scales them by the incoming scalar. The transient is one
chunk of logits: chunk = next_pow2(ceil(T / ceil(V / H))) rows, so a chunk of logits is about the
size of the (T, H) input. State dict: the same `lm_head.weight` as the baseline."""
from __future__ import annotations

import torch
from torch import nn

from anatomy.kernel_shapes import chunk_rows
from anatomy.kernels._dispatch import cpu_uses_triton

IGNORE_INDEX = -100


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


def per_token_losses(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Evaluation only (no autograd): (T,) fp32 losses, chunk by chunk as the fused forward computes them."""
    out = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    step = chunk_rows(x.shape[0], x.shape[1], weight.shape[0])
    for s in range(0, x.shape[0], step):
        logits = (x[s:s + step] @ weight.t()).float()
        tc = targets[s:s + step]
        out[s:s + step] = (logits.logsumexp(-1) - logits.gather(1, tc.clamp(min=0)[:, None])[:, 0]) * (tc != IGNORE_INDEX)
    return out


@torch.compiler.disable  # Liger's addmm(out_dtype=, out=) fails under fake tensors (torch 2.11): run it eagerly
def linear_ce(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """x: (T, H), weight: (V, H), targets: (T,) -> mean loss (fp32 scalar), or (T,) losses for "none"."""
    if reduction == "none":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise ValueError("reduction='none' is for evaluation: run it under torch.no_grad()")
        if x.is_cuda:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            return LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets, None, None, IGNORE_INDEX, 0.0,
                                                              0.0, "none")[0]
        return per_token_losses(x, weight, targets)
    if x.is_cuda or cpu_uses_triton():
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets)[0]
    return _ChunkedLinearCE.apply(x, weight, targets)


class LMHeadLoss(nn.Module):
    component = "loss"

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        # x: (B, S, H), targets: (B, S)
        return linear_ce(x.reshape(-1, x.shape[-1]), self.lm_head.weight, targets.reshape(-1), reduction)
