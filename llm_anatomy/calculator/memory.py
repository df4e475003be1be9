"""Memory of a training step, phase by phase, as torch.cuda.memory_allocated reports it.

Pure Python. On CUDA the caching allocator hands out blocks rounded up to 512 bytes, so every
tensor is rounded before it is summed (device="cpu" sums exact storage bytes: what a live-storage
tracer sees there). The phases:
  - init: parameters + the (B, S) int64 ids and targets + the optimizer state;
  - forward end: + every saved tensor (the calculator's saved list; the ids and targets it names are
    the inputs themselves) + the loss scalar;
  - forward peak, baseline: + what lives only while the loss is computed: the final norm's output
    (held by the caller), the bf16 logits and their fp32 copy, and the (S, S) causal bias;
  - backward peak: the largest candidate of llm_anatomy.calculator.backward.walk, starting from forward end;
  - backward end: parameters + inputs + one gradient per parameter (saved tensors all released);
  - optimizer end: the gradients set to None, the state stays.
Optimizer state (AdamW / AdEMAMix) is added to every phase, as in a step after the first.
  - reserved_low / reserved_high: the range memory_reserved stays in (reserved(): the looser figure).
  - forward peak, efficient on CUDA: + the fused linear CE's transients (Run.loss_impl: ours,
    _anatomy_forward_transient; Liger's, _liger_forward_transient), and under recompute the weight casts
    autocast caches for the forward (_cached_casts); or, under recompute, the largest moment inside the last
    layer's checkpoint (the MLP's; under "full" the block's, _block_forward_peak, also given on any device as
    forward_peak_last_block).
Not modelled: the efficient variant's forward peak on CPU (None, not guessed): there the loss runs plain-torch
references whose fp32 chunk temporaries (torch's logsumexp and softmax internals) are not the CUDA kernels'.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod

from llm_anatomy import kernel_shapes
from llm_anatomy.calculator import attention_region, estimate, moe_region
from llm_anatomy.calculator.allocator import rounded
from llm_anatomy.calculator.attention import frees_mask, mask_kinds
from llm_anatomy.calculator.attention_region import has_mask
from llm_anatomy.calculator.backward import INPUTS, walked
from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.optimizer import state_breakdown
from llm_anatomy.calculator.moe import refuse_phases
from llm_anatomy.calculator.moe_efficient import param_tensors as moe_param_tensors
from llm_anatomy.calculator.param_layout import units
from llm_anatomy.calculator.types import BYTES, Estimate
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.kernel_shapes import chunk_rows, lce_forward_bytes, lce_vocab


def param_tensors(cfg: ModelConfig, variant: str = "baseline") -> list[tuple[int, int]]:
    """(elements, how many) of the parameter tensors, in module order: the embedding, each layer's tensors
    (L of each), the final norm, the head (a tied head counted once)."""
    if variant == "baseline":  # the module tree's own list (param_layout.py), which covers every config field
        before, block, after = units(cfg)
        return [(prod(s), 1) for _, s in before] + [(prod(s), cfg.layers) for _, s in block] + \
            [(prod(s), 1) for _, s in after]
    H, I, kv, L, q = cfg.hidden, cfg.intermediate, cfg.kv_dim, cfg.layers, cfg.q_dim
    qb, kb, qkvb = ([q], [kv], [q + 2 * kv]) if cfg.qkv_bias else ([], [], [])  # each bias follows its weight
    qkn = ([q, kv] if cfg.qk_norm_whole else [cfg.head_dim] * 2) if cfg.qk_norm else []  # q_norm, k_norm after o
    if variant == "efficient":  # attention's own sinks before its children; o's bias after its weight
        ffn = moe_param_tensors(cfg) if cfg.moe else [2 * I * H, H * I]
        sinks, ob = [cfg.heads] if cfg.attn_sinks else [], [H] if cfg.o_bias else []
        layer = [H, *sinks, (q + 2 * kv) * H, *qkvb, q * H, *ob, *qkn, H, *ffn]
    else:
        layer = [H, q * H, *qb, kv * H, *kb, kv * H, *kb, q * H, *qkn, H, I * H, I * H, H * I]
    return [(cfg.vocab * H, 1)] + [(n, L) for n in layer] + [(H, 1)] + ([] if cfg.tie_embeddings else [(cfg.vocab * H, 1)])


def _exact(nbytes: int) -> int:
    return nbytes


@lru_cache(maxsize=256)
def model_state_bytes(cfg: ModelConfig, variant: str, param_dtype: str, optimizer: str | None,
                      cuda: bool) -> tuple[int, int]:
    """(parameters, optimizer state) in bytes, each tensor rounded on CUDA: they follow the model, never the
    micro-batch or sequence, so they are summed once per model, variant, dtype and optimizer."""
    rnd = rounded if cuda else _exact
    tensors = param_tensors(cfg, variant)
    params = sum(rnd(n * BYTES[param_dtype]) * k for n, k in tensors)
    opt = 0
    if optimizer:
        per = state_breakdown(optimizer)
        # AdamW keeps its moments in the parameter's dtype; AdEMAMix keeps fp32 (calculator.optimizer)
        scale = BYTES[param_dtype] / 4 if optimizer == "adamw" else 1
        opt = sum(rnd(int(n * b * scale)) * k for n, k in tensors for b in per.values())
        opt += sum(k for _, k in tensors) * rnd(4) if optimizer == "adamw" else 0  # torch's 0-dim fp32 `step` per tensor
    return params, opt


def _liger_forward_transient(cfg: ModelConfig, run: Run, rnd) -> int:
    """What lives only while Liger's fused linear CE runs its forward on CUDA (read off
    liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5, and checked against H200 allocator traces), at
    its largest. Always live: the final norm's output (T, H), held by the
    caller; loss_1d (T,) fp32 and the target mask (T,) bool. Under autocast the head weight is cast to
    bf16 twice: `grad_logits @ weight` casts the leaf weight once and autocast caches it for the whole
    forward, while `x @ weight.t()` casts the transposed view, which is not a leaf, anew in each chunk.
    The largest of two moments:
      - the first chunk's `grad_logits @ weight`: its (chunk, V) logits, the cached cast, and the
        (chunk, H) product, a new tensor before it is copied into grad_input (the transposed cast is
        gone by then);
      - a later chunk's logits matmul: both casts and that chunk's logits; the largest later chunk
        is a full one from the third chunk on, else the second, the remainder T - chunk.
    chunk = next_pow2(ceil(T / ceil(V / H))), capped at T (llm_anatomy.kernel_shapes.chunk_rows)."""
    dt = dtypes(run)
    T, H, V, c = run.tokens, cfg.hidden, cfg.vocab, BYTES[dt.compute]
    chunk = chunk_rows(T, H, V)
    cast = rnd(V * H * c) if dt.autocast else 0
    first = rnd(chunk * V * c) + cast + rnd(chunk * H * c)
    later = rnd((chunk if T >= 3 * chunk else T - chunk) * V * c) + 2 * cast if T > chunk else 0
    return rnd(T * H * c) + rnd(T * 4) + rnd(T) + max(first, later)


def _anatomy_forward_transient(cfg: ModelConfig, run: Run, rnd) -> int:
    """What lives only while our fused linear CE (anatomy::linear_cross_entropy) runs its forward on CUDA,
    at its largest: the final norm's output (T, H), held by the caller, and every tensor the op allocates
    but its saved grad_x and grad_w (counted in `saved`), at the loss's final cast, where all of them are
    alive (the byte table: llm_anatomy/kernel_shapes.lce_forward_bytes, the rule's chunk of logits; the
    target mask is gone by then), the loss scalar included. Under autocast the head weight is cast to
    bf16 once, inside the op."""
    dt = dtypes(run)
    c, p = BYTES[dt.compute], BYTES[dt.param]
    b = lce_forward_bytes(run.tokens, cfg.hidden, cfg.vocab, c, p, align=kernel_shapes.LCE_ALIGN)
    alive = sum(rnd(n) for k, n in b.items() if k not in ("valid", "grad_x", "grad_w", "loss_sum"))
    return rnd(run.tokens * cfg.hidden * c) + alive + 2 * rnd(8)  # loss_sum: the fp64 sum and its quotient


def _loss_forward_transient(cfg: ModelConfig, run: Run, rnd) -> int:
    """The fused linear CE's forward transients on CUDA, for the run's loss kernel (Run.loss_impl)."""
    if run.loss_impl == "liger":
        return _liger_forward_transient(cfg, run, rnd)
    return _anatomy_forward_transient(cfg, run, rnd)


def _cached_casts(cfg: ModelConfig, run: Run, rnd, layers: int | None = None) -> int:
    """Under recompute and autocast: the bf16 casts of the qkv, gate_up and down weights of every layer
    (and o's under "full"). Autocast caches a leaf weight's cast until its region ends, after the loss;
    without recompute the matmuls save them (they are in `saved`), inside a checkpoint nobody does, so
    they are extra bytes at the forward's peak and gone by its end (H200 memory probe,
    reports/h200/memory-probe/recompute-*.json: 27 MiB at the seed, 1.41 GiB at anchor-1b; under "full",
    validations/test_recompute_full.py on CPU). layers: that many layers' casts (default: all)."""
    dt = dtypes(run)
    if run.recompute == "none" or not dt.autocast:
        return 0
    H, I, D = cfg.hidden, cfg.intermediate, cfg.q_dim + 2 * cfg.kv_dim
    weights = (D * H,) + (() if cfg.moe else (2 * I * H, I * H)) + ((cfg.q_dim * H,) if run.recompute == "full" else ())
    moe = moe_region.moe_casts(cfg, run, rnd) if cfg.moe else 0  # the router's and the shared experts'
    # qkv's and o's bias casts: addmm saves neither, with or without the checkpoint
    biases = attention_region.bias_casts(cfg, run, rnd)
    return (cfg.layers if layers is None else layers) * (sum(rnd(n * BYTES[dt.compute]) for n in weights) + moe + biases)


