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
from torch.utils._python_dispatch import TorchDispatchMode

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
        self.keep_terms = False  # retain each expert's pre-bias outputs' gradients (bias_term_scales)
        # the experts (T, K) to route to instead of top-k's choice: float64 takes the low-precision run's
        # routing, so that a near-tie decided the other way does not compare two different functions
        self.forced_idx: torch.Tensor | None = None
        self.last_idx: torch.Tensor | None = None
        self.last_w: torch.Tensor | None = None
        self.terms: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=cfg.router_bias)
        self.experts = Experts(cfg)
        if cfg.shared_experts:
            self.shared = MLP(cfg.hidden, cfg.shared_experts * cfg.shared_intermediate, cfg.mlp)

    def routing(self, x2: torch.Tensor):
        """(router logits fp32 (T, E), weights (T, K) fp32, experts (T, K))"""
        cfg = self.cfg
        logits = self.router(x2).float()
        if cfg.router == "softmax-topk":
            probs = torch.softmax(logits, -1)
            w, idx = self._topk(probs)
            if cfg.norm_topk:
                w = w / w.sum(-1, keepdim=True)
        else:
            v, idx = self._topk(logits)
            w = torch.softmax(v, -1)
        self.last_idx = idx.detach()
        if w.requires_grad:
            w.retain_grad()
        self.last_w = w  # the routing weights before their cast (the tests read their gradient)
        return logits, w, idx

    def _topk(self, scores: torch.Tensor):
        if self.forced_idx is None:
            return scores.topk(self.cfg.experts_per_token, -1)
        return scores.gather(-1, self.forced_idx), self.forced_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, H), normed
        cfg, ex = self.cfg, self.experts
        x2 = x.reshape(-1, cfg.hidden)
        _, w, idx = self.routing(x2)
        w = w.to(x2.dtype)
        out = torch.zeros_like(x2)
        self.terms = []
        for e in range(cfg.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # the tokens that chose e, and in which slot
            b_gu = None if ex.gate_up_bias is None else ex.gate_up_bias[e]
            b_d = None if ex.down_bias is None else ex.down_bias[e]
            gate_up = F.linear(x2[tok], ex.gate_up[e], b_gu)
            gate, up = gate_up.chunk(2, -1)
            y = F.linear(act(gate, up, cfg.mlp), ex.down[e], b_d)
            if self.keep_terms:
                gate_up.retain_grad()
                y.retain_grad()
                self.terms.append((e, gate_up, y))
            out = out.index_add(0, tok, (w[tok, slot].unsqueeze(-1) * y).to(out.dtype))
        if cfg.shared_experts:
            out = out + self.shared(x2)
        return out.view(x.shape)


def bias_term_scales(ref: ReferenceMoE) -> dict[str, float]:
    """After a backward with keep_terms: the expert biases' gradients are per-expert sums over rows of d(gate_up)
    and d(y); the norms of the sums of their magnitudes are those sums' term scales."""
    cfg = ref.cfg
    gu = torch.zeros(cfg.experts, 2 * cfg.expert_intermediate, dtype=torch.float64)
    dn = torch.zeros(cfg.experts, cfg.hidden, dtype=torch.float64)
    for e, gate_up, y in ref.terms:
        gu[e], dn[e] = gate_up.grad.abs().sum(0), y.grad.abs().sum(0)
    return {"experts.gate_up_bias": gu.norm().item(), "experts.down_bias": dn.norm().item()}


class Routing(TorchDispatchMode):
    """One model's routing, recorded, then imposed on other models of the same config: top-k is a discontinuous
    function, so where two roundings of the router's logits fall on either side of a near-tie they pick different
    experts, and comparing those models compares two functions, not two roundings. Each router (a MoE block's
    `router` module, in module order) marks its layer as it runs; while recording, every top-k keeps its indices
    for that layer; while imposing, every top-k returns the recorded indices and its own input's values at them.
    It acts below autograd (a dispatch mode), so autograd's own top-k backward scatters to the imposed experts,
    and it stays active in a checkpoint's re-run, which routes as the forward did (keyed by layer, not by call)."""

    def __init__(self, *models: nn.Module):
        super().__init__()
        self.indices: dict[int, torch.Tensor] = {}
        self.imposing = False
        self.layer: int | None = None
        for model in models:
            routers = [m.router for m in model.modules() if m.__class__.__name__ == "MoE"]
            for layer, router in enumerate(routers):
                router.register_forward_pre_hook(lambda _m, _a, layer=layer: setattr(self, "layer", layer))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.topk.default:
            return func(*args, **kwargs)
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        assert self.layer is not None and dim in (-1, args[0].dim() - 1), "a top-k outside a router"
        if not self.imposing:
            values, idx = func(*args, **kwargs)
            self.indices[self.layer] = idx.clone()
            return values, idx
        idx = self.indices[self.layer].to(args[0].device)
        return torch.ops.aten.gather.default(args[0], -1, idx), idx.clone()


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
