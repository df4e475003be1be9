"""RMSNorm as one fused kernel (llm_anatomy.kernels.rms_norm).

Saves only x and the weight: rstd is recomputed in backward (one extra reduction over a row that
backward reads anyway), against the baseline's fp32 x, rstd and x_hat. Under autocast it writes
its output directly in bf16, so the matmuls that read it need no cast of their own and share one
saved storage.

Called with a branch, the norm is also the residual add in front of it (llm_anatomy.kernels.add_rms_norm):
(x, branch) -> (x + branch, rmsnorm(x + branch)), one kernel that saves x + branch as the plain norm
saves its input, and in backward writes the residual gradient and the branch's cast copy in one pass."""
import torch
from torch import nn

from llm_anatomy.kernels import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    component = "norm"

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None = None):
        # (B, S, H) -> (B, S, H), bf16 under autocast; with a branch (B, S, H): (x + branch, its norm)
        if branch is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, branch, self.weight, self.eps)
