"""The efficient transformer: the baseline's structure with fused attention, norm, MLP and loss.

It loads a baseline state dict directly (load_state_dict maps q/k/v -> qkv and gate/up -> gate_up),
and to_baseline_state_dict() maps back, so both variants run from the same weights."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llm_anatomy.baseline.transformer import Embedding, rope_tables
from llm_anatomy.config import ModelConfig
from llm_anatomy.efficient.attention import Attention
from llm_anatomy.efficient.attention_sinks import shared_masks
from llm_anatomy.efficient.loss import LMHeadLoss
from llm_anatomy.efficient.mlp import MLP
from llm_anatomy.efficient.moe import LoadBalancingLoss, MoE
from llm_anatomy.efficient.norm import RMSNorm

# (fused key, baseline keys in concatenation order)
FUSED = (("attn.qkv.weight", ("attn.q.weight", "attn.k.weight", "attn.v.weight")),
         ("attn.qkv.bias", ("attn.q.bias", "attn.k.bias", "attn.v.bias")),
         ("mlp.gate_up.weight", ("mlp.gate.weight", "mlp.up.weight")),
         ("mlp.shared.gate_up.weight", ("mlp.shared.gate.weight", "mlp.shared.up.weight")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, recompute: str = "none", lean: bool = False, index: int = 0):
        super().__init__()
        self.recompute = recompute
        # Run.lean: the lean block, without recompute only (inside a checkpoint the matmuls stay nn.Linear:
        # kernels/lean.py says why)
        self.lean = lean and recompute == "none"
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.qkv_bias, self.lean, cfg.head_dim, cfg.qk_norm,
                              cfg.norm_eps, cfg.o_bias, cfg.qk_norm_whole, cfg.attn_sinks,
                              cfg.window if cfg.windowed(index) else None)  # layer `index`'s window
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        # MoE: the same call protocol as MLP (recompute "mlp" included); component "moe" (llm_anatomy/efficient/moe.py)
        self.mlp = MoE(cfg, self.lean) if cfg.moe else MLP(cfg.hidden, cfg.intermediate, cfg.mlp, self.lean)
        if recompute == "full":
            self.checkpoint = BlockCheckpoint()
        self.register_load_state_dict_pre_hook(_fuse_baseline_keys)

    def forward(self, x, cos, sin, branch=None):  # x: (B, S, H) fp32 residual under amp
        if self.lean:
            return self._fused(x, cos, sin, branch)
        if self.recompute == "full":
            return self.checkpoint(self._block, x, cos, sin)
        if self.recompute == "mlp":
            # Keep x, the attention branch (compute dtype) and what SDPA keeps; drop both normed inputs,
            # the fp32 residual sum and gate_up: 6H + 4I bytes a token less per layer under amp, less o's
            # weight cast, which nn.Linear keeps here (validations/test_recompute.py counts them). Backward re-runs both norms, the sum,
            # the gate_up matmul and the activation; no other matmul runs twice (the checkpoints' early stop).
            return self.mlp(x, norm=self.mlp_norm, branch=self.attn(x, cos, sin, norm=self.attn_norm))
        return self._block(x, cos, sin)

    def _fused(self, x, cos, sin, branch):
        """The lean block: each residual add runs inside the norm that reads its sum (add_rms_norm).
        The block takes the previous block's pending MLP branch (None for the first block) and returns
        (residual, its own MLP branch): the add that ends a block is the next block's attn_norm, or the
        model's final norm, so every norm fuses with the add in front of it while each block's norm
        weights are read only inside that block (FSDP gathers a block's parameters for its own forward).
        Bitwise the unfused _block (validations/test_add_rms_norm.py, test_efficient.py)."""
        x, y = (x, self.attn_norm(x)) if branch is None else self.attn_norm(x, branch)
        x, y = self.mlp_norm(x, self.attn(y, cos, sin))
        return x, self.mlp(y)  # (B, S, H) residual dtype, (B, S, H) compute dtype

    def _block(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class BlockCheckpoint(nn.Module):
    """Run.recompute == "full": the whole block under a non-reentrant torch.utils.checkpoint, which keeps
    only its inputs: the block input x (B, S, H) in the residual dtype, and the RoPE tables every layer
    shares (stored once). Every tensor the block's ops save is dropped, autocast's weight casts included
    (autocast still caches each one until its region ends, after the loss: they are live at the forward's
    peak, not at its end). In backward, the first op that asks for a saved tensor (down's matmul) re-runs
    the block's forward under the forward's autocast state; by the checkpoint's early stop it halts once
    down's input and weight cast are saved again, before that matmul runs: every other matmul, both norms,
    RoPE and SDPA's forward run twice. While the block's backward runs, all it saves is live again.

    A module of its own, without parameters, so that the measuring tools (llm_anatomy/measure/components.py)
    credit what the checkpoint keeps, and the residual adds it runs, to a component: attention, which reads
    the RoPE tables and, under "mlp", keeps the block input too (calculator: attention.x)."""
    component = "attention"

    def forward(self, block, x, cos, sin):
        return checkpoint(block, x, cos, sin, use_reentrant=False, preserve_rng_state=False)  # no dropout


def _fuse_baseline_keys(module, state_dict, prefix, *args) -> None:
    for fused, parts in FUSED:
        if prefix + parts[0] in state_dict:
            state_dict[prefix + fused] = torch.cat([state_dict.pop(prefix + p) for p in parts])


def to_baseline_state_dict(model: "Transformer") -> dict[str, torch.Tensor]:
    """The efficient model's weights under the baseline's keys (split along dim 0, exact)."""
    return to_baseline_names(model.state_dict(), model.cfg)


def to_baseline_names(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename/split any name -> tensor map (weights, or their gradients) to the baseline's names."""
    sizes = {"attn.qkv.weight": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim],
             "attn.qkv.bias": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim],
             "mlp.gate_up.weight": [cfg.intermediate, cfg.intermediate],
             "mlp.shared.gate_up.weight": [cfg.shared_experts * (cfg.shared_intermediate or 0)] * 2}
    out = {}
    for k, v in tensors.items():
        fused = next(((f, parts) for f, parts in FUSED if k.endswith(f)), None)
        if fused is None:
            out[k] = v
            continue
        prefix = k[: -len(fused[0])]
        for part, t in zip(fused[1], v.split(sizes[fused[0]])):
            out[prefix + part] = t
    return out


