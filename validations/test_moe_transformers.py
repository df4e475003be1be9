"""Our baseline MoE models compute transformers' function: the same per-token losses from the same weights.

Each committed MoE config (Qwen3-MoE, Mixtral, OLMoE, gpt-oss), reduced as validations/test_moe.reduced reduces
it (two layers, narrow, every router, bias, sink and window field kept), is built by us and by transformers in
float64; our weights are loaded into transformers' model under its names and layout, and the per-token losses
agree. So the router (softmax before or after top-k, the renormalisation or not), the experts' gate/up split, the
clamps and the weighted sum are transformers'.
"""
from __future__ import annotations

import json

import pytest
import torch

from llm_anatomy.hf_config import read_hf_config
from llm_anatomy.models import build_model
from validations.test_moe import B, S, _json, hf_model, reduced

transformers = pytest.importorskip("transformers")

_HF_MOE_NAMES = [(r"^layers\.(\d+)\.mlp\.router\.", r"model.layers.\1.mlp.gate."),
                 (r"^layers\.(\d+)\.mlp\.experts\.(gate_up|down)$", r"model.layers.\1.mlp.experts.\2_proj")]


def _hf_name(name: str) -> str:
    import re

    from validations.test_qwen2 import _hf_name as dense_name

    for pat, rep in _HF_MOE_NAMES:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    return dense_name(name)


def _pair(d: dict, tmp_path, wide: bool = False):
    """(our config, our baseline, transformers' model) of the config dict d, both in float64, ours with norm
    weights drawn away from 1 (wide: the experts' tensors and the sinks drawn N(0, 1) too)."""
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = read_hf_config(tmp_path).config
    ours = build_model(cfg, dtype=torch.float64)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.5)
            elif wide and ("experts" in n or n.endswith("sinks")):
                p.normal_(0.0, 1.0)  # large enough that the clamps at ±7 and the sinks act
    return cfg, ours, hf_model(d).to(torch.float64)


def _same_losses(cfg, ours, hf, state: dict) -> None:
    import torch.nn.functional as F

    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ids = torch.randint(0, cfg.vocab, (B, S), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    with torch.no_grad():
        mine = ours(ids, targets, reduction="none")
        logits = hf(input_ids=ids).logits.float()  # as our loss upcasts them
        theirs = F.cross_entropy(logits.view(-1, cfg.vocab), targets.view(-1), reduction="none")
    torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "OLMoE-1B-7B-0924"])
def test_baseline_computes_transformers(name, tmp_path):
    """Our baseline's weights (norm weights drawn away from 1) loaded into transformers' model of the reduced
    config under its names, both in float64: the same per-token losses, so the router (softmax, top-k, the
    renormalisation or not), the experts' gate/up split and the weighted sum are transformers'. (gpt-oss: below.)"""
    cfg, ours, hf = _pair(reduced(_json(name)), tmp_path)
    _same_losses(cfg, ours, hf, {_hf_name(n): t for n, t in ours.state_dict().items()})

def _gpt_oss_state_dict(ours, cfg) -> dict:
    """Our gpt-oss weights under transformers' names and layout: its experts store x @ W ((E, H, 2I), (E, I, H)),
    gate and up interleaved column by column (gate even, up odd); ours are nn.Linear's (out, in), gate rows first."""
    out = {}
    for n, t in ours.state_dict().items():
        m = n.split(".")
        if ".mlp.router." in n:
            out[f"model.layers.{m[1]}.mlp.router.{m[-1]}"] = t
        elif ".mlp.experts." in n:
            key, I = f"model.layers.{m[1]}.mlp.experts.", cfg.expert_intermediate
            if m[-1] in ("gate_up", "gate_up_bias"):
                t = t.transpose(1, 2) if m[-1] == "gate_up" else t
                t = torch.stack((t[..., :I], t[..., I:]), dim=-1).flatten(-2)  # gate, up, gate, up, ...
            elif m[-1] == "down":
                t = t.transpose(1, 2)
            names = {"gate_up": "gate_up_proj", "down": "down_proj"}
            out[key + names.get(m[-1], m[-1].replace("_bias", "_proj_bias"))] = t
        elif n.endswith("attn.sinks"):
            out[f"model.layers.{m[1]}.self_attn.sinks"] = t
        else:
            out[_hf_name(n)] = t
    return out


def test_baseline_computes_transformers_gpt_oss(tmp_path):
    """gpt-oss: the same per-token losses as transformers' model of the reduced config (q/k/v/o biases, sinks, a
    5-token window on layer 0, the top-k-then-softmax router with its bias, the biased experts with the clamps and
    the +1), from the same weights in float64. Two differences set aside on transformers' side, each a count-neutral
    choice of ours (docs/moe.md): its activation's alpha set to 1 (ours is silu) and plain RoPE (no YaRN scaling)."""
    d = dict(reduced(_json("gpt-oss-20b")), rope_scaling=None,
             rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    cfg, ours, hf = _pair(d, tmp_path, wide=True)
    for layer in hf.model.layers:
        layer.mlp.experts.alpha = 1.0
    _same_losses(cfg, ours, hf, _gpt_oss_state_dict(ours, cfg))
