"""The baseline LLaMA-style transformer: pre-norm blocks, RoPE, SwiGLU (or gpt-oss) MLP or a mixture of experts
(baseline/moe.py, with transformers' load-balancing loss), untied or tied head."""
import torch
from torch import nn

from llm_anatomy.baseline.attention import Attention
from llm_anatomy.baseline.loss import LMHeadLoss
from llm_anatomy.baseline.mlp import MLP
from llm_anatomy.baseline.moe import MoE, LoadBalance
from llm_anatomy.baseline.norm import RMSNorm
from llm_anatomy.config import ModelConfig


def compute_dtype(ref: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype when autocast is on, else the parameters' dtype."""
    dev = ref.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return ref.dtype


def rope_tables(seq: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (S, hd) in the HF rotate_half layout, built in fp32 and cast once per step.

    Built once per forward and shared by every layer, so the tables are saved once, not per layer."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # (S, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Embedding(nn.Embedding):
    component = "embedding"  # saves the (B, S) int64 token ids


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.qkv_bias, cfg.head_dim, cfg.qk_norm,
                              cfg.norm_eps, o_bias=cfg.o_bias, qk_norm_whole=cfg.qk_norm_whole, sinks=cfg.attn_sinks)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.moe else MLP(cfg.hidden, cfg.intermediate, cfg.mlp)

    def forward(self, x, cos, sin, causal_bias):  # x: (B, S, H); the residual adds save nothing
        x = x + self.attn(self.attn_norm(x), cos, sin, causal_bias)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    variant = "baseline"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = LMHeadLoss(cfg.hidden, cfg.vocab)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.weight
        self.balance = LoadBalance() if cfg.router_aux_coef else None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        S = ids.shape[1]
        x = self.embed(ids)  # (B, S, H), in the parameters' dtype
        dt = compute_dtype(x)
        cos, sin = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, ids.device, dt)
        causal_bias = torch.full((S, S), float("-inf"), device=ids.device, dtype=dt).triu(1)
        window_bias = None
        if self.cfg.window is not None:  # a query sees itself and the window - 1 tokens before it
            far = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril(-self.cfg.window)
            window_bias = causal_bias.masked_fill(far, float("-inf"))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, window_bias if self.cfg.windowed(i) else causal_bias)
        loss = self.head(self.norm(x), targets, reduction)  # ids, targets: (B, S); "none": (B*S,) losses
        if self.balance is None:
            return loss
        stats = [layer.mlp.stats for layer in self.layers]
        for layer in self.layers:  # the blocks hold no graph past this step
            layer.mlp.stats = None
        if reduction != "mean":  # the load-balancing loss is the batch's: per-token losses have no share of it
            return loss
        return loss + self.cfg.router_aux_coef * self.balance(stats, self.cfg.experts)
