"""Config validation, presets' published parameter counts, and Hugging Face config import."""
import json

import pytest

from anatomy.calculator import param_count
from anatomy.config import ConfigError, ModelConfig, Run, from_hf_config

# Published counts (the models' own safetensors totals), not derived from our formulas.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "tinyllama-1.1b": 1_100_048_384,
    "llama3.2-1b": 1_235_814_400,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_matches_published_count(name, claims):
    claims.check("params equal the published count", component="model", config=name, variant="any",
                 predicted=PUBLISHED[name], measured=param_count(ModelConfig.from_name(name)))


@pytest.mark.parametrize("kw, field", [
    (dict(hidden=500, heads=8), "hidden=500"),
    (dict(heads=8, kv_heads=3), "kv_heads=3"),
    (dict(layers=0), "layers"),
    (dict(mlp="geglu"), "mlp"),
    (dict(vocab=-1), "vocab"),
    (dict(hidden=24, heads=8), "head_dim"),
    (dict(norm_eps=0.0), "norm_eps"),
])
def test_bad_config_names_the_field(kw, field):
    base = dict(hidden=64, layers=2, heads=4, intermediate=96, vocab=128)
    with pytest.raises(ConfigError, match=field) as e:
        ModelConfig(**{**base, **kw})
    assert "\n" not in str(e.value)


def test_bad_run():
    with pytest.raises(ConfigError, match="dtype"):
        Run(dtype="fp16")
    with pytest.raises(ConfigError, match="seq"):
        Run(seq=0)


def _write(tmp_path, d):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return p


HF_LLAMA3 = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False)


def test_from_hf_config_reads_llama3(tmp_path):
    cfg = from_hf_config(_write(tmp_path, HF_LLAMA3))
    assert cfg == ModelConfig.from_name("llama3-8b")  # name is not compared
    assert from_hf_config(tmp_path) == cfg  # a folder holding config.json


def test_from_hf_config_reads_transformers5_rope_parameters(tmp_path):
    d = {k: v for k, v in HF_LLAMA3.items() if k != "rope_theta"}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert from_hf_config(_write(tmp_path, d)).rope_theta == 500000.0


@pytest.mark.parametrize("d, msg", [
    ({**HF_LLAMA3, "model_type": "gpt2"}, "not a Llama-family"),
    ({k: v for k, v in HF_LLAMA3.items() if k != "vocab_size"}, "vocab_size"),
    ({**HF_LLAMA3, "attention_bias": True}, "attention_bias"),
    ({**HF_LLAMA3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
    ([1, 2], "not a JSON object"),
])
def test_from_hf_config_rejects(tmp_path, d, msg):
    with pytest.raises(ConfigError, match=msg):
        from_hf_config(_write(tmp_path, d))


def test_from_hf_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        from_hf_config(tmp_path / "nope.json")
