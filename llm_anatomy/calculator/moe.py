"""The mixture-of-experts block (component "moe"): a linear router over E experts, the k experts each token is
routed to (dropless: every token reaches its k), and the shared experts as one dense gated MLP. Pure Python.

Parameters: per layer the router (E x H, + E with router_bias), E experts of gate_up (2I x H) and down (H x I)
(+ 2I + H each with expert_bias), and the shared MLP (3 x H x shared_experts x shared_intermediate). Active per
token: every parameter but the E - k experts a token does not reach, in each layer.

FLOPs (FlopCounterMode's convention, and the model convention: no S x S matmul here, so they agree): the router's
matmul over every token, the k experts' matmuls over the T·k routed rows, the shared MLP's over every token;
backward twice forward. No count depends on how the T·k rows spread over the experts.

Saved bytes (baseline/moe.py, the per-expert loop): the routing-dependent terms are per-expert row counts, given
as a histogram (`hist`, rows routed to each expert, summing to T·k; default balanced). Each expert that receives
rows keeps its index rows, its gathered input, its gate_up output, its activation, its output and the weighted
output, and under
autocast a bf16 cast of its two weight slices (a slice is no leaf, so autocast caches no cast of it): the saved
bytes grow with the number of experts hit, so the worst histogram hits min(E, T·k) of them (the balanced one).
"""
from __future__ import annotations

from collections import Counter

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.mlp import elementwise_per_row, gated_saved
from llm_anatomy.calculator.types import Component, Saved
from llm_anatomy.config import unmodelled
from llm_anatomy.config import ConfigError, ModelConfig, Run


def shared_width(cfg: ModelConfig) -> int:
    return cfg.shared_experts * (cfg.shared_intermediate or 0)


def expert_params(cfg: ModelConfig) -> int:
    """One routed expert's parameters: gate_up and down, and their biases with expert_bias."""
    H, I = cfg.hidden, cfg.expert_intermediate
    return 3 * H * I + ((2 * I + H) if cfg.expert_bias else 0)


def params(cfg: ModelConfig) -> int:
    if not cfg.moe:
        return 0
    E, H = cfg.experts, cfg.hidden
    router = E * H + (E if cfg.router_bias else 0)
    return cfg.layers * (router + E * expert_params(cfg) + 3 * H * shared_width(cfg))


def inactive_params(cfg: ModelConfig) -> int:
    """The parameters one token does not reach: the E - k routed experts it is not sent to, in each layer."""
    return cfg.layers * (cfg.experts - cfg.experts_per_token) * expert_params(cfg) if cfg.moe else 0


def balanced(cfg: ModelConfig, run: Run) -> tuple[int, ...]:
    """T·k rows spread as evenly as the experts allow: the first (T·k mod E) experts get one row more."""
    q, r = divmod(run.tokens * cfg.experts_per_token, cfg.experts)
    return tuple(q + (e < r) for e in range(cfg.experts))


def skewed(cfg: ModelConfig, run: Run) -> tuple[int, ...]:
    """Every token sent to experts 0..k-1: the fewest experts hit, each with all T rows."""
    k = cfg.experts_per_token
    return tuple(run.tokens if e < k else 0 for e in range(cfg.experts))


def full_last(cfg: ModelConfig, run: Run) -> tuple[int, ...]:
    """The baseline loop's hardest histogram of those the calculator tries: the last expert (walked first in
    backward, while every other expert's tensors are still kept) takes every token, and the other T·k - T rows
    spread as evenly as they allow over the rest, so that as many experts as possible are hit too."""
    T, E, k = run.tokens, cfg.experts, cfg.experts_per_token
    if E == 1:
        return (T,)
    q, r = divmod(T * (k - 1), E - 1)
    return tuple(q + (e < r) for e in range(E - 1)) + (T,)


def peak_histograms(cfg: ModelConfig, run: Run) -> dict[str, tuple[int, ...]]:
    """The histograms the step's peak is reported under: balanced (the default), skewed, full_last. Their largest
    peak is reported as the worst: a maximum over these three, not proven over every histogram."""
    return {"balanced": balanced(cfg, run), "skewed": skewed(cfg, run), "full_last": full_last(cfg, run)}


