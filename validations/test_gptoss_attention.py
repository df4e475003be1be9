"""gpt-oss's attention (sinks, sliding windows, o bias) and OLMoE's whole q/k norm in the efficient model
(llm_anatomy/efficient/attention_sinks.py, efficient/attention.py), against the baseline.

The efficient model equals the baseline's loss and every gradient (the sinks', o's bias's and the whole-projection
norms' included) within test_efficient's stated tolerance: error(efficient) <= 2 × error(baseline), both against
the baseline in float64, on a 2-layer narrow gpt-oss-20b and OLMoE-1B-7B-0924 read from the committed configs,
every dtype policy, and on drawn configs. The attention runs on SDPA's CPU flash kernel (not its math fallback).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.efficient.attention_sinks import attention_mask, shared_masks, sink_sdpa
from llm_anatomy.hf_config import read_hf_config
from llm_anatomy.models import build_model
from validations import test_efficient
from validations.configs import POLICIES
from validations.hf_configs import HF_CONFIGS


def reduced_cfg(name: str, tmp_path) -> ModelConfig:
    """The committed config two layers deep and narrow (test_moe.reduced: every attention and router field kept)."""
    from validations.test_moe import reduced

    (tmp_path / "config.json").write_text(json.dumps(reduced(json.loads(HF_CONFIGS[name].read_text()))))
    return read_hf_config(tmp_path).config


@pytest.mark.parametrize("name, policy", [(n, p) for n in ("gpt-oss-20b", "OLMoE-1B-7B-0924") for p in POLICIES])
def test_reduced_real_configs_match_baseline(name, policy, tmp_path):
    """Loss and every gradient within the stated tolerance on the reduced real configs (gpt-oss: sinks, a window of
    5 on layer 0, q/k/v/o biases, its experts; OLMoE: whole q/k norms, its experts)."""
    cfg = reduced_cfg(name, tmp_path)
    assert (cfg.attn_sinks, cfg.window, cfg.o_bias) == ((True, 5, True) if name == "gpt-oss-20b" else (False, None, False))
    assert cfg.qk_norm_whole == (name == "OLMoE-1B-7B-0924")
    worst = test_efficient.check_matches_baseline(cfg, Run(2, 16, policy), pooled=("attn.sinks",))
    wanted = ("attn.sinks", "attn.o.bias") if cfg.attn_sinks else ("attn.q_norm.weight", "attn.k_norm.weight")
    assert all(any(n.endswith(w) for n in worst) for w in wanted)


@st.composite
def attention_configs(draw) -> ModelConfig:
    """Dense configs with the attention fields drawn: sinks on or off, a window on all or the even layers or none,
    o bias, q/k norms per head or whole; GQA or not. A window of 2 or more: under a window of 1 each query sees only
    itself, q and k get no gradient in float64 (exactly 0), and the relative-error rule has no scale to judge the
    efficient model's rounding-level d(q) against."""
    heads = draw(st.sampled_from([4, 8]))
    window = draw(st.sampled_from([None, 2, 3, 6]))
    qk = draw(st.sampled_from(["none", "head", "whole"]))
    return ModelConfig(
        name="hypothesis-gptoss-attn", hidden=heads * 16, layers=draw(st.integers(1, 3)), heads=heads,
        kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])), intermediate=32,
        vocab=draw(st.integers(32, 200)), qkv_bias=draw(st.booleans()), o_bias=draw(st.booleans()),
        attn_sinks=draw(st.booleans()), window=window,
        window_pattern=draw(st.sampled_from(["all", "even"])) if window else "all",
        qk_norm=qk != "none", qk_norm_whole=qk == "whole")


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(cfg=attention_configs(), policy=st.sampled_from(POLICIES), seq=st.integers(8, 24))
def test_drawn_configs_match_baseline(cfg, policy, seq):
    """The stated tolerance on 20 drawn configs; the sinks' gradients (one per head) pooled over the layers."""
    test_efficient.check_matches_baseline(cfg, Run(2, seq, policy), pooled=("attn.sinks",))


