"""ModelConfig (architecture) and Run (batch, sequence, dtype policy), with named presets, and the
reading of a Hugging Face config.json into a ModelConfig.

Pure Python: the calculator imports this, and the calculator must not import torch.
Every value is checked by type and range here, so the calculator only ever sees sizes it can count.
"""
from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

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

# Sizes no machine could hold are refused before anything is computed from them.
MAX_WIDTH = 2**24  # hidden, intermediate, vocab: one hidden x hidden matrix at 2**24 is 2.8e14 parameters
MAX_LAYERS = 1 << 20  # far deeper than any model; an estimate computes identical layers once, so its cost does not grow
MAX_PARAMS = 10**15  # 2 PB of bf16 weights, 16 PB of AdamW training state: more than any cluster holds
MAX_BATCH = MAX_SEQ = 2**24
MAX_TOKENS = 2**36  # batch x seq: the int64 input ids alone would be 512 GiB


class ConfigError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits with code 2."""


def oneline(text: str, limit: int = 300) -> str:
    """`text` safe to print on one line: control and format characters (newlines, escapes, bidi
    overrides) shown as escapes, and cut to `limit` characters."""
    out = "".join(c if unicodedata.category(c)[0] != "C" else c.encode("unicode_escape").decode("ascii")
                  for c in str(text))
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _positive_int(name: str, value, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {oneline(repr(value), 60)}")
    if limit is not None and value > limit:
        raise ConfigError(f"{name}={value:.3g} is larger than any machine could hold (at most {limit:,})")


def _positive_float(name: str, value, below: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < below):
        bound = "" if below == math.inf else f" and < {below:g}"
        raise ConfigError(f"{name} must be a finite number > 0{bound}, got {oneline(repr(value), 60)}")


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
    qkv_bias: bool = False  # a bias on the q, k and v projections (Qwen2); o and the MLP stay bias-free
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden", "intermediate", "vocab"):
            _positive_int(f, getattr(self, f), MAX_WIDTH)
        _positive_int("layers", self.layers, MAX_LAYERS)
        _positive_int("heads", self.heads)  # at most hidden, and kv_heads at most heads: by divisibility below
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
            raise ConfigError(f"mlp must be one of {', '.join(MLP_VARIANTS)}, got {oneline(repr(self.mlp), 60)}")
        for f in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f} must be true or false, got {oneline(repr(getattr(self, f)), 60)}")
        _positive_float("norm_eps", self.norm_eps, below=1.0)
        _positive_float("rope_theta", self.rope_theta)
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {oneline(repr(self.name), 60)}")
        if self.rough_params > MAX_PARAMS:
            raise ConfigError(f"{self.rough_params:.3g} parameters is more than any machine could hold "
                              f"(at most {MAX_PARAMS:.0e})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:  # width of the k (and of the v) projection
        return self.kv_heads * self.head_dim

    @property
    def rough_params(self) -> int:
        """The matmul weights and embeddings (norms left out): enough to bound a size, not a count to report
        (anatomy.calculator.param_count is that)."""
        block = 2 * self.hidden * (self.hidden + self.kv_dim) + 3 * self.hidden * self.intermediate
        block += (self.hidden + 2 * self.kv_dim) if self.qkv_bias else 0
        return self.layers * block + self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def to_dict(self) -> dict:
        """Every field; qkv_bias only when it is on (so reports of bias-free models keep their keys)."""
        d = asdict(self)
        if not self.qkv_bias:
            del d["qkv_bias"]
        return d

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown preset {oneline(repr(name), 60)}; choose from {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class Run:
    batch: int = 16
    seq: int = 4096
    dtype: str = "amp"
    recompute: str = "none"

    def __post_init__(self):
        _positive_int("batch", self.batch, MAX_BATCH)
        _positive_int("seq", self.seq, MAX_SEQ)
        if self.batch * self.seq > MAX_TOKENS:
            raise ConfigError(f"batch x seq = {self.batch * self.seq:.3g} tokens per step is more than any machine "
                              f"could hold (at most {MAX_TOKENS:,})")
        if self.dtype not in DTYPE_POLICIES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_POLICIES)}, got {oneline(repr(self.dtype), 60)}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got "
                              f"{oneline(repr(self.recompute), 60)}")

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
        # Qwen2.5: q/k/v biases, rms_norm_eps 1e-6; the small ones tie their embeddings
        _p("qwen2.5-0.5b", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
           tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
        _p("qwen2.5-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
           tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
        _p("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
           norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
    )
}

# ---- Hugging Face config.json ---------------------------------------------------------------------
_HF_FAMILIES = ("llama", "mistral", "qwen2")  # qwen2: Qwen2 and Qwen2.5, with q/k/v biases
# Every RoPE kind transformers knows (transformers.modeling_rope_utils; "su" and "mrope" are older names).
# Each changes only the rotation frequencies: no parameter, FLOP or byte counted here.
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "su", "mrope")
SILU = ("silu", "swish")  # transformers' ACT2FN maps both to nn.SiLU
MAX_CONFIG_BYTES = 1 << 20  # a real config.json is a few kB


class HFConfig(NamedTuple):
    config: ModelConfig
    notes: tuple[str, ...]  # one line each: what was read and changes no count predicted here
    sliding_window: int | None  # attention sees at most this many tokens (None: the whole sequence)


class _Field:
    """Typed reads of one JSON object, each error naming the file and the field."""

    def __init__(self, d: dict, where: str, prefix: str = ""):
        self.d, self.where, self.prefix = d, where, prefix

    def fail(self, key: str, want: str, v=None, shown: bool = True) -> ConfigError:
        got = f", got {_show(v)}" if shown else ""
        return ConfigError(f"{self.where}: {self.prefix}{key} must be {want}{got}")

    def get(self, key: str, required: bool = False):
        if key not in self.d:
            if required:
                raise ConfigError(f"{self.where}: missing field {self.prefix}{key}")
            return None
        if self.d[key] is None and required:
            raise self.fail(key, "given", None)
        return self.d[key]

    def int(self, key: str, limit: int, required: bool = False) -> int | None:
        v = self.get(key, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise self.fail(key, "a positive integer", v)
        if v > limit:
            raise ConfigError(f"{self.where}: {self.prefix}{key}={v:.3g} is larger than any machine could hold "
                              f"(at most {limit:,})")
        return v

    def number(self, key: str, below: float = math.inf) -> float | None:
        v = self.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < below:
            raise self.fail(key, "a finite number > 0" + ("" if below == math.inf else f" and < {below:g}"), v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, "true or false (a JSON boolean, not a string or a number)", v)
        return v

    def str(self, key: str) -> str | None:
        v = self.get(key)
        if v is not None and not isinstance(v, str):
            raise self.fail(key, "a string", v)
        return v

    def obj(self, key: str) -> dict | None:
        v = self.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.fail(key, "a JSON object", v)
        return v


def _show(v) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "a list"
    return oneline(json.dumps(v), 60)


def _refuse_constant(name: str):
    raise ConfigError(f"{name} is not a number (non-finite values are refused)")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ConfigError(f"{oneline(text, 40)} is out of a float's range")
    return x


def load_json_object(p: Path, what: str) -> dict:
    """A JSON object from a UTF-8 file of at most MAX_CONFIG_BYTES, with only finite numbers."""
    where = oneline(str(p))
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{where}: larger than {MAX_CONFIG_BYTES:,} bytes; not a {what}")
        text = p.read_bytes().decode("utf-8")
        d = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}); not a {what}") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply; not a {what}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {oneline(e.strerror or e, 100)}") from None
    except ValueError as e:  # json.JSONDecodeError, and integers longer than Python reads
        raise ConfigError(f"{where}: not valid JSON ({oneline(e, 120)}); not a {what}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{where} is not a JSON object")
    return d


def _display_name(name_or_path: str | None, folder: str) -> str:
    """A model's name for titles and file stems: the last part of `_name_or_path` (so no absolute path
    reaches a report), in letters, digits and . _ + - only (no control character or markup reaches a
    terminal, no path separator reaches a file name)."""
    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]", "_", text)[:64].strip(".")

    return clean(re.split(r"[/\\]", (name_or_path or "").strip().rstrip("/\\"))[-1]) or clean(folder) or "hf"


def _full_rotary(f: _Field) -> None:
    factor = f.number("partial_rotary_factor", below=1.0 + 1e-12)
    if factor is not None and factor != 1.0:
        raise ConfigError(f"{f.where}: {f.prefix}partial_rotary_factor={factor:g} is not modelled (RoPE turns the "
                          "whole head here)")


def _rope(f: _Field, notes: list[str]) -> float | None:
    """rope_theta from rope_parameters (transformers 5) or the top level; scaling kinds noted, not refused."""
    theta = f.number("rope_theta")
    _full_rotary(f)
    for key in ("rope_scaling", "rope_parameters"):
        block = f.obj(key)
        if not block:
            continue
        nested = all(isinstance(v, dict) for v in block.values())  # per layer type: {"full_attention": {...}}
        for sub, params in (block.items() if nested else [("", block)]):
            g = _Field(params, f.where, f"{key}.{sub + '.' if sub else ''}")
            kind = g.str("rope_type") or g.str("type") or "default"
            if kind not in ROPE_KINDS:
                raise g.fail("rope_type", f"one of {', '.join(ROPE_KINDS)}", kind)
            theta = g.number("rope_theta") or theta
            _full_rotary(g)
            if kind not in ("default", "mrope"):
                factor = g.number("factor")
                notes.append(f"RoPE scaling {kind}{f' (factor {factor:g})' if factor else ''} read from {key}: it "
                             "changes the rotation frequencies only, no count predicted here")
    return theta


def _qwen2_window(f: _Field) -> int | None:
    """Qwen2's sliding window, as Qwen2Config reads it: on only under use_sliding_window (Qwen2.5 ships
    false), then for the layers listed "sliding_attention" in layer_types, or else layers
    max_window_layers and up. None when no layer uses it."""
    window = f.int("sliding_window", MAX_SEQ)
    if not f.bool("use_sliding_window", False) or window is None:
        return None
    kinds = f.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise f.fail("layer_types", "a list of strings", kinds)
        return window if "sliding_attention" in kinds else None
    first = f.get("max_window_layers")
    if first is None:
        first = 28  # Qwen2Config's default
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise f.fail("max_window_layers", "a non-negative integer", first)
    layers = f.int("num_hidden_layers", MAX_LAYERS, required=True)
    return window if first < layers else None


def read_hf_config(path: str | Path) -> HFConfig:
    """Read a Hugging Face Llama-family config.json (llama, mistral, qwen2; a file, or a folder holding one),
    every field used checked by type and range; what cannot be modelled is refused in one line naming the
    file and field."""
    if not str(path).strip():
        raise ConfigError("--hf-config is empty; give a config.json or the folder holding it")
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
        found = p.is_file()
    except (OSError, ValueError):  # a name too long, or with a NUL byte
        found = False
    if not found:
        raise ConfigError(f"no Hugging Face config at {oneline(repr(str(path)))}")
    f = _Field(load_json_object(p, "Hugging Face config"), oneline(str(p)))
    family = f.get("model_type")
    if family not in _HF_FAMILIES:
        raise ConfigError(f"{f.where}: model_type {_show(family)} is not a Llama-family model "
                          f"({', '.join(_HF_FAMILIES)})")
    qwen2 = family == "qwen2"  # Qwen2Attention: q, k, v with a bias, o without; no bias flags to read
    if not qwen2 and f.bool("attention_bias", False):
        raise ConfigError(f"{f.where}: attention_bias=true is not modelled (it biases q, k, v and o; the models here "
                          "bias q, k and v only, as Qwen2 does)")
    if f.bool("mlp_bias", False):
        raise ConfigError(f"{f.where}: mlp_bias=true is not modelled (the MLP here has no biases)")
    act = f.str("hidden_act") or "silu"
    if act not in SILU:
        raise ConfigError(f"{f.where}: hidden_act {_show(act)} is not modelled (the MLP here is SwiGLU, with SiLU)")
    hidden = f.int("hidden_size", MAX_WIDTH, required=True)
    heads = f.int("num_attention_heads", MAX_WIDTH, required=True)
    head_dim = f.int("head_dim", MAX_WIDTH) or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(f"{f.where}: head_dim={head_dim} × num_attention_heads={heads} != hidden_size={hidden}")
    notes: list[str] = []
    theta = _rope(f, notes)
    window = _qwen2_window(f) if qwen2 else f.int("sliding_window", MAX_SEQ)
    try:
        cfg = ModelConfig(
            name=_display_name(f.str("_name_or_path"), p.parent.name),
            hidden=hidden,
            layers=f.int("num_hidden_layers", MAX_LAYERS, required=True),
            heads=heads,
            kv_heads=f.int("num_key_value_heads", MAX_WIDTH) or heads,
            intermediate=f.int("intermediate_size", MAX_WIDTH, required=True),
            vocab=f.int("vocab_size", MAX_WIDTH, required=True),
            tie_embeddings=f.bool("tie_word_embeddings", False),
            norm_eps=f.number("rms_norm_eps", below=1.0) or 1e-6,  # LlamaConfig's and MistralConfig's default
            rope_theta=theta or 10000.0,
            qkv_bias=qwen2,
        )
    except ConfigError as e:
        raise ConfigError(f"{f.where}: {e}") from None
    return HFConfig(cfg, tuple(notes), window)


def from_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (read_hf_config has its notes and sliding window)."""
    return read_hf_config(path).config


def config_fields() -> list[str]:
    return [f.name for f in fields(ModelConfig) if f.name != "name"]
