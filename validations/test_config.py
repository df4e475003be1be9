"""Config validation, presets' published parameter counts, and Hugging Face config import."""
import json
import re

import pytest

from llm_anatomy.calculator import param_count
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.hf_config import from_hf_config, read_hf_config

# Published counts (the models' own safetensors totals), not derived from our formulas.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "tinyllama-1.1b": 1_100_048_384,
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
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
    ([1, 2], "not a JSON object"),
])
def test_from_hf_config_rejects(tmp_path, d, msg):
    with pytest.raises(ConfigError, match=msg):
        from_hf_config(_write(tmp_path, d))


def test_from_hf_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        from_hf_config(tmp_path / "nope.json")


# ---- real config.json files, as published on the Hugging Face hub (fields this reader does not use kept) -------
def _llama3(**kw):
    return dict(architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
                eos_token_id=[128001, 128008, 128009], hidden_act="silu", initializer_range=0.02,
                max_position_embeddings=131072, mlp_bias=False, model_type="llama", pretraining_tp=1,
                rms_norm_eps=1e-05, rope_theta=500000.0, torch_dtype="bfloat16", transformers_version="4.45.0.dev0",
                use_cache=True, vocab_size=128256, **kw)


def _llama3_rope(factor):
    return dict(factor=factor, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                rope_type="llama3")


def _qwen25(**kw):
    return dict(architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
                hidden_act="silu", initializer_range=0.02, model_type="qwen2", rms_norm_eps=1e-06,
                rope_theta=1000000.0, torch_dtype="bfloat16", use_cache=True, use_mrope=False,
                use_sliding_window=False, **kw)


QWEN25_7B = _qwen25(hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072, max_window_layers=28,
                    num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4, sliding_window=131072,
                    tie_word_embeddings=False, transformers_version="4.43.1", vocab_size=152064)

REAL = {
    # meta-llama/Llama-3.1-8B
    "Llama-3.1-8B": (_llama3(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
                            num_key_value_heads=8, rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False),
                     8_030_261_248),
    # meta-llama/Llama-3.2-1B
    "Llama-3.2-1B": (_llama3(hidden_size=2048, head_dim=64, intermediate_size=8192, num_attention_heads=32,
                            num_hidden_layers=16, num_key_value_heads=8, rope_scaling=_llama3_rope(32.0),
                            tie_word_embeddings=True), 1_235_814_400),
    # meta-llama/Llama-3.2-3B
    "Llama-3.2-3B": (_llama3(hidden_size=3072, head_dim=128, intermediate_size=8192, num_attention_heads=24,
                            num_hidden_layers=28, num_key_value_heads=8, rope_scaling=_llama3_rope(32.0),
                            tie_word_embeddings=True), 3_212_749_824),
    # mistralai/Mistral-7B-v0.1: a 4,096-token sliding window
    "Mistral-7B-v0.1": (dict(architectures=["MistralForCausalLM"], bos_token_id=1, eos_token_id=2, hidden_act="silu",
                             hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
                             max_position_embeddings=32768, model_type="mistral", num_attention_heads=32,
                             num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=10000.0,
                             sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16",
                             transformers_version="4.34.0.dev0", use_cache=True, vocab_size=32000), 7_241_732_096),
    # Qwen/Qwen2.5-0.5B: q/k/v biases, tied; a sliding window written down but off (use_sliding_window false)
    "Qwen2.5-0.5B": (_qwen25(hidden_size=896, intermediate_size=4864, max_position_embeddings=32768,
                             max_window_layers=24, num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2,
                             sliding_window=32768, tie_word_embeddings=True, transformers_version="4.40.1",
                             vocab_size=151936), 494_032_768),
    # Qwen/Qwen2.5-1.5B
    "Qwen2.5-1.5B": (_qwen25(hidden_size=1536, intermediate_size=8960, max_position_embeddings=131072,
                             max_window_layers=21, num_attention_heads=12, num_hidden_layers=28, num_key_value_heads=2,
                             sliding_window=131072, tie_word_embeddings=True, transformers_version="4.40.1",
                             vocab_size=151936), 1_543_714_304),
    # Qwen/Qwen2.5-7B
    "Qwen2.5-7B": (QWEN25_7B, 7_615_616_512),
}


