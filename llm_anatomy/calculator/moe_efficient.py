"""The efficient MoE block's saved tensors and transients (llm_anatomy/efficient/moe.py), from the config alone.

Notation: T = batch * seq tokens, K = experts_per_token, N = T*K expert rows, E experts, I = expert_intermediate,
Is = shared_experts * shared_intermediate, c = the compute dtype. Per layer, without recompute, the block keeps:
  router      the input x (T, H) in c (also the shared MLP's input: one storage), under amp the weight's cast
              (E, H); the fp32 router state: softmax over E (T, E) and top-k's indices (T, K) int64, plus with
              norm_topk the top-k values and their (T, 1) sum, kept by the division (softmax-topk); top-k's
              indices and the top-k softmax (T, K) fp32 (topk-softmax), plus the softmax over E (T, E) when
              router_aux_coef > 0
  permute     nothing of its own: its backward sums each token's rows by pos, which the unpermute keeps
  experts     xs (N, H), h (N, I) in c (the two GEMMs' inputs), under amp both stacked weights' casts, and on
              the grouped path offs (E,) int32 (the loop of mm keeps no offsets: its slices are views); on the
              grouped path under amp expert biases fold into the GEMMs: 8 more columns on xs, h and each weight
              cast; without autocast they are added after each GEMM and keep nothing more (offs is kept)
  activation  gate_up (N, 2I) in c: the fused SwiGLU keeps only it and writes d(gate_up) over it
  unpermute   y (N, H) in c, pos (N,) int64, the router's weights (T, K) fp32 (unless softmax's output already is)
  shared      the efficient dense MLP of width Is: its gate_up (T, 2Is), and without the lean block h (T, Is) and,
              under amp, both weight casts
Dropless routing: every token reaches its K experts, so N and every byte above are the same for any routing
histogram; the histogram only decides which expert's GEMM gets which rows (time, not memory).

Recompute "mlp": the block's checkpoint keeps its inputs, of which the attention branch (T, H) in c is the
block's own (the block input is attention's); "full": nothing (the block's checkpoint credits attention).
With router_aux_coef > 0 the load-balancing loss keeps the layer-mean f (E,) fp32 once per model.

Pure Python (no torch): the calculator never reads the model.
"""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.types import BYTES, Saved
from llm_anatomy.config import ConfigError, ModelConfig, Run

GROUPED_DEVICES = ("cpu", "meta", "cuda")  # cuda: the target GPUs are sm90+ (H200), where CUTLASS's kernel runs


FOLD = 8  # the columns a folded bias adds to each GEMM's inner dimension (efficient/moe.py's PAD)


def grouped_path(cfg: ModelConfig, run: Run, device: str = "cuda") -> bool:
    """Does the block run torch._grouped_mm (efficient/moe.py's _native): bf16 operands, H and I multiples of 8
    (16-byte strides)? Otherwise the loop of mm."""
    return (dtypes(run).compute == "bfloat16" and device in GROUPED_DEVICES and cfg.hidden % 8 == 0
            and cfg.expert_intermediate % 8 == 0)


def fold(cfg: ModelConfig, run: Run, device: str = "cuda") -> int:
    """The columns a folded bias adds to each grouped GEMM's inner dimension: FOLD where the weights are cast
    (autocast) on the grouped path, else 0 (no biases, the loop of mm, or biases added after the GEMM)."""
    return FOLD if cfg.expert_bias and dtypes(run).autocast and grouped_path(cfg, run, device) else 0


def added_bias(cfg: ModelConfig, run: Run, device: str = "cuda") -> bool:
    """Are the expert biases added after the grouped GEMMs (efficient/moe.py's ExpertBias): the grouped path on
    weights already in the compute dtype (the bf16 policy, FSDP2's bf16 gathers)?"""
    return cfg.expert_bias and not dtypes(run).autocast and grouped_path(cfg, run, device)


def param_tensors(cfg: ModelConfig) -> list[int]:
    """Elements of one layer's MoE parameter tensors, in module order: the router's weight (and bias), the
    stacked experts' gate_up and down (and their biases), the shared MLP's gate_up and down."""
    E, H, I = cfg.experts, cfg.hidden, cfg.expert_intermediate
    out = [E * H] + ([E] if cfg.router_bias else []) + [E * 2 * I * H, E * H * I]
    out += [E * 2 * I, E * H] if cfg.expert_bias else []
    if cfg.shared_experts:
        Is = cfg.shared_experts * cfg.shared_intermediate
        out += [2 * Is * H, H * Is]
    return out


