"""ModelConfig (architecture) and Run (batch, sequence, dtype policy), with named presets.

Pure Python: the calculator imports this, and the calculator must not import torch.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MLP_VARIANTS = ("swiglu", "gpt-oss")
# dtype policies:
#   amp  : fp32 master weights, bf16 autocast for matmuls (the default; what most training runs use)
#   bf16 : parameters and activations in bf16, no autocast
#   fp32 : everything fp32 (numerical references and CPU checks)
DTYPE_POLICIES = ("amp", "bf16", "fp32")
# activation recompute (efficient variant only):
#   none : keep every saved tensor (the fastest step)
#   mlp  : keep only the MLP block's input; its norm, gate_up matmul and activation run again in backward
RECOMPUTE = ("none", "mlp")


class ConfigError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits with code 2."""


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    kv_heads: int | None = None  # GQA; None means kv_heads == heads (plain multi-head attention)
    tie_embeddings: bool = False
    mlp: str = "swiglu"  # "gpt-oss": (clamp(up) + 1) * silu(clamp(gate)), clamps at 7.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden", "layers", "heads", "intermediate", "vocab"):
            _positive_int(f, getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _positive_int("kv_heads", self.kv_heads)
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (hidden/heads) must be even for RoPE")
        if self.mlp not in MLP_VARIANTS:
            raise ConfigError(f"mlp must be one of {', '.join(MLP_VARIANTS)}, got {self.mlp!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:  # width of the k (and of the v) projection
        return self.kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class Run:
    batch: int = 16
    seq: int = 4096
    dtype: str = "amp"
    recompute: str = "none"

    def __post_init__(self):
        _positive_int("batch", self.batch)
        _positive_int("seq", self.seq)
        if self.dtype not in DTYPE_POLICIES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_POLICIES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    def to_dict(self) -> dict:
        """batch, seq, dtype, and recompute when it is on (so reports of plain runs keep their keys)."""
        d = dict(batch=self.batch, seq=self.seq, dtype=self.dtype)
        return d if self.recompute == "none" else dict(d, recompute=self.recompute)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _p(name, **kw) -> ModelConfig:
    return ModelConfig(name=name, **kw)


# Published shapes are copied from each model's config.json on the Hugging Face hub; the
# published parameter counts they must reproduce are asserted in validations/test_config.py.
PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        # the seed project's config: small hidden, big vocab relative to it (the loss dominates memory)
        _p("seed", hidden=512, layers=6, heads=8, intermediate=1024, vocab=16000),
        # ANCHORS.md's larger config (953 M parameters)
        _p("anchor-1b", hidden=2048, layers=16, heads=16, intermediate=5632, vocab=32000),
        _p("tinyllama-1.1b", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000),
        _p("llama2-7b", hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
        _p("llama2-13b", hidden=5120, layers=40, heads=40, intermediate=13824, vocab=32000),
        _p("mistral-7b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=32000,
           rope_theta=1e6),
        _p("llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
           rope_theta=5e5),
        _p("llama3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
           tie_embeddings=True, rope_theta=5e5),
    )
}

_HF_FAMILIES = ("llama", "mistral")


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face Llama-family config.json (a file, or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no Hugging Face config at {str(path)!r}")
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p} is not a JSON object")
    family = d.get("model_type")
    if family not in _HF_FAMILIES:
        raise ConfigError(f"{p}: model_type {family!r} is not a Llama-family model ({', '.join(_HF_FAMILIES)})")
    for bias in ("attention_bias", "mlp_bias"):
        if d.get(bias):
            raise ConfigError(f"{p}: {bias}=true is not supported (the models here have no biases)")
    try:
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        head_dim = d.get("head_dim") or hidden // heads
        if head_dim * heads != hidden:
            raise ConfigError(f"{p}: head_dim={head_dim} × heads={heads} != hidden_size={hidden}")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        if not scaling and rope.get("rope_type") not in (None, "default"):
            scaling = rope
        if scaling:
            raise ConfigError(f"{p}: RoPE scaling {scaling!r} is not modelled")
        return ModelConfig(
            name=d.get("_name_or_path") or p.parent.name or "hf",
            hidden=hidden,
            layers=d["num_hidden_layers"],
            heads=heads,
            kv_heads=d.get("num_key_value_heads") or heads,
            intermediate=d["intermediate_size"],
            vocab=d["vocab_size"],
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta") or d.get("rope_theta", 10000.0)),
        )
    except KeyError as e:
        raise ConfigError(f"{p}: missing field {e.args[0]!r}") from None


def config_fields() -> list[str]:
    return [f.name for f in fields(ModelConfig) if f.name != "name"]