def check_histogram(cfg: ModelConfig, run: Run, hist) -> tuple[int, ...]:
    """A routing histogram of this config and run, checked: E non-negative row counts, each at most T (a token
    reaches an expert once), summing to T·k (dropless routing)."""
    if not isinstance(hist, (tuple, list)) or len(hist) != cfg.experts:
        raise ConfigError(f"a routing histogram has one row count per expert ({cfg.experts}), got {hist!r:.80}")
    if any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= run.tokens for n in hist):
        raise ConfigError(f"each expert's row count must be an integer from 0 to the {run.tokens} tokens")
    if sum(hist) != run.tokens * cfg.experts_per_token:
        raise ConfigError(f"a dropless routing histogram sums to tokens x experts_per_token = "
                          f"{run.tokens * cfg.experts_per_token}, got {sum(hist)}")
    return tuple(hist)


def worst_histogram(cfg: ModelConfig, run: Run) -> tuple[int, ...]:
    """The histogram whose saved bytes are the largest: the most experts hit (module docstring)."""
    return balanced(cfg, run)


def _router_saved(cfg: ModelConfig, run: Run, L: int) -> list[Saved]:
    T, E, k = run.tokens, cfg.experts, cfg.experts_per_token
    idx = Saved("moe.router.topk_indices", (T, k), "int64", L, "topk keeps its indices to scatter the gradient back")
    if cfg.router == "topk-softmax":
        out = [idx, Saved("moe.router.weights", (T, k), "float32", L, "the softmax over the k logits keeps its output")]
        if cfg.router_aux_coef:
            out.append(Saved("moe.router.probs", (T, E), "float32", L,
                             "the load-balancing loss's softmax over every expert keeps its output"))
        return out
    out = [Saved("moe.router.probs", (T, E), "float32", L, "the softmax over every expert keeps its output"), idx]
    if cfg.norm_topk:
        out += [Saved("moe.router.topk_values", (T, k), "float32", L, "the renormalising division keeps its input"),
                Saved("moe.router.topk_sum", (T, 1), "float32", L, "the renormalising division keeps the divisor")]
    return out


def _expert_saved(cfg: ModelConfig, run: Run, n: int, count: int) -> list[Saved]:
    """What one expert that receives n rows keeps (`count` such experts over the model)."""
    dt, H, I = dtypes(run), cfg.hidden, cfg.expert_intermediate
    c = dt.compute
    out = [Saved("moe.expert.rows", (n, 2), "int64", count,
                 "torch.where's token and slot indices (views of one nonzero): index_select, the weight gather "
                 "and index_add keep them"),
           Saved("moe.expert.x", (n, H), c, count, "gate_up keeps its gathered input (under autocast, its cast)"),
           Saved("moe.expert.gate_up", (n, 2 * I), c, count, "the activation keeps gate and up, views of it")]
    if cfg.mlp == "gpt-oss":
        out += [Saved("moe.expert.gate", (n, I), c, count, "silu keeps the clamped gate"),
                Saved("moe.expert.up_plus_1", (n, I), c, count, "the product keeps the +1 output")]
    out += [Saved("moe.expert.silu_gate", (n, I), c, count, "the product keeps silu(gate)"),
            Saved("moe.expert.h", (n, I), c, count, "down keeps its input"),
            Saved("moe.expert.y", (n, H), c, count, "the weighting keeps the expert's output"),
            Saved("moe.expert.weight", (n, 1), c, count, "the weighting keeps the gathered routing weights"),
            Saved("moe.expert.weighted", (n, H), c, count, "index_add keeps its source (for the source's shape)")]
    if dt.autocast:
        out += [Saved("moe.expert.gate_up.weight_cast", (2 * I, H), c, count,
                      "autocast casts the expert's slice anew (a slice is no leaf: no cached cast)"),
                Saved("moe.expert.down.weight_cast", (H, I), c, count, "the same for down's slice")]
    return out


def saved(cfg: ModelConfig, run: Run, hist=None) -> list[Saved]:
    """Every tensor the baseline MoE blocks keep, under the routing histogram `hist`: one for every layer, or a
    list of one per layer (default: balanced in every layer)."""
    layers = _per_layer(cfg, run, hist)
    dt, L, T, H, E, Is = dtypes(run), cfg.layers, run.tokens, cfg.hidden, cfg.experts, shared_width(cfg)
    readers = {"router": E} | ({"shared.gate": Is, "shared.up": Is} if Is else {})
    out = linears_saved("moe", T, H, readers, dt, L, dt.residual) + _router_saved(cfg, run, L)
    for n, experts in sorted(Counter(n for h in layers for n in h if n).items()):
        out += _expert_saved(cfg, run, n, experts)
    if Is:
        out += gated_saved("moe.shared", cfg, run, Is, L)
    if cfg.router_aux_coef:
        out.append(Saved("moe.aux.f", (E,), "float32", 1, "f x P keeps f, the routed fractions (P needs the grad)"))
    return out


