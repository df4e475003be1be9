"""FLOPs: the calculator's counter-convention figures equal FlopCounterMode's, per component and in total."""
import pytest
from hypothesis import given

from llm_anatomy.calculator import estimate
from llm_anatomy.config import PRESETS, Run
from llm_anatomy.measure.run import measure_flops
from validations.configs import NAMED, RUNS, configs, runs


def _check(claims, cfg, run, name, device="meta"):
    est = estimate(cfg, run)
    meas = measure_flops(cfg, run, device=device)
    for d, claim, attr in (("forward", "flops.counter.forward", "flops_counter_fwd"),
                           ("backward", "flops.counter.backward", "flops_counter_bwd")):
        m = meas[d]
        assert sum(v for k, v in m.items() if k != "total") == m["total"], "attribution must add up to torch's total"
        claims.check(claim, component="model", config=name, variant="baseline",
                     predicted=est.total(attr), measured=m["total"], device=device, unit="FLOP")
        for comp, c in est.components.items():
            claims.check(claim, component=comp, config=name, variant="baseline",
                         predicted=getattr(c, attr), measured=m.get(comp, 0), device=device, unit="FLOP")


@pytest.mark.parametrize("run_id", RUNS)
@pytest.mark.parametrize("name", NAMED)
def test_flops_exact_named(name, run_id, claims):
    _check(claims, NAMED[name], RUNS[run_id], f"{name}/{run_id}")


@pytest.mark.parametrize("name, run", [("seed", Run(16, 4096)), ("tinyllama-1.1b", Run(1, 2048)),
                                       ("llama3-8b", Run(1, 8192))], ids=["seed-B16S4096", "tinyllama-B1S2048",
                                                                          "llama3-8b-B1S8192"])
def test_flops_exact_full_size_on_meta(name, run, claims):
    """Full-size presets, counted on meta tensors (no memory, no compute)."""
    _check(claims, PRESETS[name], run, name)


def test_flops_same_on_real_cpu_tensors(claims):
    _check(claims, NAMED["tiny-gqa"], Run(2, 16), "tiny-gqa/B2S16", device="cpu")


@given(cfg=configs(), run=runs())
def test_flops_exact_hypothesis(cfg, run, claims):
    _check(claims, cfg, run, f"{cfg}/{run}")


def test_flops_match_huggingface_eager_llama():
    """An outside implementation: HF's eager Llama does the same matmuls, so the forward count is equal."""
    transformers = pytest.importorskip("transformers")
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cfg, run = NAMED["tiny-gqa"], Run(2, 16)
    hf = transformers.LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                  intermediate_size=cfg.intermediate, vocab_size=cfg.vocab,
                                  attn_implementation="eager")
    model = transformers.LlamaForCausalLM(hf)
    ids = torch.randint(0, cfg.vocab, (run.batch, run.seq))
    with FlopCounterMode(display=False) as mode:
        model(input_ids=ids).logits.sum().backward()
    est = estimate(cfg, run)
    assert mode.get_total_flops() == est.total("flops_counter_fwd") + est.total("flops_counter_bwd")


def test_model_flops_halve_causal_attention():
    cfg, run = PRESETS["seed"], Run(16, 4096)
    a = estimate(cfg, run).components["attention"]
    L, B, S, nh, hd = cfg.layers, run.batch, run.seq, cfg.heads, cfg.head_dim
    scores_and_av = L * 4 * B * nh * S * S * hd
    assert a.flops_counter_fwd - a.flops_model_fwd == scores_and_av // 2
    assert a.flops_model_bwd == 2 * a.flops_model_fwd


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
def test_flops_exact_on_cuda(policy, claims):
    """The instrument on real CUDA kernels (the baseline uses no SDPA, so the count is device-independent)."""
    _check(claims, NAMED["tiny-gqa"], Run(2, 128, policy), f"tiny-gqa/B2S128/{policy}", device="cuda")
