"""Real Hugging Face config.json files, committed as test data, and each model's traits.

The files live in validations/data/hf_configs/<name>/config.json; SOURCES.md beside them says where each one's
content comes from (verbatim, or reconstructed from named sources). `MODELS` describes each model for scripts that
iterate over real architectures (the GPU plan validation); `HF_CONFIGS` maps a name to its file.
validations/test_hf_configs.py checks every trait below against the file, our reader and transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data" / "hf_configs"


@dataclass(frozen=True)
class HFModel:
    name: str  # folder under data/hf_configs, and the last part of the hub repository
    repo: str  # the hub repository the config.json is published in
    model_type: str  # "llama", "mistral", "qwen2", "qwen3"; "qwen3_moe", "mixtral", "gpt_oss", "olmoe"
    params: int  # transformers' count on the meta device (sum of numel, a tied matrix once)
    hidden: int
    layers: int
    vocab: int
    tied: bool  # tie_word_embeddings
    qkv_bias: bool  # q, k and v projections carry a bias (every Qwen2 model does; no config field says so)
    sliding_window: int | None  # the window attention uses; None when it sees the whole sequence
    verbatim: bool  # the file's fields are the published ones (SOURCES.md); False: reconstructed

    @property
    def path(self) -> Path:
        return DATA / self.name / "config.json"

    @property
    def vocab_multiple_of_8(self) -> bool:
        return self.vocab % 8 == 0


def _m(name, repo, model_type, params, hidden, layers, vocab, tied, qkv_bias=False, sliding_window=None,
       verbatim=True) -> HFModel:
    return HFModel(name, repo, model_type, params, hidden, layers, vocab, tied, qkv_bias, sliding_window, verbatim)


MODELS: dict[str, HFModel] = {
    m.name: m
    for m in (
        _m("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "llama", 8_030_261_248, 4096, 32, 128256, False),
        _m("Llama-3.1-70B", "meta-llama/Llama-3.1-70B", "llama", 70_553_706_496, 8192, 80, 128256, False,
           verbatim=False),
        _m("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", "llama", 1_235_814_400, 2048, 16, 128256, True,
           verbatim=False),
        _m("Llama-3.2-3B", "meta-llama/Llama-3.2-3B", "llama", 3_212_749_824, 3072, 28, 128256, True),
        _m("Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf", "llama", 6_738_415_616, 4096, 32, 32000, False),
        # Qwen2's sliding_window field is set, but use_sliding_window is false: attention sees everything
        _m("Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", "qwen2", 494_032_768, 896, 24, 151936, True, qkv_bias=True),
        _m("Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B", "qwen2", 1_543_714_304, 1536, 28, 151936, True, qkv_bias=True,
           verbatim=False),
        _m("Qwen2.5-3B", "Qwen/Qwen2.5-3B", "qwen2", 3_085_938_688, 2048, 36, 151936, True, qkv_bias=True),
        _m("Qwen2.5-7B", "Qwen/Qwen2.5-7B", "qwen2", 7_615_616_512, 3584, 28, 152064, False, qkv_bias=True),
        _m("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1", "mistral", 7_241_732_096, 4096, 32, 32000, False,
           sliding_window=4096),
        _m("TinyLlama-1.1B-intermediate-step-1431k-3T", "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
           "llama", 1_100_048_384, 2048, 22, 32000, False, verbatim=False),
        _m("SmolLM2-1.7B", "HuggingFaceTB/SmolLM2-1.7B", "llama", 1_711_376_384, 2048, 24, 49152, True,
           verbatim=False),
        _m("SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M", "llama", 361_821_120, 960, 32, 49152, True,
           verbatim=False),
        # linear RoPE scaling under the older key "type"; 2,048 wide with 16 heads of 128
        _m("deepseek-coder-1.3b-base", "deepseek-ai/deepseek-coder-1.3b-base", "llama", 1_346_471_936, 2048, 24,
           32256, False, verbatim=False),
        # Qwen3: heads x head_dim (128) need not be hidden (0.6B: 16 x 128 over 1024); q_norm and k_norm per head
        _m("Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", 596_049_920, 1024, 28, 151936, True),
        _m("Qwen3-1.7B", "Qwen/Qwen3-1.7B", "qwen3", 1_720_574_976, 2048, 28, 151936, True, verbatim=False),
        _m("Qwen3-4B", "Qwen/Qwen3-4B", "qwen3", 4_022_468_096, 2560, 36, 151936, True),
        _m("Qwen3-8B", "Qwen/Qwen3-8B", "qwen3", 8_190_735_360, 4096, 36, 151936, False),
        # mixtures of experts (validations/test_moe.py): Qwen3-MoE (128 experts, top 8), Mixtral (8, top 2),
        # gpt-oss (32, top 4; q, k, v, o biased, sinks, a 128-token window on the even layers: not a --seq bound),
        # OLMoE (64, top 8; q_norm and k_norm over the whole projections)
        _m("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "qwen3_moe", 30_532_122_624, 2048, 48, 151936, False,
           verbatim=False),
        _m("Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-v0.1", "mixtral", 46_702_792_704, 4096, 32, 32000, False,
           verbatim=False),
        _m("gpt-oss-20b", "openai/gpt-oss-20b", "gpt_oss", 20_914_757_184, 2880, 24, 201088, False, qkv_bias=True,
           verbatim=False),
        _m("OLMoE-1B-7B-0924", "allenai/OLMoE-1B-7B-0924", "olmoe", 6_919_161_856, 2048, 16, 50304, False,
           verbatim=False),
    )
}

HF_CONFIGS: dict[str, Path] = {name: m.path for name, m in MODELS.items()}
