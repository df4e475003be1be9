"""Parameters: the calculator's count equals model.parameters(), ours and Hugging Face's Llama."""
import pytest
from hypothesis import given

from llm_anatomy.calculator import COMPONENT_MODULES, param_count
from llm_anatomy.config import PRESETS
from llm_anatomy.measure.components import component_modules
from llm_anatomy.measure.run import measure_params
from llm_anatomy.models import build_model
from validations.configs import NAMED, configs

ALL = {**NAMED, **PRESETS}


@pytest.mark.parametrize("name", ALL)
def test_params_exact(name, claims):
    cfg = ALL[name]
    claims.check("params", component="model", config=name, variant="baseline",
                 predicted=param_count(cfg), measured=measure_params(cfg))


@pytest.mark.parametrize("name", NAMED)
def test_params_per_component(name, claims):
    cfg = NAMED[name]
    model = build_model(cfg, device="meta")
    seen, measured = set(), {}
    for fqn, comp in component_modules(model).items():
        for p in model.get_submodule(fqn).parameters():
            if id(p) not in seen:  # a tied head's matrix belongs to the embedding, counted once
                seen.add(id(p))
                measured[comp] = measured.get(comp, 0) + p.numel()
    for comp, mod in COMPONENT_MODULES.items():
        claims.check("params", component=comp, config=name, variant="baseline",
                     predicted=mod.params(cfg), measured=measured.get(comp, 0))


@given(cfg=configs())
def test_params_exact_hypothesis(cfg, claims):
    claims.check("params", component="model", config=str(cfg), variant="baseline",
                 predicted=param_count(cfg), measured=measure_params(cfg))


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-gptoss-tied", "tinyllama-1.1b", "llama3-8b", "llama3.2-1b"])
def test_params_match_huggingface_llama(name, claims):
    """An outside implementation: transformers' LlamaForCausalLM built on meta from the same shape."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = ALL[name]
    if cfg.mlp != "swiglu":
        pytest.skip("Hugging Face's Llama has no gpt-oss MLP (same parameter shapes, nothing more to learn)")
    hf = transformers.LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                  intermediate_size=cfg.intermediate, vocab_size=cfg.vocab,
                                  tie_word_embeddings=cfg.tie_embeddings)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    claims.check("params equal Hugging Face's", component="model", config=name, variant="hf-llama",
                 predicted=param_count(cfg), measured=sum(p.numel() for p in model.parameters()))