def _mlp_region(cfg: ModelConfig, run: Run, rnd) -> int:
    """The largest moment of the last layer's recomputed MLP half in forward, with every weight cast autocast has
    cached by then: the dense MLP's (_mlp_region_transient, every layer's casts), or the MoE block's
    (moe_region.py, which counts the casts it makes; the earlier layers' and this layer's attention's before it)."""
    if not cfg.moe:
        return _mlp_region_transient(cfg, run, rnd) + _cached_casts(cfg, run, rnd)
    return (moe_region.region_peak(cfg, run, rnd) + _cached_casts(cfg, run, rnd) -
            moe_region.moe_casts(cfg, run, rnd))


def _mlp_region_transient(cfg: ModelConfig, run: Run, rnd) -> int:
    """The largest moment of a recomputed MLP half in forward (efficient/mlp.py, MLP.forward's tail):
    inside, the sum x (residual dtype), its normed copy, gate_up, the activation and down's output are
    all live; then x, down's output and the block output x + h."""
    dt = dtypes(run)
    T, H, I, c, r = run.tokens, cfg.hidden, cfg.intermediate, BYTES[dt.compute], BYTES[dt.residual]
    inside = rnd(T * H * r) + rnd(T * H * c) + rnd(T * 2 * I * c) + rnd(T * I * c) + rnd(T * H * c)
    return max(inside, 2 * rnd(T * H * r) + rnd(T * H * c))


