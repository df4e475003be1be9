"""ModelConfig (architecture) and Run (batch, sequence, dtype policy), with named presets. Reading a
Hugging Face config.json into a ModelConfig is llm_anatomy/hf_config.py.

Pure Python: the calculator imports this, and the calculator must not import torch.
Every value is checked by type and range here, so the calculator only ever sees sizes it can count.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field, fields

MLP_VARIANTS = ("swiglu", "gpt-oss")
ROUTERS = ("softmax-topk", "topk-softmax")
# which layers a sliding window applies to: "all", or "even" (layers 0, 2, 4, ...; the odd ones see the whole
# sequence: gpt-oss's layer_types, sliding_attention first)
WINDOW_PATTERNS = ("all", "even")
# dtype policies:
#   amp  : fp32 master weights, bf16 autocast for matmuls (the default; what most training runs use)
#   bf16 : parameters and activations in bf16, no autocast
#   fp32 : everything fp32 (numerical references and CPU checks)
DTYPE_POLICIES = ("amp", "bf16", "fp32")
# activation recompute (efficient variant only):
#   none : keep every saved tensor (the fastest step)
#   mlp  : keep only the MLP block's input; its norm, gate_up matmul and activation run again in backward
#   full : keep only each block's input; backward runs the whole block's forward again (but its last matmul)
RECOMPUTE = ("none", "mlp", "full")
# the efficient variant's fused linear cross-entropy: ours (llm_anatomy/kernels/linear_ce.py) or Liger-Kernel's
LOSS_IMPLS = ("anatomy", "liger")

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
    # Qwen3 states its head width: heads * head_dim need not equal hidden (Qwen3-0.6B: 16 x 128 over 1024).
    # None derives hidden // heads, so every config that never names it is what it was.
    head_dim: int | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head (weights of head_dim), after the projections, before RoPE
    # qk_norm over the whole q and the whole k projection (weights of heads x head_dim and kv_heads x head_dim), as
    # OLMoE normalises them, instead of per head
    qk_norm_whole: bool = False
    o_bias: bool = False  # a bias on o too (gpt-oss's attention_bias biases q, k, v and o)
    attn_sinks: bool = False  # a learned logit per head joins each softmax row and is dropped after it (gpt-oss)
    # a sliding window: each query sees itself and the window - 1 tokens before it, in the layers window_pattern
    # names (WINDOW_PATTERNS); None: every layer sees the whole causal prefix
    window: int | None = None
    window_pattern: str = "all"
    # Mixture of experts (every layer): `experts` routed SwiGLU experts of width expert_intermediate; a linear router
    # sends each token to `experts_per_token` of them and sums their outputs by the router's weights, plus
    # `shared_experts` always-on experts, run as one SwiGLU MLP of width shared_experts x shared_intermediate.
    # experts = 0: the dense MLP of width `intermediate`, and every field below keeps its default.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int | None = None  # None: intermediate
    shared_experts: int = 0
    shared_intermediate: int | None = None  # None: expert_intermediate
    # ROUTERS: "softmax-topk" takes the top k of a softmax over every expert (Mixtral, Qwen3-MoE, OLMoE);
    # "topk-softmax" takes a softmax over the top k logits (gpt-oss)
    router: str = "softmax-topk"
    norm_topk: bool = True  # softmax-topk: rescale the k weights to sum to 1 (Mixtral, Qwen3-MoE; OLMoE does not)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on every expert's gate_up and down (gpt-oss)
    router_aux_coef: float = 0.0  # the load-balancing loss's weight in the training loss (0: none)
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("hidden", "intermediate", "vocab"):
            _positive_int(f, getattr(self, f), MAX_WIDTH)
        _positive_int("layers", self.layers, MAX_LAYERS)
        _positive_int("heads", self.heads)  # at most hidden, and kv_heads at most heads: by divisibility below
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _positive_int("kv_heads", self.kv_heads)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _positive_int("head_dim", self.head_dim, MAX_WIDTH)
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.q_dim > MAX_WIDTH:
            raise ConfigError(f"heads x head_dim = {self.q_dim:.3g} is larger than any machine could hold "
                              f"(at most {MAX_WIDTH:,})")
        if self.mlp not in MLP_VARIANTS:
            raise ConfigError(f"mlp must be one of {', '.join(MLP_VARIANTS)}, got {oneline(repr(self.mlp), 60)}")
        for f in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f} must be true or false, got {oneline(repr(getattr(self, f)), 60)}")
        self._check_attention()
        self._check_moe()
        _positive_float("norm_eps", self.norm_eps, below=1.0)
        _positive_float("rope_theta", self.rope_theta)
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {oneline(repr(self.name), 60)}")
        if self.rough_params > MAX_PARAMS:
            raise ConfigError(f"{self.rough_params:.3g} parameters is more than any machine could hold "
                              f"(at most {MAX_PARAMS:.0e})")

    def _check_attention(self) -> None:
        for f in ("qk_norm_whole", "o_bias", "attn_sinks"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f} must be true or false, got {oneline(repr(getattr(self, f)), 60)}")
        if self.qk_norm_whole and not self.qk_norm:
            raise ConfigError("qk_norm_whole needs qk_norm (it says how wide the q and k norms are)")
        if self.window is not None:
            _positive_int("window", self.window, MAX_SEQ)
        if self.window_pattern not in WINDOW_PATTERNS:
            raise ConfigError(f"window_pattern must be one of {', '.join(WINDOW_PATTERNS)}, got "
                              f"{oneline(repr(self.window_pattern), 60)}")
        if self.window is None and self.window_pattern != "all":
            raise ConfigError("window_pattern needs a window (it says which layers the window applies to)")

    def windowed(self, layer: int) -> bool:
        """Does layer `layer` (0-based) attend through the sliding window?"""
        return self.window is not None and (self.window_pattern == "all" or layer % 2 == 0)

    @property
    def windowed_layers(self) -> int:
        """How many layers attend through the sliding window."""
        if self.window is None:
            return 0
        return self.layers if self.window_pattern == "all" else (self.layers + 1) // 2

    def _check_moe(self) -> None:
        moe_fields = ("experts_per_token", "expert_intermediate", "shared_experts", "shared_intermediate",
                      "router_bias", "expert_bias", "router_aux_coef")
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise ConfigError(f"experts must be a non-negative integer, got {oneline(repr(self.experts), 60)}")
        if self.experts == 0:
            for f in moe_fields:
                if getattr(self, f) not in (0, None, False, 0.0):
                    raise ConfigError(f"{f} needs experts > 0 (a dense MLP has no {f})")
            return
        _positive_int("experts_per_token", self.experts_per_token)
        if self.experts_per_token > self.experts:
            raise ConfigError(f"experts_per_token={self.experts_per_token} is more than experts={self.experts}")
        if self.expert_intermediate is None:
            object.__setattr__(self, "expert_intermediate", self.intermediate)
        _positive_int("expert_intermediate", self.expert_intermediate, MAX_WIDTH)
        if isinstance(self.shared_experts, bool) or not isinstance(self.shared_experts, int) or self.shared_experts < 0:
            raise ConfigError(f"shared_experts must be a non-negative integer, got "
                              f"{oneline(repr(self.shared_experts), 60)}")
        if self.shared_experts and self.shared_intermediate is None:
            object.__setattr__(self, "shared_intermediate", self.expert_intermediate)
        if self.shared_intermediate is not None:
            _positive_int("shared_intermediate", self.shared_intermediate, MAX_WIDTH)
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {oneline(repr(self.router), 60)}")
        for f in ("norm_topk", "router_bias", "expert_bias"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f} must be true or false, got {oneline(repr(getattr(self, f)), 60)}")
        c = self.router_aux_coef
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf:
            raise ConfigError(f"router_aux_coef must be a finite number >= 0, got {oneline(repr(c), 60)}")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:  # width of the q projection, and of o's input: hidden unless head_dim is stated
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # width of the k (and of the v) projection
        return self.kv_heads * self.head_dim

    @property
    def rough_params(self) -> int:
        """The matmul weights and embeddings (norms left out): enough to bound a size, not a count to report
        (llm_anatomy.calculator.param_count is that)."""
        block = 2 * self.hidden * (self.q_dim + self.kv_dim) + 3 * self.hidden * self.intermediate
        if self.moe:
            block += 3 * self.hidden * (self.experts * self.expert_intermediate - self.intermediate
                                        + self.shared_experts * (self.shared_intermediate or 0)) + self.experts * self.hidden
        block += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        block += (self.hidden if self.o_bias else 0) + (self.heads if self.attn_sinks else 0)
        return self.layers * block + self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def to_dict(self) -> dict:
        """Every field; qkv_bias, qk_norm, qk_norm_whole, o_bias and attn_sinks only when on, window and
        window_pattern only with a window, head_dim only when it is not hidden // heads, the MoE
        fields only when experts > 0 (so reports of Llama-family models keep their keys)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # scalars only: no deep copy needed
        if not self.moe:
            for f in ("experts", "experts_per_token", "expert_intermediate", "shared_experts", "shared_intermediate",
                      "router", "norm_topk", "router_bias", "expert_bias", "router_aux_coef"):
                del d[f]
        for f in ("qkv_bias", "qk_norm", "qk_norm_whole", "o_bias", "attn_sinks"):
            if not d[f]:
                del d[f]
        if self.window is None:
            del d["window"], d["window_pattern"]
        if self.head_dim * self.heads == self.hidden:
            del d["head_dim"]
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
    loss_impl: str = "anatomy"  # the efficient variant's loss kernel (LOSS_IMPLS); the baseline ignores it
    # the efficient variant's lean block without recompute (llm_anatomy/kernels/lean.py, add_rms_norm.py): its matmuls
    # keep no weight casts, SwiGLU + down re-makes h in backward, each residual add runs inside the next norm.
    # Under recompute the checkpoints keep plain nn.Linear and separate adds, so it changes nothing there; the
    # baseline ignores it.
    lean: bool = False

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
        if self.loss_impl not in LOSS_IMPLS:
            raise ConfigError(f"loss_impl must be one of {', '.join(LOSS_IMPLS)}, got "
                              f"{oneline(repr(self.loss_impl), 60)}")
        if not isinstance(self.lean, bool):
            raise ConfigError(f"lean must be true or false, got {oneline(repr(self.lean), 60)}")

    def to_dict(self) -> dict:
        """batch, seq, dtype, and recompute when it is on, loss_impl when it is not ours and lean when it is
        set (so reports of plain runs keep their keys)."""
        d = dict(batch=self.batch, seq=self.seq, dtype=self.dtype)
        d = d if self.recompute == "none" else dict(d, recompute=self.recompute)
        d = d if self.loss_impl == "anatomy" else dict(d, loss_impl=self.loss_impl)
        return dict(d, lean=True) if self.lean else d

    @property
    def lean_block(self) -> bool:
        """Does the efficient model run its lean block (lean, without recompute)?"""
        return self.lean and self.recompute == "none"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @classmethod
    def from_record(cls, rec: dict, dtype: str = "amp") -> "Run":
        """The Run a committed measurement row describes (batch, seq, and recompute and loss_impl where it
        names them). A row without loss_impl ran Liger's loss: every record written before ours became the
        efficient model's loss; a row without lean ran the block without it."""
        return cls(rec["batch"], rec["seq"], rec.get("dtype", dtype), rec.get("recompute", "none"),
                   rec.get("loss_impl", "liger"), rec.get("lean", False))