def _reference(q, k, v, sinks, window):
    """The baseline's softmax with a sink column, in float64."""
    B, nh, S, hd = q.shape
    k, v = (t.repeat_interleave(nh // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + attention_mask(S, window, False, q.dtype, q.device)
    sink = sinks.view(1, nh, 1, 1).expand(B, nh, S, 1)
    return F.softmax(torch.cat((scores, sink), -1), -1)[..., :-1] @ v


@pytest.mark.parametrize("window", [None, 3])
def test_sink_key_equals_the_sink_softmax_and_its_gradients(window):
    """sink_sdpa's first hd columns equal the softmax with one more logit per head, and the gradients of q, k, v
    AND the sinks equal the reference's (float64: only rounding apart); its extra columns are exactly zero; it
    runs SDPA's CPU flash kernel."""
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, S, hd = 2, 4, 2, 12, 8
    q, k, v = (torch.randn(B, n, S, hd, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (nh, nkv, nkv))
    sinks = torch.randn(nh, generator=g, dtype=torch.float64, requires_grad=True)
    out = sink_sdpa(q, k, v, sinks, attention_mask(S, window, True, q.dtype, q.device), True)
    assert "FlashAttentionForCpu" in type(out.grad_fn).__name__
    assert torch.equal(out[..., hd:], torch.zeros_like(out[..., hd:]))
    ref = _reference(q, k, v, sinks, window)
    torch.testing.assert_close(out[..., :hd], ref)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad((out[..., :hd] * dy).sum(), (q, k, v, sinks))
    theirs = torch.autograd.grad((ref * dy).sum(), (q, k, v, sinks))
    for a, b in zip(mine, theirs):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)


def test_sink_gradient_no_less_accurate_than_the_baselines():
    """The sinks' gradient in bf16 has no error the baseline's bf16 softmax lacks: over 40 seeded draws of q, k,
    v, sinks and d(out) (8 heads), the median of error(sink_sdpa) / error(baseline), both against float64, is at
    most 1.25, and the same holds for d(q). One draw alone is one ratio over 8 numbers, as noisy as a coin flip
    (test_efficient.check_matches_baseline's note): the median over draws is the claim."""
    def baseline(q, k, v, s):
        nh, S = q.shape[1], q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1])) + attention_mask(S, None, False, q.dtype,
                                                                                           q.device)
        sink = s.float().view(1, nh, 1, 1).expand(q.shape[0], nh, S, 1)
        return F.softmax(torch.cat((scores.float(), sink), -1), -1)[..., :-1].to(q.dtype) @ v

    def mine(q, k, v, s):
        return sink_sdpa(q, k, v, s, attention_mask(q.shape[2], None, True, q.dtype, q.device), False)[..., :16]

    def grads(f, xs, dy, dt):
        q, k, v = (t.to(dt).detach().requires_grad_() for t in xs[:3])
        s = xs[3].to(torch.float64 if dt == torch.float64 else torch.float32).detach().requires_grad_()
        (f(q, k, v, s).double() * dy).sum().backward()
        return s.grad.double(), q.grad.double()

    ratios = []
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(2, 8, 16, 16, generator=g, dtype=torch.float64) for _ in range(3)]
        xs.append(torch.randn(8, generator=g, dtype=torch.float64) * 0.5)
        dy = torch.randn(2, 8, 16, 16, generator=g, dtype=torch.float64)
        ref = grads(baseline, xs, dy, torch.float64)
        b, e = grads(baseline, xs, dy, torch.bfloat16), grads(mine, xs, dy, torch.bfloat16)
        ratios.append([test_efficient._rel(e[i], ref[i]) / test_efficient._rel(b[i], ref[i]) for i in range(2)])
    medians = torch.tensor(ratios).median(0).values
    assert (medians <= 1.25).all(), medians


def test_layers_share_one_mask_and_run_flash(monkeypatch):
    """Every layer of one kind of mask hands SDPA the same storage (built once per forward), and every layer runs
    the CPU flash kernel: window layers and full layers with sinks alike."""
    import llm_anatomy.efficient.attention as attention

    cfg = ModelConfig(hidden=32, layers=4, heads=2, intermediate=32, vocab=64, attn_sinks=True, window=3,
                      window_pattern="even")
    model, masks = build_model(cfg, "efficient"), []

    def spy(q, k, v, sinks, mask, gqa):
        masks.append(mask.data_ptr())
        return sink_sdpa(q, k, v, sinks, mask, gqa)

    monkeypatch.setattr(attention, "sink_sdpa", spy)
    ids = torch.randint(0, 64, (1, 10))
    model(ids, ids)
    assert masks[0] == masks[2] and masks[1] == masks[3] and masks[0] != masks[1]
    assert all(layer.attn.last_backend == "cpu-flash" for layer in model.layers)
    with shared_masks():
        a = attention_mask(8, 3, True, torch.float32, "cpu")
        assert attention_mask(8, 3, True, torch.float32, "cpu") is a
    assert attention_mask(8, 3, True, torch.float32, "cpu") is not a  # outside a forward: nothing kept


@pytest.mark.parametrize("pattern", ["all", "even"])
def test_model_flops_equal_across_variants_with_a_window(pattern):
    """The model convention counts the attended pairs: the efficient estimate leaves out a window's as the
    baseline's does (both models compute the same attention)."""
    from llm_anatomy.calculator import estimate

    cfg = ModelConfig(hidden=64, layers=3, heads=8, kv_heads=2, head_dim=16, intermediate=32, vocab=128,
                      attn_sinks=True, window=5, window_pattern=pattern)
    base, eff = (estimate(cfg, Run(2, 32, "amp"), v, device="cpu").components["attention"]
                 for v in ("baseline", "efficient"))
    full = estimate(ModelConfig(**{**cfg.to_dict(), "window": None, "window_pattern": "all"}), Run(2, 32, "amp"),
                    "efficient", device="cpu").components["attention"]
    assert (eff.flops_model_fwd, eff.flops_model_bwd) == (base.flops_model_fwd, base.flops_model_bwd)
    assert eff.flops_model_fwd < full.flops_model_fwd