def _per_layer(cfg: ModelConfig, run: Run, hist) -> list[tuple[int, ...]]:
    if hist is None:
        return [balanced(cfg, run)] * cfg.layers
    if isinstance(hist, list) and hist and isinstance(hist[0], (tuple, list)):
        if len(hist) != cfg.layers:
            raise ConfigError(f"one routing histogram per layer ({cfg.layers}), got {len(hist)}")
        return [check_histogram(cfg, run, h) for h in hist]
    return [check_histogram(cfg, run, hist)] * cfg.layers


def phases_unmodelled(cfg: ModelConfig, run: Run, variant: str, device: str = "cuda") -> str | None:
    """What the memory phases (calculator/memory.py) and the timing model do not model for this config and run,
    in words, or None: the attention fields (config.unmodelled), and for a mixture of experts the efficient block's
    loop-of-mm fallback (fp32, widths not multiples of 8), whose backward walk is not written."""
    name = unmodelled(cfg, variant)  # the attention fields
    if name or not cfg.moe:
        return name
    from llm_anatomy.calculator.moe_efficient import grouped_path

    if variant != "efficient":
        return None
    return None if grouped_path(cfg, run, device) else "the loop-of-mm fallback (fp32, or widths not multiples of 8)"


def refuse_phases(cfg: ModelConfig, run: Run, variant: str, device: str = "cuda", what: str = "the memory phases"
                  ) -> None:
    """A one-line ConfigError naming what phases_unmodelled finds."""
    why = phases_unmodelled(cfg, run, variant, device)
    if why:
        raise ConfigError(f"{what}: {why} not modelled yet (config {cfg.name}); for experts the baseline's loop "
                          "and the efficient block's grouped-GEMM path under amp or bf16 are")


def flops(cfg: ModelConfig, run: Run) -> int:
    """Forward matmul FLOPs of every MoE layer: the router, the T·k routed rows, the shared MLP."""
    T, H, I = run.tokens, cfg.hidden, cfg.expert_intermediate
    routed = T * cfg.experts_per_token
    return cfg.layers * (2 * T * H * cfg.experts + 2 * routed * H * 3 * I + 2 * T * H * 3 * shared_width(cfg))


def elementwise(cfg: ModelConfig, run: Run) -> int:
    """Forward elementwise FLOPs, an estimate: the router's softmax (5 an element), each routed row's activation,
    weighting and accumulation (2 an element of H), and the shared MLP's activation and the sum."""
    T, k, E, H = run.tokens, cfg.experts_per_token, cfg.experts, cfg.hidden
    per_layer = 5 * T * E + T * k * (elementwise_per_row(cfg, cfg.expert_intermediate) + 2 * H)
    if shared_width(cfg):
        per_layer += T * (elementwise_per_row(cfg, shared_width(cfg)) + H)
    return cfg.layers * per_layer


def baseline(cfg: ModelConfig, run: Run, device: str = "cuda", hist=None) -> Component:
    f = flops(cfg, run)
    return Component("moe", cfg.layers, params(cfg), f, 2 * f, f, 2 * f, elementwise(cfg, run), saved(cfg, run, hist))


def efficient(cfg: ModelConfig, run: Run, device: str = "cuda") -> Component:
    """The efficient block (efficient/moe.py): the baseline's FLOPs, its own saved tensors
    (calculator/moe_efficient.py: routing-independent, since dropless routing keeps T x k rows). Under recompute
    backward runs the block's forward matmuls again but the shared experts' down (the checkpoint's early stop:
    calculator/backward_moe_recompute.py)."""
    from llm_anatomy.calculator.moe_efficient import saved_list

    f = flops(cfg, run)
    T, H = run.tokens, cfg.hidden
    again = 0 if run.recompute == "none" else f - cfg.layers * 2 * T * shared_width(cfg) * H
    return Component("moe", cfg.layers, params(cfg), f, 2 * f + again, f, 2 * f, elementwise(cfg, run),
                     saved_list(cfg, run, device))
