"""The mixture-of-experts block, readable: a linear router picks k of E experts per token, a Python loop runs each
expert that received tokens on just those rows (index_select in, index_add out), and the shared experts run as
one dense MLP on every token. Dropless: every token reaches its k experts. The module contract (parameter names
and shapes, routing, the load-balancing statistics) is docs/moe.md's; llm_anatomy/calculator/moe.py counts it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm_anatomy.baseline.mlp import GPT_OSS_LIMIT, MLP
from llm_anatomy.config import ModelConfig


def route(logits: torch.Tensor, cfg: ModelConfig):
    """The router's choice from its logits (T, E): (weights (T, k) float32, expert indices (T, k), the probability
    of every expert (T, E) float32 where the load-balancing loss needs it, else None)."""
    logits, k = logits.float(), cfg.experts_per_token  # the logits come in the autocast dtype; softmax in float32
    if cfg.router == "softmax-topk":
        probs = F.softmax(logits, dim=-1)  # softmax keeps its output (T, E)
        w, idx = probs.topk(k, dim=-1)  # topk keeps its indices
        if cfg.norm_topk:
            w = w / w.sum(-1, keepdim=True)  # the division keeps w and the sum
        return w, idx, probs
    top, idx = logits.topk(k, dim=-1)
    w = F.softmax(top, dim=-1)  # over the k chosen logits only
    return w, idx, (F.softmax(logits, dim=-1) if cfg.router_aux_coef else None)


class Experts(nn.Module):
    """E gated MLPs stored as stacked tensors (nn.Linear's (out, in) layout): gate_up's rows 0..I-1 are the gate,
    rows I..2I-1 the up."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.experts, cfg.hidden, cfg.expert_intermediate
        self.variant = cfg.mlp
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))
        if cfg.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I))
            self.down_bias = nn.Parameter(torch.empty(E, H))
        else:
            self.gate_up_bias = self.down_bias = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows x (n, H): the same gated activation as baseline/mlp.py's MLP."""
        b1, b2 = (None, None) if self.gate_up_bias is None else (self.gate_up_bias[e], self.down_bias[e])
        # each slice of a stacked weight is no leaf: under autocast every call casts (and keeps) it anew
        gate, up = F.linear(x, self.gate_up[e], b1).chunk(2, dim=-1)  # views of one (n, 2I)
        if self.variant == "gpt-oss":
            gate = gate.clamp(max=GPT_OSS_LIMIT)
            up = up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT) + 1
        return F.linear(F.silu(gate) * up, self.down[e], b2)


class MoE(nn.Module):
    component = "moe"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=cfg.router_bias)
        self.experts = Experts(cfg)
        width = cfg.shared_experts * (cfg.shared_intermediate or 0)
        self.shared = MLP(cfg.hidden, width, cfg.mlp) if width else None
        self.stats = None  # (f, P) of the last forward, where the load-balancing loss needs them

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        B, S, H = x.shape
        xf = x.reshape(B * S, H)
        w, idx, probs = route(self.router(xf), self.cfg)
        y = None
        for e in range(self.cfg.experts):  # each expert that received tokens, on just those rows
            tok, slot = torch.where(idx == e)  # the tokens routed to e, and which of their k choices it was
            if tok.numel() == 0:
                continue
            ye = self.experts.expert(e, xf.index_select(0, tok))
            ye = ye * w[tok, slot].to(ye.dtype).unsqueeze(-1)  # the weight, cast to the activation dtype
            y = ye.new_zeros(B * S, H) if y is None else y
            y = y.index_add(0, tok, ye)
        y = y.view(B, S, H)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.cfg.router_aux_coef:  # f: the share of the tokens routed to each expert, over the k choices
            f = torch.bincount(idx.flatten(), minlength=self.cfg.experts).float() / idx.shape[0]
            self.stats = (f, probs.mean(0))  # P: each expert's mean probability
        return y


class LoadBalance(nn.Module):
    """transformers' load_balancing_loss_func over every layer's tokens: E x sum_e f_e x P_e, with f and P each
    averaged over the layers first."""
    component = "moe"

    def forward(self, stats: list[tuple[torch.Tensor, torch.Tensor]], experts: int) -> torch.Tensor:
        f = torch.stack([s[0] for s in stats]).mean(0)
        p = torch.stack([s[1] for s in stats]).mean(0)
        return experts * (f * p).sum()  # the product keeps f (P needs the gradient, f none)