@pytest.mark.parametrize("name", REAL)
def test_real_hf_config_reads_and_counts(tmp_path, name):
    d, published = REAL[name]
    hf = read_hf_config(_write(tmp_path, d))
    assert param_count(hf.config) == published  # the published count (the models' safetensors totals)
    if "rope_scaling" in d:  # llama3 scaling is read, and said to change no count
        assert len(hf.notes) == 1 and "RoPE scaling llama3" in hf.notes[0] and "no count" in hf.notes[0]
    # Qwen2 applies its window only under use_sliding_window, which every Qwen2.5 config leaves off
    assert hf.sliding_window == (None if d["model_type"] == "qwen2" else d.get("sliding_window"))
    assert hf.config.qkv_bias == (d["model_type"] == "qwen2")


@pytest.mark.parametrize("name, preset", [("Llama-3.2-1B", "llama3.2-1b"), ("Qwen2.5-0.5B", "qwen2.5-0.5b"),
                                          ("Qwen2.5-1.5B", "qwen2.5-1.5b"), ("Qwen2.5-7B", "qwen2.5-7b")])
def test_real_config_equals_its_preset(tmp_path, name, preset):
    d, _ = REAL[name]
    assert from_hf_config(_write(tmp_path, d)) == ModelConfig.from_name(preset)


@pytest.mark.parametrize("kw, window", [
    (dict(), None),  # use_sliding_window false: no layer slides, whatever sliding_window says
    (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=28), None),  # layers 28 and up: none here
    (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=20), 4096),
    (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=0), 4096),
    (dict(use_sliding_window=True, sliding_window=4096, layer_types=["full_attention"] * 28), None),
    (dict(use_sliding_window=True, sliding_window=4096, layer_types=["sliding_attention"] * 28), 4096),
    (dict(use_sliding_window=True, sliding_window=None), None),
])
def test_qwen2_sliding_window_as_qwen2config_reads_it(tmp_path, kw, window):
    assert read_hf_config(_write(tmp_path, {**QWEN25_7B, **kw})).sliding_window == window


@pytest.mark.parametrize("d, msg", [
    ({**HF_LLAMA3, "attention_bias": True}, "attention_bias=true is not modelled (it biases q, k, v and o"),
    ({**HF_LLAMA3, "mlp_bias": True}, "mlp_bias=true is not modelled"),
    ({**QWEN25_7B, "mlp_bias": True}, "mlp_bias=true is not modelled"),
    ({**QWEN25_7B, "use_sliding_window": "false"}, "use_sliding_window must be true or false"),
    ({**QWEN25_7B, "use_sliding_window": True, "max_window_layers": -1}, "max_window_layers must be a non-negative"),
    ({**QWEN25_7B, "use_sliding_window": True, "layer_types": "full"}, "layer_types must be a list of strings"),
])
def test_bias_and_window_fields_refused_in_one_line(tmp_path, d, msg):
    with pytest.raises(ConfigError) as e:
        from_hf_config(_write(tmp_path, d))
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "default"}, {"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, {"rope_type": "longrope", "factor": 2.0},
])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_every_rope_kind_is_accepted(tmp_path, key, scaling):
    hf = read_hf_config(_write(tmp_path, {**HF_LLAMA3, key: scaling}))
    assert hf.config == ModelConfig.from_name("llama3-8b")
    kind = scaling.get("rope_type") or scaling.get("type")
    assert len(hf.notes) == (kind != "default")


def test_rope_theta_in_rope_parameters_wins(tmp_path):
    d = {**HF_LLAMA3, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}}
    assert read_hf_config(_write(tmp_path, d)).config.rope_theta == 1e6


