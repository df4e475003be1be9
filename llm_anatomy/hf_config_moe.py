"""The mixture-of-experts families of Hugging Face config.json (Qwen3-MoE, Mixtral, gpt-oss, OLMoE): their experts,
router and attention fields as ModelConfig keywords, each checked by type and range. What cannot be modelled is
refused in one line naming the file and the field. Pure Python, like llm_anatomy/hf_config.py, which calls this.

Defaults are transformers' own (models/<family>/configuration_<family>.py in transformers 5.25) for a field a file
leaves out. The load-balancing loss: transformers adds router_aux_loss_coef x aux to the loss only when
output_router_logits is true (MixtralForCausalLM.forward and its siblings compute aux_loss under that flag alone),
and every published config ships it false, so the coefficient is read only under that flag and noted otherwise.
"""
from __future__ import annotations

import json

from llm_anatomy.config import MAX_SEQ, MAX_WIDTH, ConfigError, oneline

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


def _json(v) -> str:
    return oneline(json.dumps(v), 60)