class Transformer(nn.Module):
    variant = "efficient"

    def __init__(self, cfg: ModelConfig, recompute: str = "none", loss_impl: str = "anatomy", lean: bool = False):
        super().__init__()
        self.cfg, self.recompute, self.lean = cfg, recompute, lean and recompute == "none"
        self.embed = Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, recompute, lean, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = LMHeadLoss(cfg.hidden, cfg.vocab, loss_impl)  # ours, or "liger" (efficient/loss.py)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.weight
        if cfg.moe and cfg.router_aux_coef > 0:
            self.balance = LoadBalancingLoss()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        with shared_masks():  # a window's or the sinks' mask is built once and kept once (efficient/attention_sinks.py)
            return self._forward(ids, targets, reduction)

    def _forward(self, ids: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        x = self.embed(ids)  # (B, S, H)
        # fp32 tables: the RoPE kernel rotates in fp32 registers and keeps only these two (S, hd) tables
        cos, sin = rope_tables(ids.shape[1], self.cfg.head_dim, self.cfg.rope_theta, ids.device, torch.float32)
        if self.cfg.moe and self.cfg.router_aux_coef > 0:  # this forward's blocks stash (f, P); _aux takes them
            for layer in self.layers:
                layer.mlp.collect = True
        if self.lean:  # blocks hand on (residual, pending MLP branch): Block._fused
            branch = None
            for layer in self.layers:
                x, branch = layer(x, cos, sin, branch)
            y = self.norm(x, branch)[1]  # layers >= 1 (config.py)
            del x, branch  # the last MLP output is not saved: it goes before the loss, the forward's peak
            return self._aux(self.head(y, targets, reduction), reduction)
        for layer in self.layers:
            x = layer(x, cos, sin)
        # ids, targets: (B, S); "none": (B*S,) losses
        return self._aux(self.head(self.norm(x), targets, reduction), reduction)

    def _aux(self, loss: torch.Tensor, reduction: str) -> torch.Tensor:
        """loss + router_aux_coef * the load-balancing loss over every MoE layer's stash (the mean loss only:
        the per-token losses of reduction="none" have no share of it)."""
        if not (self.cfg.moe and self.cfg.router_aux_coef > 0):
            return loss
        stats = [layer.mlp.aux for layer in self.layers]
        for layer in self.layers:
            layer.mlp.aux, layer.mlp.collect = None, False
        if reduction != "mean":
            return loss
        return loss + self.cfg.router_aux_coef * self.balance(stats, self.cfg.experts)
