"""Real Hugging Face config.json files (validations/data/hf_configs, sources in SOURCES.md there): each one reads,
and our calculator's parameter count equals transformers' for the same file."""
import json
import re

import pytest

from llm_anatomy.calculator import estimate
from llm_anatomy.config import Run
from llm_anatomy.hf_config import read_hf_config
from validations.hf_configs import DATA, HF_CONFIGS, MODELS

NAMES = list(MODELS)


def _json(name: str) -> dict:
    return json.loads(HF_CONFIGS[name].read_text())


def _read(name: str):
    return read_hf_config(HF_CONFIGS[name])


def test_index_covers_every_committed_file():
    on_disk = {p.parent.name for p in DATA.glob("*/config.json")}
    assert on_disk == set(MODELS)
    # the traits the plan validation asks for are all present among the files
    traits = MODELS.values()
    assert any(m.qkv_bias for m in traits) and any(m.tied for m in traits)
    assert any(m.vocab >= 128_000 for m in traits) and any(m.params >= 7e9 for m in traits)
    assert any(m.sliding_window for m in traits)


def test_sources_name_every_file_and_its_kind():
    """SOURCES.md has one entry per file, and says verbatim exactly where the index does."""
    entry = re.compile(r"^- \*\*(.+?)\*\*.*?: (verbatim|reconstructed)", re.MULTILINE)
    kinds = dict(entry.findall((DATA / "SOURCES.md").read_text()))
    assert kinds == {name: "verbatim" if m.verbatim else "reconstructed" for name, m in MODELS.items()}


@pytest.mark.parametrize("name", NAMES)
def test_traits_match_the_file(name):
    """The index's descriptor says what the file says (so the two cannot drift apart)."""
    m, d = MODELS[name], _json(name)
    assert d["model_type"] == m.model_type
    assert (d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]) == (m.hidden, m.layers, m.vocab)
    assert d.get("tie_word_embeddings", False) == m.tied
    assert m.repo.endswith("/" + name)
    if m.model_type != "qwen2":
        assert d.get("attention_bias", False) == m.qkv_bias
    # gpt-oss's window is part of its ModelConfig (window, window_pattern: test_moe.py), not a bound on the sequence
    window = d.get("sliding_window") if d.get("use_sliding_window", True) and m.model_type != "gpt_oss" else None
    assert window == m.sliding_window


@pytest.mark.parametrize("name", NAMES)
def test_config_reads(name):
    m, d = MODELS[name], _json(name)
    hf = _read(name)
    cfg = hf.config
    assert (cfg.hidden, cfg.layers, cfg.vocab, cfg.tie_embeddings) == (m.hidden, m.layers, m.vocab, m.tied)
    assert (cfg.heads, cfg.kv_heads) == (d["num_attention_heads"], d.get("num_key_value_heads") or cfg.heads)
    assert cfg.intermediate == d["intermediate_size"]
    assert hf.sliding_window == m.sliding_window
    scaling = d.get("rope_scaling") or {}
    scaled = (scaling.get("rope_type") or scaling.get("type") or "default") != "default"
    assert any("RoPE scaling" in n for n in hf.notes) == scaled  # a scaling kind is read and said once


@pytest.mark.parametrize("name", NAMES)
def test_calculator_params_equal_the_index(name):
    """Our calculator, from the file alone, against the count recorded in the index (transformers')."""
    params = estimate(_read(name).config, Run(batch=1, seq=128)).params
    assert params == MODELS[name].params


@pytest.fixture(scope="module")
def hf_params():
    """transformers' parameter count of each file: AutoModelForCausalLM built on the meta device."""
    transformers = pytest.importorskip("transformers")
    import torch

    def count(name: str) -> int:
        d = _json(name)
        cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        return sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once

    return count


@pytest.mark.parametrize("name", NAMES)
def test_index_params_equal_transformers(name, hf_params):
    assert hf_params(name) == MODELS[name].params


@pytest.mark.parametrize("name", NAMES)
def test_params_equal_transformers(name, hf_params, claims):
    cfg = _read(name).config
    claims.check("params equal Hugging Face's", component="model", config=name, variant="hf-config",
                 predicted=estimate(cfg, Run(batch=1, seq=128)).params, measured=hf_params(name))
