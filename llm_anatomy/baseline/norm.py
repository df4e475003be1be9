"""RMSNorm as separate ops in fp32: readable, and each op keeps what its own backward needs."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    component = "norm"

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        x32 = x.float()  # a no-op on the fp32 residual stream; a copy under pure bf16
        var = x32.pow(2).mean(-1, keepdim=True)  # pow saves x32               (B, S, 1)
        rstd = torch.rsqrt(var + self.eps)  # rsqrt saves its result rstd        (B, S, 1)
        y = x32 * rstd  # mul saves x32 (same storage) and rstd                 (B, S, H)
        return (y * self.weight).to(x.dtype)  # mul saves y; the weight is a parameter
