"""gpt-oss's attention fields on SDPA: sliding windows as an additive mask, sinks as one more key.

Why SDPA and not flex_attention: flex_attention's block mask would skip the masked blocks, but in torch 2.13
it refuses backward on CPU ("FlexAttention does not support backward on CPU"), and the efficient model must run
on CPU with the same code as on CUDA.

- **Masks.** A windowed layer, or any layer with sinks, passes SDPA an additive mask (0 where a query attends,
  -inf elsewhere) in q's dtype. SDPA keeps the mask it is given when its dtype is q's (a bool mask it converts,
  a new tensor per call), so each kind of mask (window or causal; with or without the sink column) is built
  once per forward (`shared_masks`) and every layer's SDPA node keeps that one storage.
- **Sinks.** gpt-oss's sink is one learned logit per head that joins each softmax row and is dropped after it:
  out_i = Σ_j p_ij v_j with p_ij = exp(x_ij) / (Σ_l exp(x_il) + exp(s_h)). Exactly that is attention over one
  more key whose logit is s_h for every query and whose value is zero. The logit is made with one more
  column: q' = [q, s_h / scale, 0...], every real key k'_j = [k_j, 0, 0...] (its logit unchanged), the sink key
  [0, ..., 0, 1, 0...] (its logit q'·k'·scale = s_h), every value padded with zeros and the sink's value zero.
  The extra columns are SINK_PAD wide (1 on CPU; 8 on CUDA, where the kernels want a head dim a multiple of 8),
  and scale stays 1/sqrt(hd). Gradients: SDPA's own backward gives d(q'), d(k'), d(v'); d(s_h) is the
  sum of d(q')'s sink column over batch and positions, divided by scale (autograd's cat and expand do it).
  Under GQA the per-head sink sits in q (per query head), so k' and v' stay at kv-head size.
  Equivalent forms: out · sigmoid(lse − s) (out and lse over the real keys), since
  Z / (Z + e^s) = 1 / (1 + e^(s − lse)); it needs lse's gradient, which no SDPA backend returns.
- What SDPA keeps with sinks: q' (B, nh, S, hd + pad), k' and v' (B, nkv, S + 1, hd + pad), its output
  (B, nh, S, hd + pad), the row statistics and the mask; o's input is the output's first hd columns merged
  over heads, a copy (B, S, nh·hd) that o keeps."""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F

_MASKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("anatomy_attention_masks", default=None)


def sink_pad(device: torch.device | str) -> int:
    """Columns added to each head for the sink's logit: 1 on CPU, 8 on CUDA (a head dim a multiple of 8)."""
    return 1 if torch.device(device).type == "cpu" else 8


@contextlib.contextmanager
def shared_masks():
    """Inside it, attention_mask builds each kind of mask once and hands every layer that storage."""
    token = _MASKS.set({})
    try:
        yield
    finally:
        _MASKS.reset(token)


def attention_mask(S: int, window: int | None, sinks: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """(S, S + sinks) additive mask: 0 where query i attends key j (j <= i, and i - j < window under a window;
    the sink column always), -inf elsewhere."""
    cache, key = _MASKS.get(), (S, window, sinks, dtype, str(device))
    if cache is not None and key in cache:
        return cache[key]
    far = torch.ones(S, S + sinks, dtype=torch.bool, device=device).triu(1)  # the future (and the sink, undone)
    if window is not None:
        far |= torch.ones(S, S + sinks, dtype=torch.bool, device=device).tril(-window)
    if sinks:
        far[:, S] = False
    mask = torch.zeros(S, S + sinks, dtype=dtype, device=device).masked_fill_(far, float("-inf"))
    if cache is not None:
        cache[key] = mask
    return mask


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor,
              enable_gqa: bool) -> torch.Tensor:
    """Attention with one sink logit per head (module docstring): q (B, nh, S, hd), k, v (B, nkv, S, hd), sinks
    (nh,), mask (S, S + 1) -> (B, nh, S, hd + pad); the caller reads the first hd columns."""
    B, nh, S, hd = q.shape
    pad, scale = sink_pad(q.device), 1.0 / math.sqrt(hd)
    # s / scale in fp32, rounded once to q's dtype; the cast's backward hands d(s) on in fp32, so the sum over
    # batch and positions runs in fp32, as the baseline's fp32 softmax sums it
    col = (sinks.float() / scale).view(1, nh, 1, 1).expand(B, nh, S, 1).to(q.dtype)
    q = torch.cat((q, col, q.new_zeros(B, nh, S, pad - 1)), dim=-1)
    k = F.pad(k, (0, pad, 0, 1))  # (B, nkv, S + 1, hd + pad): the real keys' sink column 0, then the sink key
    k[:, :, S, hd] = 1.0
    v = F.pad(v, (0, pad, 0, 1))  # the sink's value and the padding columns are zero
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
