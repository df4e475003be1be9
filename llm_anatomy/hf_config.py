"""Reading a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3 dense; Qwen3-MoE, Mixtral, gpt-oss and OLMoE)
into a ModelConfig: every field used checked by type and range; what cannot be modelled is refused in one line
naming the file and the field; what changes no count (RoPE scaling) is accepted with a note. Pure Python, like
llm_anatomy/config.py.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

from llm_anatomy.config import MAX_LAYERS, MAX_SEQ, MAX_WIDTH, ConfigError, ModelConfig, oneline
from llm_anatomy.io import read_input

# ---- Hugging Face config.json ---------------------------------------------------------------------
# qwen2: Qwen2 and Qwen2.5, with q/k/v biases; qwen3: dense Qwen3, RMSNorm on each q and k head, its own head_dim
_HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
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


def _json(v) -> str:  # a value as the file writes it, lists and objects too
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
    raw = read_input(p, what, MAX_CONFIG_BYTES)  # a regular file of bounded size; its refusal names the path
    try:
        text = raw.decode("utf-8")
        d = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}); not a {what}") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply; not a {what}") from None
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


# ---- mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss, OLMoE): experts, router, attention fields --------
# Defaults are transformers' own (models/<family>/configuration_<family>.py in transformers 5.25) for a field a file
# leaves out. The load-balancing loss: transformers adds router_aux_loss_coef x aux to the loss only when
# output_router_logits is true (MixtralForCausalLM.forward and its siblings compute aux_loss under that flag alone),
# and every published config ships it false, so the coefficient is read only under that flag and noted otherwise.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")
GPT_OSS_LIMIT = 7.0  # the clamp of the gpt-oss activation (baseline/mlp.py's GPT_OSS_LIMIT)
# transformers' defaults for the fields a file may leave out: (experts, experts per token, aux-loss coefficient)
_DEFAULTS = {"qwen3_moe": (128, 8, 0.001), "mixtral": (8, 2, 0.001), "gpt_oss": (128, 4, 0.001),
             "olmoe": (64, 8, 0.01)}


def _refuse(f, key: str, why: str) -> ConfigError:
    return ConfigError(f"{f.where}: {f.prefix}{key}{'' if why.startswith('=') else ' '}{why}")


def _experts(f, family: str) -> dict:
    e_default, k_default, _ = _DEFAULTS[family]
    experts = f.int("num_experts" if family in ("qwen3_moe", "olmoe") else "num_local_experts", 1 << 20) or e_default
    k = f.int("num_experts_per_tok", 1 << 20)
    if family == "gpt_oss" and k is None:  # the older key of gpt-oss's published files
        k = f.int("experts_per_token", 1 << 20)
    return dict(experts=experts, experts_per_token=k or k_default)


def _aux_coef(f, family: str, notes: list[str]) -> float:
    coef = f.get("router_aux_loss_coef")
    if coef is None:
        coef = _DEFAULTS[family][2]
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise f.fail("router_aux_loss_coef", "a finite number >= 0", coef)
    if f.bool("output_router_logits", False):
        return float(coef)
    if coef:
        notes.append(f"router_aux_loss_coef={coef:g} read, but output_router_logits is false: transformers then adds "
                     "no load-balancing loss, so none is counted (set it true to train with the loss)")
    return 0.0


def _layer_types(f, layers: int) -> str | None:
    """gpt-oss's layer_types as a window pattern: "even" (sliding first, then alternating, transformers'
    default), "all", or None (every layer full); any other sequence is refused."""
    kinds = f.get("layer_types")
    if kinds is None:
        return "even"
    if not isinstance(kinds, list) or not all(k in ("sliding_attention", "full_attention") for k in kinds):
        raise f.fail("layer_types", 'a list of "sliding_attention" and "full_attention"', kinds)
    if len(kinds) != layers:
        raise _refuse(f, "layer_types", f"has {len(kinds)} entries for num_hidden_layers={layers}")
    patterns = {"even": [i % 2 == 0 for i in range(layers)], "all": [True] * layers, None: [False] * layers}
    for name, sliding in patterns.items():
        if [k == "sliding_attention" for k in kinds] == sliding:
            return name
    raise _refuse(f, "layer_types", "is not modelled: the sliding window applies to every layer or to the even "
                  "ones (0, 2, 4, ...) here")


def moe_fields(f, family: str, layers: int, notes: list[str]) -> dict:
    """ModelConfig keywords for the experts, the router and the attention of a mixture-of-experts family."""
    if family in ("qwen3_moe",):
        step = f.get("decoder_sparse_step")
        if step is not None and step != 1:
            raise _refuse(f, "decoder_sparse_step", f"={_json(step)} is not modelled (every layer is a "
                          "mixture of experts here: decoder_sparse_step must be 1)")
        only = f.get("mlp_only_layers")
        if only not in (None, []):
            raise _refuse(f, "mlp_only_layers", f"={_json(only)} is not modelled (every layer is a mixture of "
                          "experts here: mlp_only_layers must be empty)")
    if family == "mixtral":
        jitter = f.get("router_jitter_noise")
        if jitter not in (None, 0, 0.0):
            raise _refuse(f, "router_jitter_noise", f"={_json(jitter)} is not modelled (the router here scales no "
                          "input by random noise)")
    if family == "olmoe" and f.get("clip_qkv") is not None:
        raise _refuse(f, "clip_qkv", f"={_json(f.get('clip_qkv'))} is not modelled (q, k and v are not clamped here)")
    inter = f.int("intermediate_size", MAX_WIDTH, required=True)
    kw = dict(_experts(f, family), router_aux_coef=_aux_coef(f, family, notes))
    kw["expert_intermediate"] = f.int("moe_intermediate_size", MAX_WIDTH) if family == "qwen3_moe" else inter
    kw["expert_intermediate"] = kw["expert_intermediate"] or 768  # Qwen3MoeConfig's default
    # Mixtral always rescales the k weights to sum to 1; Qwen3-MoE and OLMoE under norm_topk_prob (default false)
    kw["norm_topk"] = True if family == "mixtral" else f.bool("norm_topk_prob", False)
    if family in ("qwen3_moe", "mixtral", "olmoe") and f.get("attention_bias") is not None:
        bias = f.bool("attention_bias", False)
        kw.update(qkv_bias=bias, o_bias=bias)  # each family biases q, k, v and o alike under it
    if family in ("qwen3_moe", "olmoe"):
        kw["qk_norm"] = True
        kw["qk_norm_whole"] = family == "olmoe"  # OLMoE's q_norm and k_norm span the whole projections
    if family == "gpt_oss":
        limit = f.number("swiglu_limit")
        if limit is not None and limit != GPT_OSS_LIMIT:
            raise _refuse(f, "swiglu_limit", f"={limit:g} is not modelled (the gpt-oss activation clamps at "
                          f"{GPT_OSS_LIMIT:g} here)")
        alpha = f.number("swiglu_alpha")
        notes.append(f"swiglu_alpha={alpha if alpha is not None else 1.702:g} (1.702 when absent): the gpt-oss "
                     "activation here is silu (alpha 1) with the same clamps and +1; no parameter or matmul FLOP "
                     "depends on it")
        bias = f.bool("attention_bias", True)  # GptOssConfig's default
        window = f.int("sliding_window", MAX_SEQ) or 128
        pattern = _layer_types(f, layers)
        kw.update(mlp="gpt-oss", router="topk-softmax", router_bias=True, expert_bias=True, qkv_bias=bias,
                  o_bias=bias, attn_sinks=True, window=window if pattern else None, window_pattern=pattern or "all")
    return kw


def read_hf_config(path: str | Path) -> HFConfig:
    """Read a Hugging Face config.json (llama, mistral, qwen2, qwen3, and the MOE_FAMILIES; a file, or a folder
    holding one),
    every field used checked by type and range; what cannot be modelled is refused in one line naming the
    file and field."""
    if not str(path).strip():
        raise ConfigError("--hf-config is empty; give a config.json or the folder holding it")
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
        found = p.exists()  # a FIFO, a device or a socket is refused by name when read
    except (OSError, ValueError):  # a name too long, or with a NUL byte
        found = False
    if not found:
        raise ConfigError(f"no Hugging Face config at {oneline(repr(str(path)))}")
    f = _Field(load_json_object(p, "Hugging Face config"), oneline(str(p)))
    family = f.get("model_type")
    if family not in _HF_FAMILIES + MOE_FAMILIES:
        raise ConfigError(f"{f.where}: model_type {_show(family)} is not a Llama-family model or a mixture "
                          f"of experts read here "
                          f"({', '.join(_HF_FAMILIES + MOE_FAMILIES)})")
    moe = family in MOE_FAMILIES
    qwen2 = family == "qwen2"  # Qwen2Attention: q, k, v with a bias, o without; no bias flags to read
    if not qwen2 and not moe and f.bool("attention_bias", False):
        raise ConfigError(f"{f.where}: attention_bias=true is not modelled (it biases q, k, v and o; the models here "
                          "bias q, k and v only, as Qwen2 does)")
    if f.bool("mlp_bias", False):
        raise ConfigError(f"{f.where}: mlp_bias=true is not modelled (the MLP here has no biases)")
    act = f.str("hidden_act") if "hidden_act" in f.d else "silu"  # absent: LlamaConfig's default; null is none
    if act not in SILU:
        raise ConfigError(f"{f.where}: hidden_act {_show(act)} is not modelled (the MLP here is SwiGLU, with SiLU)")
    hidden = f.int("hidden_size", MAX_WIDTH, required=True)
    heads = f.int("num_attention_heads", MAX_WIDTH, required=True)
    qwen3 = family == "qwen3"  # Qwen3Attention: q_norm and k_norm of head_dim, and o reads heads x head_dim
    # Qwen3Config's default: 128; GptOssConfig's: 64; the others derive hidden // heads
    head_dim = f.int("head_dim", MAX_WIDTH) or {"qwen3": 128, "gpt_oss": 64}.get(family, hidden // heads)
    if head_dim * heads != hidden and not qwen3 and family not in ("qwen3_moe", "gpt_oss", "mixtral"):
        raise ConfigError(f"{f.where}: head_dim={head_dim} × num_attention_heads={heads} != hidden_size={hidden}")
    notes: list[str] = []
    theta = _rope(f, notes)
    window = _qwen2_window(f) if family in ("qwen2", "qwen3", "qwen3_moe") else f.int("sliding_window", MAX_SEQ)
    layers = f.int("num_hidden_layers", MAX_LAYERS, required=True)
    extra = moe_fields(f, family, layers, notes) if moe else {}
    if family == "gpt_oss":  # its window is part of the model (ModelConfig.window), not a bound on --seq
        window = None
    try:
        cfg = ModelConfig(
            name=_display_name(f.str("_name_or_path"), p.parent.name),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=f.int("num_key_value_heads", MAX_WIDTH) or heads,
            intermediate=f.int("intermediate_size", MAX_WIDTH, required=True),
            vocab=f.int("vocab_size", MAX_WIDTH, required=True),
            tie_embeddings=f.bool("tie_word_embeddings", False),
            norm_eps=f.number("rms_norm_eps", below=1.0) or 1e-6,  # LlamaConfig's and MistralConfig's default
            rope_theta=theta or 10000.0,
            **{"qkv_bias": qwen2, "qk_norm": qwen3, **extra},
            head_dim=head_dim,
        )
    except ConfigError as e:  # ModelConfig's own check names no file; a field's read already does
        raise ConfigError(str(e) if str(e).startswith(f"{f.where}: ") else f"{f.where}: {e}") from None
    if f.get("quantization_config") is not None:
        notes.append("quantization_config ignored: the counts are of the model trained in the run's dtype (a "
                     "quantized checkpoint's storage format changes no training step predicted here)")
    return HFConfig(cfg, tuple(notes), window)


def from_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (read_hf_config has its notes and sliding window)."""
    return read_hf_config(path).config