@pytest.mark.parametrize("d, msg", [
    ({**HF_LLAMA3, "num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({**HF_LLAMA3, "hidden_size": "4096"}, 'hidden_size must be a positive integer, got "4096"'),
    ({**HF_LLAMA3, "vocab_size": None}, "vocab_size must be given, got null"),
    ({**HF_LLAMA3, "intermediate_size": [14336]}, "intermediate_size must be a positive integer, got a list"),
    ({**HF_LLAMA3, "num_hidden_layers": 10**30}, "num_hidden_layers=1e+30 is larger than any machine could hold"),
    ({**HF_LLAMA3, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({**HF_LLAMA3, "tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
    ({**HF_LLAMA3, "rms_norm_eps": -1}, "rms_norm_eps must be a finite number > 0"),
    ({**HF_LLAMA3, "rope_theta": "big"}, "rope_theta must be a finite number > 0"),
    ({**HF_LLAMA3, "hidden_act": "gelu"}, 'hidden_act "gelu" is not modelled'),
    ({**HF_LLAMA3, "rope_scaling": {"rope_type": "warp"}}, "rope_scaling.rope_type must be one of"),
    ({**HF_LLAMA3, "rope_scaling": "llama3"}, "rope_scaling must be a JSON object"),
    ({**HF_LLAMA3, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({**HF_LLAMA3, "_name_or_path": 7}, "_name_or_path must be a string"),
    ({**HF_LLAMA3, "hidden_size": 4096 * 2**20}, "hidden_size=4.29e+09 is larger than any machine could hold"),
])
def test_hf_field_errors_name_the_file_and_field(tmp_path, d, msg):
    with pytest.raises(ConfigError) as e:
        from_hf_config(_write(tmp_path, d))
    assert msg in str(e.value) and str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, msg", [
    (b'{"model_type": "llama", "rope_theta": Infinity}', "Infinity is not a number"),
    (b'{"model_type": "llama", "rope_theta": NaN}', "NaN is not a number"),
    (b'{"model_type": "llama", "rope_theta": 1e400}', "out of a float's range"),
    (b'{"model_type": "ll\xe9ama"}', "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"{", "not valid JSON"),
])
def test_unreadable_hf_config_is_one_line(tmp_path, text, msg):
    p = tmp_path / "config.json"
    p.write_bytes(text)
    with pytest.raises(ConfigError, match=msg) as e:
        from_hf_config(p)
    assert "\n" not in str(e.value)


def test_name_is_safe_to_print_and_to_use_in_a_path(tmp_path):
    d = {**HF_LLAMA3, "_name_or_path": "/home/u/\x1b[31mred[/bold]\u202e../../x\n"}
    name = from_hf_config(_write(tmp_path, d)).name
    assert name == "x" and from_hf_config(_write(tmp_path, {**HF_LLAMA3, "_name_or_path": "../.."})).name == tmp_path.name
    d["_name_or_path"] = "meta-llama/Llama-3.1-8B [bold]\x07"
    assert from_hf_config(_write(tmp_path, d)).name == "Llama-3.1-8B__bold__"


@pytest.mark.parametrize("kw, msg", [
    (dict(layers=10**30), "layers=1e+30 is larger than any machine could hold"),
    (dict(hidden=2**23, heads=2**10, intermediate=2**24, layers=4096), "parameters is more than any machine"),
    (dict(rope_theta=float("inf")), "rope_theta must be a finite number"),
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number"),
    (dict(norm_eps="1e-5"), "norm_eps must be a finite number"),
    (dict(tie_embeddings="false"), "tie_embeddings must be true or false"),
    (dict(qkv_bias=1), "qkv_bias must be true or false"),
    (dict(heads=2.0), "heads must be a positive integer"),
])
def test_out_of_range_model_config(kw, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        ModelConfig(**{**dict(hidden=64, layers=2, heads=4, intermediate=96, vocab=128), **kw})


@pytest.mark.parametrize("kw, msg", [(dict(batch=10**23), "batch=1e+23 is larger"),
                                     (dict(batch=2**24, seq=2**24), "tokens per step"),
                                     (dict(batch=True), "batch must be a positive integer"),
                                     (dict(loss_impl="torch"), "loss_impl must be one of anatomy, liger")])
def test_out_of_range_run(kw, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Run(**kw)


def test_run_loss_impl_round_trips_and_old_records_read_as_liger():
    """Our loss is the default and stays out of to_dict (plain reports keep their keys); Liger's is written,
    and a committed row without the key, made before ours was the default, is read as Liger's."""
    assert Run(2, 8).to_dict() == dict(batch=2, seq=8, dtype="amp")
    liger = Run(2, 8, loss_impl="liger")
    assert Run(**liger.to_dict()) == liger
    assert Run.from_record(dict(batch=2, seq=8)).loss_impl == "liger"
    assert Run.from_record(dict(batch=2, seq=8, recompute="mlp", loss_impl="anatomy")) == Run(2, 8, "amp", "mlp")
