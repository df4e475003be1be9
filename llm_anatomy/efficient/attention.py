"""Attention: one QKV matmul, fused split + RoPE (llm_anatomy.kernels.rope_qkv), SDPA on the best backend.

- One (H -> (nh + 2·nkv)·hd) projection: one matmul launch, and one saved input instead of three.
  A q/k/v bias (Qwen2) is its ((nh + 2·nkv)·hd,) bias: added inside the matmul (addmm, cuBLASLt's bias
  epilogue on CUDA), before rope_qkv rotates q and k, as the baseline adds it before RoPE; addmm saves
  the same two operands with or without it.
- rope_qkv writes q, k, v as separate contiguous tensors, so no view keeps the fused output alive;
  it saves only the cos/sin tables.
- SDPA never materialises the S×S scores: it keeps q, k, v, its output and a logsumexp per row
  (plus backend extras, e.g. an RNG seed/offset on CUDA). GQA goes to the kernel (enable_gqa), so
  k and v are kept at kv-head size (in fp32 on CUDA, where no fused kernel takes GQA, they are expanded: kernel_kv). Its output is laid out (B, S, nh, hd), so the o projection's
  input is a view of it, not a copy.
- In the lean block (Run.lean, without recompute) qkv and o run llm_anatomy.kernels.lean.linear: under autocast their nodes
  keep the fp32 weight, not a bf16 cast of it; backward casts it again (the same bits).
- Recompute (Run.recompute == "mlp"): called with the block's norm, norm -> qkv runs under a
  non-reentrant torch.utils.checkpoint that keeps only x; in backward it re-runs the norm and stops
  (early stop) when the qkv matmul has been handed its input again, before that matmul runs.
- qk-norm (Qwen3): rope_qkv_norm (llm_anatomy.kernels.rope_norm) in rope_qkv's place: the same pass norms
  each q and k head (q_norm's and k_norm's weights) before rotating it, so no normed q or k, row copy or cat
  is written. It keeps the qkv output (one storage, (nh + 2·nkv)·hd wide, v's columns included) and
  recomputes rstd in backward, which also writes both weights' gradients. The modules q_norm and k_norm hold
  the weights (the baseline's names) and are not called.
- gpt-oss and OLMoE (llm_anatomy/efficient/attention_sinks.py): a layer with a sliding window or sinks passes SDPA an
  additive mask, shared by the layers (no is_causal); sinks join as one more key; o may carry a bias (gpt-oss).
  OLMoE's q/k norm over the whole projection runs the fused rms_norm on qkv's q and k columns (views: both norms
  keep qkv's one storage, as rope_qkv_norm does), then the plain rope_qkv on cat(q, k, v): rope_qkv_norm norms
  per head and cannot norm a whole projection.
State dict: qkv.weight = cat(q.weight, k.weight, v.weight), qkv.bias likewise (see efficient.transformer)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from llm_anatomy.efficient.attention_sinks import attention_mask, sink_sdpa
from llm_anatomy.efficient.norm import RMSNorm
from llm_anatomy.kernels import rms_norm, rope_qkv, rope_qkv_norm
from llm_anatomy.kernels.lean import linear

# Measured on the H200 (ANCHORS.md): causal, hd 64, fwd+bwd, cuDNN 386 TFLOP/s, flash 238,
# memory-efficient 103. So: cuDNN first, then flash, then memory-efficient; math never by choice.
CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def backend_context(device: torch.device):
    """The SDPA backend preference for a device (CPU has one flash-style kernel: nothing to choose)."""
    if device.type == "cuda":
        return sdpa_kernel(CUDA_PRIORITY, set_priority=True)
    return contextlib.nullcontext()


def kernel_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool):
    """(k, v, enable_gqa) as SDPA takes them: GQA goes to the kernel, except in fp32 on CUDA, where no fused backend
    takes it (cuDNN and flash run 16-bit only; the memory-efficient kernel, the one that runs fp32, has no
    enable_gqa): there k and v are expanded to the query heads, (B, nkv, S, hd) -> (B, nh, S, hd). The calculator
    models the 16-bit case (calculator/attention.py refuses fp32 on CUDA)."""
    if gqa and q.is_cuda and q.dtype == torch.float32:
        groups = q.shape[1] // k.shape[1]
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
    return k, v, gqa


def sdpa_backend_name(grad_fn) -> str:
    """Which kernel ran, read off the autograd node SDPA created (e.g. 'cudnn', 'flash', 'cpu-flash')."""
    n = type(grad_fn).__name__.lower()
    for key, name in (("cudnn", "cudnn"), ("flashattentionforcpu", "cpu-flash"), ("flash", "flash"),
                      ("efficient", "memory-efficient")):
        if key in n:
            return name
    return "math"


def _local(weight: torch.Tensor) -> torch.Tensor:
    """A q/k norm weight as the fused op takes it. Under tensor parallelism (distributed/tensor_parallel.py's
    qk_norm_plan) it is a DTensor replicated over tp while q and k hold the rank's heads: the op gets the rank's
    copy, and its gradient, summed over this rank's heads only, is Partial over tp (as a norm module run under
    SequenceParallel leaves it)."""
    if type(weight) in (torch.Tensor, nn.Parameter):  # one process
        return weight
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(weight, DTensor):
        return weight.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in weight.placements])
    return weight


class Attention(nn.Module):
    component = "attention"

    def __init__(self, hidden: int, heads: int, kv_heads: int, qkv_bias: bool = False, lean: bool = False,
                 head_dim: int | None = None, qk_norm: bool = False, eps: float = 1e-6, o_bias: bool = False,
                 qk_norm_whole: bool = False, sinks: bool = False, window: int | None = None):
        super().__init__()
        self.lean = lean  # qkv and o keep no weight cast for backward (False inside a checkpoint: see kernels/lean.py)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        qd, kvd = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv = nn.Linear(hidden, qd + 2 * kvd, bias=qkv_bias)
        self.o = nn.Linear(qd, hidden, bias=o_bias)
        if qk_norm:  # the baseline's widths: each head's hd, or the whole q and k (OLMoE)
            self.q_norm, self.k_norm = (RMSNorm(qd, eps), RMSNorm(kvd, eps)) if qk_norm_whole else \
                (RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps))
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None  # a logit per head (gpt-oss)
        self.qk_norm, self.qk_norm_whole, self.window = qk_norm, qk_norm_whole, window  # this layer's window
        self.last_backend: str | None = None

    def forward(self, x, cos, sin, norm: nn.Module | None = None):  # x: (B, S, H); cos, sin: (S, hd) fp32
        B, S, _ = x.shape
        if norm is None:  # x is normed
            qkv = self._linear(self.qkv, x)  # (B, S, (nh + 2 nkv) hd)
        else:  # x is the residual stream; keep it, not its normed copy
            qkv = checkpoint(lambda x: self.qkv(norm(x)), x, use_reentrant=False, preserve_rng_state=False)
        if self.qk_norm_whole:  # over the whole q and k (views of qkv), then the plain RoPE kernel
            qd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
            qn = rms_norm(qkv[..., :qd], _local(self.q_norm.weight), self.q_norm.eps)
            kn = rms_norm(qkv[..., qd:qd + kvd], _local(self.k_norm.weight), self.k_norm.eps)
            q, k, v = rope_qkv(torch.cat((qn, kn, qkv[..., qd + kvd:]), dim=-1), cos, sin, self.heads, self.kv_heads)
        elif self.qk_norm:  # q_norm and k_norm run inside the RoPE kernel
            q, k, v = rope_qkv_norm(qkv, _local(self.q_norm.weight), _local(self.k_norm.weight), cos, sin, self.heads,
                                    self.kv_heads, self.q_norm.eps)
        else:
            q, k, v = rope_qkv(qkv, cos, sin, self.heads, self.kv_heads)  # (B, nh|nkv, S, hd), contiguous
        k, v, gqa = kernel_kv(q, k, v, self.kv_heads != self.heads)
        hd = self.head_dim
        with backend_context(x.device):
            if self.sinks is not None:  # (B, nh, S, hd + pad): the first hd columns are the output
                mask = attention_mask(S, self.window, True, q.dtype, q.device)
                out = sink_sdpa(q, k, v, _local(self.sinks), mask, gqa)
            elif self.window is not None:
                mask = attention_mask(S, self.window, False, q.dtype, q.device)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, nh, S, hd)
        self.last_backend = sdpa_backend_name(out.grad_fn) if out.grad_fn is not None else None
        if out.shape[-1] != hd:
            out = out[..., :hd]
        # a view when out is laid out (B, S, nh, hd)
        return self._linear(self.o, out.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))

    def _linear(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, mod.weight, mod.bias) if self.lean else mod(x)