def _block_forward_peak(cfg: ModelConfig, run: Run, device: str, rnd) -> int:
    """Under recompute="full", what lives beyond the checkpoints' kept inputs at the largest moment inside
    the last block's forward, where the step's forward peak is unless it is in the loss. Inside a
    checkpoint nothing is saved, so what lives is what the code still holds, every weight and bias cast made
    so far (autocast's cache), the additive masks built so far (the forward's shared masks: _forward_masks) and
    a mixture of experts' stashed statistics (moe_region.stash). The larger of:
      - attention's largest moment (attention_region.py's replay: o's output, or SDPA's, or rope's), the earlier
        layers' casts and masks;
      - the MLP's largest moment (_mlp_region), every layer's casts made and every mask."""
    last = cfg.layers - 1
    builds = has_mask(cfg, last) and frees_mask(cfg, last)  # the first layer of its kind builds its mask
    masks = _forward_masks(cfg, run, rnd)
    before = (_cached_casts(cfg, run, rnd, last) + masks - (_mask_bytes(cfg, run, rnd) if builds else 0)
              + moe_region.stash(cfg, rnd))
    attn = before + max(attention_region.segments(cfg, run, device, rnd, last, builds_mask=builds).values())
    return max(attn, _mlp_region(cfg, run, rnd) + masks)


