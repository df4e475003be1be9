"""A readable mixture-of-experts block, written from the shared MoE contract (router, per-expert loop, weighted
sum), for the efficient block's tests to compare against, and the drawn MoE configs those tests share.

Same parameter names as llm_anatomy/efficient/moe.py, except the shared experts' dense MLP, which keeps the
baseline's separate gate/up/down (reference_state_dict maps them). Every op is plain torch, so autocast and
autograd treat it as they treat the baseline model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from llm_anatomy.baseline.mlp import MLP, GPT_OSS_LIMIT
from llm_anatomy.config import ROUTERS, ModelConfig


def act(gate: torch.Tensor, up: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "gpt-oss":
        gate, up = gate.clamp(max=GPT_OSS_LIMIT), up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT) + 1
    return F.silu(gate) * up


class ReferenceMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from llm_anatomy.efficient.moe import Experts  # the parameter container only: it computes nothing

        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=cfg.router_bias)
        self.experts = Experts(cfg)
        if cfg.shared_experts:
            self.shared = MLP(cfg.hidden, cfg.shared_experts * cfg.shared_intermediate, cfg.mlp)

    def routing(self, x2: torch.Tensor):
        """(router logits fp32 (T, E), weights (T, K) fp32, experts (T, K))"""
        cfg = self.cfg
        logits = self.router(x2).float()
        if cfg.router == "softmax-topk":
            w, idx = torch.softmax(logits, -1).topk(cfg.experts_per_token, -1)
            if cfg.norm_topk:
                w = w / w.sum(-1, keepdim=True)
        else:
            v, idx = logits.topk(cfg.experts_per_token, -1)
            w = torch.softmax(v, -1)
        return logits, w, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, H), normed
        cfg, ex = self.cfg, self.experts
        x2 = x.reshape(-1, cfg.hidden)
        _, w, idx = self.routing(x2)
        w = w.to(x2.dtype)
        out = torch.zeros_like(x2)
        for e in range(cfg.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # the tokens that chose e, and in which slot
            b_gu = None if ex.gate_up_bias is None else ex.gate_up_bias[e]
            b_d = None if ex.down_bias is None else ex.down_bias[e]
            gate, up = F.linear(x2[tok], ex.gate_up[e], b_gu).chunk(2, -1)
            y = F.linear(act(gate, up, cfg.mlp), ex.down[e], b_d)
            out = out.index_add(0, tok, (w[tok, slot].unsqueeze(-1) * y).to(out.dtype))
        if cfg.shared_experts:
            out = out + self.shared(x2)
        return out.view(x.shape)


def reference_state_dict(efficient_state: dict) -> dict:
    """The efficient block's state dict under the reference's names (shared.gate_up -> shared.gate, shared.up)."""
    out = {}
    for k, v in efficient_state.items():
        if k.endswith("shared.gate_up.weight"):
            gate, up = v.chunk(2)
            out[k.replace("gate_up", "gate")], out[k.replace("gate_up", "up")] = gate, up
        else:
            out[k] = v
    return out


@st.composite
def moe_configs(draw, max_experts: int = 8, aligned: bool | None = None, layers: int = 1) -> ModelConfig:
    """Small MoE configs: every router, activation, bias and shared-expert combination; widths multiples of 8
    (torch._grouped_mm's bf16 path), or any (the fallback), or either when aligned is None."""
    aligned = draw(st.booleans()) if aligned is None else aligned

    def width(lo: int, hi: int) -> int:
        return 8 * draw(st.integers(lo, hi)) if aligned else draw(st.integers(4 * lo, 8 * hi))

    experts = draw(st.integers(2, max_experts))
    shared = draw(st.integers(0, 2))
    heads = draw(st.sampled_from([1, 2, 4]))
    return ModelConfig(
        hidden=heads * 2 * draw(st.integers(2, 6)) if not aligned else 8 * heads * draw(st.integers(1, 2)),
        layers=layers, heads=heads, intermediate=width(1, 4), vocab=draw(st.integers(8, 64)),
        mlp=draw(st.sampled_from(["swiglu", "gpt-oss"])), experts=experts,
        experts_per_token=draw(st.integers(1, min(experts, 8))), expert_intermediate=width(1, 4),
        shared_experts=shared, shared_intermediate=width(1, 3) if shared else None,
        router=draw(st.sampled_from(ROUTERS)), norm_topk=draw(st.booleans()), router_bias=draw(st.booleans()),
        expert_bias=draw(st.booleans()), router_aux_coef=draw(st.sampled_from([0.0, 0.01])))
