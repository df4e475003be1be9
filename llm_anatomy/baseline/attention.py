"""Unfused causal self-attention: separate q/k/v projections (optionally biased, and o too: gpt-oss), an optional
RMSNorm over each q and k head (Qwen3's q_norm, k_norm) or over the whole q and k (OLMoE's), RoPE, explicit QKᵀ,
mask (causal, or a sliding window's, as the caller passes it), softmax (with gpt-oss's sinks: one more learned
logit per head in each row, dropped after the softmax), then @V."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from llm_anatomy.baseline.norm import RMSNorm


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

    def __init__(self, hidden: int, heads: int, kv_heads: int, qkv_bias: bool = False, head_dim: int | None = None,
                 qk_norm: bool = False, eps: float = 1e-6, o_bias: bool = False, qk_norm_whole: bool = False,
                 sinks: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        qd = heads * self.head_dim  # hidden, unless the config states its head_dim (Qwen3)
        # a bias (Qwen2) goes into each matmul (addmm), which saves the same two operands as without it
        self.q = nn.Linear(hidden, qd, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o = nn.Linear(qd, hidden, bias=o_bias)
        if qk_norm and qk_norm_whole:  # over the whole q and the whole k projection (OLMoE)
            self.q_norm, self.k_norm = RMSNorm(qd, eps), RMSNorm(kv_heads * self.head_dim, eps)
        elif qk_norm:  # one weight of head_dim each, shared by every head (Qwen3RMSNorm over the last dim)
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None  # a logit per head (gpt-oss)
        self.qk_norm, self.qk_norm_whole = qk_norm, qk_norm_whole

    def forward(self, x, cos, sin, causal_bias):  # x: (B, S, H); causal_bias: (S, S), 0 or -inf
        B, S, _ = x.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k = self.q(x), self.k(x)
        if self.qk_norm_whole:  # over the whole projection, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, S, nh, hd), k.view(B, S, nkv, hd)
        if self.qk_norm and not self.qk_norm_whole:  # over each head's hd, before RoPE; each keeps its fp32 input,
            q, k = self.q_norm(q), self.k_norm(k)  # rstd and x_hat
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, S, hd), (B, nkv, S, hd)
        v = self.v(x).view(B, S, nkv, hd).transpose(1, 2)  # (B, nkv, S, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)  # (B, nh, S, hd)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # bmm saves q and k   (B, nh, S, S)
        scores = scores + causal_bias  # an additive mask saves nothing (masked_fill would save a bool mask)
        if self.sinks is None:
            probs = F.softmax(scores.float(), dim=-1)  # softmax saves its fp32 output      (B, nh, S, S)
        else:  # the sink joins each row's softmax (it keeps its (B, nh, S, S+1) output) and is dropped after it
            sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks  # TP: the rank's heads'
            sink = sinks.float().view(1, nh, 1, 1).expand(B, nh, S, 1)
            probs = F.softmax(torch.cat((scores.float(), sink), dim=-1), dim=-1)[..., :-1]
        out = probs.to(q.dtype) @ v  # bmm saves the cast probs and v                      (B, nh, S, hd)
        return self.o(out.transpose(1, 2).reshape(B, S, nh * hd))  # o saves its (B*S, H) input