def _mask_bytes(cfg: ModelConfig, run: Run, rnd) -> int:
    """One additive mask, (S, S + sinks) in the compute dtype."""
    return rnd(run.seq * (run.seq + cfg.attn_sinks) * BYTES[dtypes(run).compute])


def _forward_masks(cfg: ModelConfig, run: Run, rnd) -> int:
    """Under recompute="full", the masks the forward's shared masks hold once every layer has run (no SDPA node
    keeps them inside the checkpoints, so the saved list does not count them); otherwise 0 (saved)."""
    return mask_kinds(cfg) * _mask_bytes(cfg, run, rnd) if run.recompute == "full" else 0


def _head_grad_pad(cfg: ModelConfig, run: Run, rnd) -> int:
    """The bytes lm_head's .grad holds beyond its (V, H): our CE's padded accumulator's rows past V. A tied
    head's gradient is the sum of the CE's and the embedding's, a new (V, H) tensor: no pad (so the CPU run
    holds; the H200 measured 5.9 MB more at the backward's peak of a padded tied step, an open miss of the
    option: docs/peers.md)."""
    V, H, p = cfg.vocab, cfg.hidden, BYTES[dtypes(run).param]
    Vp = V if run.loss_impl == "liger" or cfg.tie_embeddings else lce_vocab(V, kernel_shapes.LCE_ALIGN)
    return rnd(Vp * H * p) - rnd(V * H * p)