def check_histogram(cfg: ModelConfig, run: Run, histogram) -> list[int]:
    """Rows per expert (E ints >= 0 summing to T*K); None: the balanced one."""
    E, N = cfg.experts, run.tokens * cfg.experts_per_token
    if histogram is None:
        return [N // E + (e < N % E) for e in range(E)]
    h = list(histogram)
    if len(h) != E or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in h) or sum(h) != N:
        raise ConfigError(f"routing histogram must be {E} non-negative integers summing to tokens x "
                          f"experts_per_token = {N}")
    return h


def saved_list(cfg: ModelConfig, run: Run, device: str = "cuda") -> list[Saved]:
    """Every tensor the efficient MoE block keeps, for all cfg.layers layers (Saved.count), by recompute policy."""
    dt, L, (B, S), H, E = dtypes(run), cfg.layers, (run.batch, run.seq), cfg.hidden, cfg.experts
    T, K, I, c = run.tokens, cfg.experts_per_token, cfg.expert_intermediate, dtypes(run).compute
    N = T * K
    if run.recompute == "full":
        return _balance(cfg)
    if run.recompute == "mlp":
        return [Saved("moe.branch", (B, S, H), c, L, "the checkpoint keeps its inputs: the attention branch"),
                *_balance(cfg)]
    saved = linears_saved("moe", T, H, {"router": E}, dt, L, c)  # x is in c already: kept as it is
    if cfg.router == "softmax-topk":
        saved += [Saved("moe.router.softmax", (T, E), "float32", L, "softmax keeps its output"),
                  Saved("moe.router.topk_indices", (T, K), "int64", L, "top-k keeps its indices")]
        if cfg.norm_topk:
            saved += [Saved("moe.router.topk_values", (T, K), "float32", L, "the division keeps its dividend"),
                      Saved("moe.router.topk_sum", (T, 1), "float32", L, "the division keeps its divisor")]
        saved.append(Saved("moe.router.weights", (T, K), "float32", L,
                           "the unpermute keeps the weights (the top-k values, or their normalised copy)"))
    else:
        saved += [Saved("moe.router.topk_indices", (T, K), "int64", L, "top-k keeps its indices"),
                  Saved("moe.router.weights", (T, K), "float32", L,
                        "the top-k softmax keeps its output, which the unpermute keeps too")]
        if cfg.router_aux_coef > 0:
            saved.append(Saved("moe.router.softmax", (T, E), "float32", L,
                               "the load-balancing loss's softmax over every expert keeps its output"))
    grouped, f = grouped_path(cfg, run, device), fold(cfg, run, device)  # folded: [x, 1, 0 x 7], [W, b, 0 x 7]
    saved += [Saved("moe.experts.xs", (N, H + f), c, L, "the first grouped GEMM keeps its input, the permuted tokens"),
              Saved("moe.activation.gate_up", (N, 2 * I), c, L,
                    "the fused activation keeps gate_up; silu and the clamps are recomputed"),
              Saved("moe.experts.h", (N, I + f), c, L, "the second grouped GEMM keeps its input")]
    if dt.autocast:
        saved += [Saved("moe.experts.gate_up.weight_cast", (E, 2 * I, H + f), c, L, "the cast the GEMM keeps"),
                  Saved("moe.experts.down.weight_cast", (E, H, I + f), c, L, "the cast the GEMM keeps")]
    if grouped:
        saved.append(Saved("moe.experts.offs", (E,), "int32", L, "torch._grouped_mm keeps the row ends"))
    saved += [Saved("moe.unpermute.y", (N, H), c, L, "kept for d(weights) = <d(out), y>"),
              Saved("moe.unpermute.pos", (N,), "int64", L, "kept for the scatter of d(y) (and the permute's sum)")]
    if cfg.shared_experts:
        saved += _shared(cfg, run)
    return saved + _balance(cfg)


def _balance(cfg: ModelConfig) -> list[Saved]:
    """The load-balancing loss (router_aux_coef > 0), once per model, under every recompute policy: f * P keeps
    the layer-mean f (E,) fp32."""
    if cfg.router_aux_coef <= 0:
        return []
    return [Saved("moe.balance.f", (cfg.experts,), "float32", 1, "the product f * P keeps f for P's gradient")]