# What each variant's memory phases model of gpt-oss's and OLMoE's attention fields (the parameters, FLOPs and saved
# tensors of both variants count every field; both models build them), the efficient variant's under every recompute
# policy, in dense and mixture-of-experts blocks (checked on CPU: validations/test_gptoss_attention_phases.py,
# validations/test_moe_fields_recompute.py). The timing model prices them too (TIME_MODELLED).
PHASES_MODELLED = {"baseline": ("attn_sinks", "window", "o_bias", "qk_norm_whole"),
                   "efficient": ("attn_sinks", "window", "o_bias", "qk_norm_whole")}
ATTENTION_FIELDS = ("attn_sinks", "window", "o_bias", "qk_norm_whole")


def _attention_fields_on(cfg: ModelConfig) -> list[str]:
    on = {"attn_sinks": cfg.attn_sinks, "window": cfg.window is not None, "o_bias": cfg.o_bias,
          "qk_norm_whole": cfg.qk_norm_whole}
    return [f for f in ATTENTION_FIELDS if on[f]]


def unmodelled(cfg: ModelConfig, variant: str = "baseline") -> str | None:
    """The first attention field of `cfg` that `variant`'s memory phases do not model (PHASES_MODELLED), or None."""
    modelled = PHASES_MODELLED.get(variant, ())
    return next((f for f in _attention_fields_on(cfg) if f not in modelled), None)


# the attention fields the timing model's kernel lists price, in both variants and every recompute policy
# (calculator/timing/kernels_fields.py)
TIME_MODELLED = ("attn_sinks", "window", "o_bias", "qk_norm_whole")


def time_unmodelled(cfg: ModelConfig) -> str | None:
    """The first attention field of `cfg` the timing model's kernel lists do not price, or None."""
    return next((f for f in _attention_fields_on(cfg) if f not in TIME_MODELLED), None)


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

def config_fields() -> list[str]:
    return [f.name for f in fields(ModelConfig) if f.name != "name"]