def phases(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = None,
           device: str = "cuda", est: Estimate | None = None, stages: bool = True, hist=None) -> dict:
    """Bytes live at each phase boundary of a training step after the first (the optimizer's state
    exists), and the peaks inside forward and backward, on `device` ("cuda": 512-byte blocks; "cpu":
    exact storage sizes). backward_stages lists the walk's candidates in execution order (of identical layers,
    the last two and the first two: backward.walk); stages=False leaves it out (the peak is the same). est:
    the calculator's estimate of this run on this device, where the caller has it. hist: a mixture of experts'
    routing histogram, rows per expert, the same in every layer (default balanced; only the baseline's per-expert
    loop depends on it: calculator/moe.py)."""
    refuse_phases(cfg, run, variant, device)
    if hist is not None and cfg.moe and variant == "baseline":
        from llm_anatomy.calculator.moe import check_histogram
        from llm_anatomy.calculator.moe import baseline as moe_baseline

        hist = check_histogram(cfg, run, hist)
        est = estimate(cfg, run, variant, device=device)
        est.components["moe"] = moe_baseline(cfg, run, device, hist)
    dt = dtypes(run)
    rnd = rounded if device == "cuda" else _exact
    params, opt = model_state_bytes(cfg, variant, dt.param, optimizer, device == "cuda")
    inputs = 2 * rnd(8 * run.tokens)
    est = est or estimate(cfg, run, variant, device=device)
    one, saved = {}, 0  # backward.saved_sizes, and the bytes of every instance
    for c in est.components.values():
        for s in c.saved:
            if s.name not in INPUTS:
                one[s.name] = b = rnd(prod(s.shape) * BYTES[s.dtype])
                saved += b * s.count
    fwd_end = params + inputs + opt + saved + rnd(4)  # + the loss scalar
    fwd_peak = block_peak = None
    if run.recompute != "none":  # what the forward holds before the final norm and the loss save theirs
        after = sum(rnd(prod(s.shape) * BYTES[s.dtype]) * s.count for n in ("loss", "norm")
                    for s in est.components[n].saved if s.name not in INPUTS)
        if run.recompute == "full":  # any device: no loss in it
            block_peak = fwd_end - rnd(4) - after + _block_forward_peak(cfg, run, device, rnd)
    if variant == "baseline":
        T, V, S, c = run.tokens, cfg.vocab, run.seq, dt.compute
        logits = rnd(T * V * BYTES[c]) + (rnd(T * V * 4) if c != "float32" else 0)
        masks = 2 if cfg.window is not None else 1  # the (S, S) causal bias, and a window's beside it
        fwd_peak = fwd_end - rnd(4) + rnd(T * cfg.hidden * BYTES[dt.residual]) + logits + masks * rnd(S * S * BYTES[c])
    elif device == "cuda":
        fwd_peak = fwd_end - rnd(4) + _loss_forward_transient(cfg, run, rnd) + _cached_casts(cfg, run, rnd)
        if run.recompute == "mlp":  # or inside the last layer's MLP checkpoint, before the loss's tensors
            fwd_peak = max(fwd_peak, fwd_end - rnd(4) - after + _mlp_region(cfg, run, rnd))
        elif run.recompute == "full":  # or inside the last block's checkpoint
            fwd_peak = max(fwd_peak + _forward_masks(cfg, run, rnd), block_peak)
    start = {"parameter": params, "input": inputs, "optimizer state": opt, "activation": saved + rnd(4)}
    w = walked(cfg, run, variant, est, start, rnd, one=one, hist=hist if variant == "baseline" else None)
    top = w.top()  # the first largest candidate
    # one gradient per parameter, in the parameter's dtype; our CE's grad_w, lm_head's .grad, keeps the storage
    # of its (V', H) accumulator where the vocabulary is padded (kernel_shapes.LCE_ALIGN)
    grads = params + (_head_grad_pad(cfg, run, rnd) if variant == "efficient" else 0)
    bwd_end = params + inputs + opt + grads
    peak = max(fwd_peak or 0, top.live, fwd_end)
    return dict(params=params, inputs=inputs, optimizer=opt, saved=saved, init=params + inputs + opt,
                forward_end=fwd_end, forward_peak=fwd_peak, forward_peak_last_block=block_peak,
                backward_peak=top.live, backward_peak_at=top.name, backward_peak_by_kind=top.by_kind,
                **({"backward_stages": [dict(name=st.name, live=st.live, by_kind=st.by_kind) for st in w.stages()]}
                   if stages else {}),
                backward_end=bwd_end, optimizer_end=bwd_end - grads, **reserved(peak))


# reserved - the step's peak, as a fraction of the peak: free cached blocks too small or too split for
# the next request (fragmentation). Fitted: the worst of the H200 memory probe's 160 rows (reports/h200/
# memory-probe/, both allocator settings) is 1.37x (hyp2 B4 S1024 baseline, whose fp32 logits leave large
# freed segments behind); the step benchmarks, not used in the fit, sit at 1.02-1.08x.
RESERVED_SLACK = 0.40
RESERVED_FIXED = 128 * 2**20  # segments the process held before the step: cuBLAS/cuBLASLt workspaces


def reserved(peak: int) -> dict:
    """torch.cuda.memory_reserved over a step after the first, the looser figure: what the caching
    allocator holds from the driver. At least the step's peak of allocated bytes; at most that peak
    + RESERVED_SLACK of it + RESERVED_FIXED (the process's own segments from before the step: the
    cuBLAS and cuBLASLt workspaces, 64-86 MiB of reserved memory in the H200 probes' smallest rows).
    A range, not a figure: which blocks stay cached depends on the order of every allocation and free."""
    return dict(reserved_low=peak, reserved_high=int(peak * (1 + RESERVED_SLACK)) + RESERVED_FIXED)