def _shared(cfg: ModelConfig, run: Run) -> list[Saved]:
    """The shared experts' efficient dense MLP (calculator/mlp.py's efficient_saved, without the input it shares
    with the router)."""
    dt, L, T, c, lean = dtypes(run), cfg.layers, run.tokens, dtypes(run).compute, run.lean_block
    Is = cfg.shared_experts * cfg.shared_intermediate
    out = [Saved("moe.shared.gate_up", (T, 2 * Is), c, L, "the fused activation keeps gate_up")]
    if dt.autocast and not lean:
        out += [Saved("moe.shared.gate_up.weight_cast", (cfg.hidden, 2 * Is), c, L, "saved by the matmul"),
                Saved("moe.shared.down.weight_cast", (Is, cfg.hidden), c, L, "saved by the matmul")]
    if not lean:  # the lean SwiGLU + down node makes h again in backward
        out.append(Saved("moe.shared.h", (T, Is), c, L, "down keeps its input"))
    return out


def efficient_moe_saved(cfg: ModelConfig, run: Run, histogram=None, device: str = "cuda") -> dict[str, int]:
    """Saved bytes of the efficient MoE block over all layers, by tensor name (component "moe"). The histogram
    (rows per expert; None: balanced) is checked and changes no byte: dropless routing keeps N = T*K rows."""
    check_histogram(cfg, run, histogram)
    out: dict[str, int] = {}
    for s in saved_list(cfg, run, device):
        out[s.name] = out.get(s.name, 0) + s.bytes
    return out


def efficient_moe_transients(cfg: ModelConfig, run: Run, histogram=None, device: str = "cuda") -> dict[str, int]:
    """Bytes of the buffers one layer's MoE block makes and frees inside a phase (not saved), by name.

    forward: the router logits (T, E) in c and their fp32 copy; the routing state on the device (the sorted
    order (N,) and the sorted expert ids (N,) int64, torch.arange for the searchsorted and the inverse); on the
    loop-of-mm path each expert's output block until the cat joins them (N x the GEMM's width, both GEMMs); with
    folded biases the unfolded xs (N, H), h (N, I), the ones block (N, 8) and the plain weight casts until each
    cat (under amp the casts are new buffers either way: saved, so not listed); with biases added after the
    GEMMs each row's expert (N,) int32 (and its arange) and the gathered bias rows (N, width).
    backward: d(y) (N, H) from the unpermute, d(h) (N, I + fold) from the second GEMM (d(gate_up) is written
    over the saved gate_up), d(xs) (N, H + fold) from the first GEMM and d(x) (T, H) from the permute's sum,
    and the gradients of the stacked weight casts under amp before their fp32 cast; with biases added after
    the GEMMs, d(bias) as a grouped GEMM of a ones (8, N) against d(out): (E, 8, width)."""
    hist = check_histogram(cfg, run, histogram)
    T, K, H, E, I = run.tokens, cfg.experts_per_token, cfg.hidden, cfg.experts, cfg.expert_intermediate
    N, c, i64 = T * K, BYTES[dtypes(run).compute], BYTES["int64"]
    grouped, f = grouped_path(cfg, run, device), fold(cfg, run, device)
    fwd = {"router.logits": T * E * c, "router.logits_fp32": T * E * 4, "permute.order": N * i64,
           "permute.expert_sorted": N * i64, "permute.arange": (N + E) * i64}
    if not grouped:  # cat's inputs: one block per expert
        fwd["experts.loop_blocks"] = sum(hist) * (2 * I + H) * c
    if f:
        fwd["experts.unfolded"] = (N * (H + I + 2 * FOLD) + E * 3 * I * H) * c
    bwd = {"unpermute.d_y": N * H * c, "experts.d_h": N * (I + f) * c, "experts.d_xs": N * (H + f) * c,
           "permute.d_x": T * H * c}
    if added_bias(cfg, run, device):  # each row's expert and its gathered bias; d(bias) as a (E, 8, width) GEMM
        fwd["experts.bias_rows"] = N * (2 * 4 + max(2 * I, H) * c)
        bwd["experts.d_bias"] = (N * FOLD + E * FOLD * max(2 * I, H)) * c
    if dtypes(run).autocast:
        bwd["experts.d_weight_casts"] = E * (2 * I * (H + f) + H * (I + f)) * c
    return {**{f"forward.{k}": v for k, v in fwd.items()}, **{f"backward.{k}": v for k, v in bwd.items()}}
