"""Unfused causal self-attention: separate q/k/v projections (optionally biased), RoPE, explicit QKᵀ, mask, softmax, then @V."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, S, hd); cos, sin: (S, hd). Each mul saves only its table (x needs no saving).
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:  # (B, nkv, S, hd) -> (B, nkv*n, S, hd), a copy
    if n == 1:
        return x
    B, nkv, S, hd = x.shape
    return x[:, :, None].expand(B, nkv, n, S, hd).reshape(B, nkv * n, S, hd)


class Attention(nn.Module):
    component = "attention"

    def __init__(self, hidden: int, heads: int, kv_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        # a bias (Qwen2) goes into each matmul (addmm), which saves the same two operands as without it
        self.q = nn.Linear(hidden, hidden, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin, causal_bias):  # x: (B, S, H); causal_bias: (S, S), 0 or -inf
        B, S, _ = x.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q = self.q(x).view(B, S, nh, hd).transpose(1, 2)  # (B, nh, S, hd)
        k = self.k(x).view(B, S, nkv, hd).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v(x).view(B, S, nkv, hd).transpose(1, 2)  # (B, nkv, S, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)  # (B, nh, S, hd)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # bmm saves q and k   (B, nh, S, S)
        scores = scores + causal_bias  # an additive mask saves nothing (masked_fill would save a bool mask)
        probs = F.softmax(scores.float(), dim=-1)  # softmax saves its fp32 output        (B, nh, S, S)
        out = probs.to(q.dtype) @ v  # bmm saves the cast probs and v                      (B, nh, S, hd)
        return self.o(out.transpose(1, 2).reshape(B, S, nh * hd))  # o saves its (B*S, H) input
