"""The kernels of the MoE blocks (llm_anatomy/efficient/moe.py, llm_anatomy/baseline/moe.py) in a training step on
CUDA, in the dense MLP's place: the router, the routing and permutation, the expert GEMMs, the weighted sum and the
shared experts' dense MLP, forward and backward, each with its FLOPs and minimal bytes.

Expert GEMMs are priced per expert row count (the routing histogram: default balanced, calculator/moe.py):
  efficient  torch._grouped_mm over the E experts, one launch per GEMM. The grouped kernel schedules every
             expert's tiles over the SMs at once, so it fills the GPU as one GEMM over all N = T·k rows does,
             whatever the histogram: it is priced at the profile's dense rate of that one GEMM, (N', 2I, H) and
             (N', H, I) (and backward's d(x) and dW shapes), where N' counts each expert's rows rounded up to the
             kernel's tile height (GROUPED_TILE_M: a tile computes its rows whether they exist or not). On an
             H200 the balanced and the skewed histogram took the same time within 1-2% per case (docs/moe.md),
             where pricing each expert's GEMM alone had the skewed step 10-16% faster than measured. The grouped
             kernel's own fraction of that dense rate, per role (forward; d(x) and d(W) in backward), is the
             profile's grouped_mm (anatomy calibrate: calibrate_grouped.py); 1.0 where not calibrated.
  baseline   a loop over the experts with rows: per expert a gather, two matmuls, the eager activation, the
             weighting and index_add, each its own launch; nonzero's host sync per expert.
The router's softmax/top-k, the permutation (argsort, searchsorted, the inverse scatter), the gather, the
unpermute and their backward passes are memory-bound: priced by the bytes they move.
"""
from __future__ import annotations

from collections import Counter

from llm_anatomy.calculator.timing.op_bytes import fused_bytes
from llm_anatomy.calculator.timing.ops import Ops

I64 = 8
GROUPED_TILE_M = 128  # rows per tile of CUTLASS's sm90 grouped GEMM behind torch._grouped_mm


def _rows(o: Ops, hist) -> Counter:
    """{rows: experts with that many rows} of the histogram (default balanced), experts with rows only."""
    from llm_anatomy.calculator.moe import balanced, check_histogram

    h = balanced(o.cfg, o.run) if hist is None else check_histogram(o.cfg, o.run, hist)
    return Counter(n for n in h if n)


def router(o: Ops, lean: bool = False) -> None:
    """The router's matmul, its fp32 routing (softmax over E and top-k, or top-k and a softmax over k; the
    norm_topk division; the load-balancing loss's softmax and mean) and their backward passes."""
    cfg, T, L, c = o.cfg, o.run.tokens, o.cfg.layers, o.c
    E, K, H = cfg.experts, cfg.experts_per_token, cfg.hidden
    TE, TK = T * E * 4, T * K * 4
    o.linear("moe.router", "moe", H, E, L, bias=cfg.router_bias, fp32_grad=lean)
    o.mem("moe.router.logits_fp32", "moe", "forward", T * E * c, TE, L)
    o.mem("moe.router.logits_fp32.backward", "moe", "backward", TE, T * E * c, L)
    softmaxes = 1 + (cfg.router_aux_coef > 0 and cfg.router == "topk-softmax")
    o.mem("moe.router.softmax", "moe", "forward", TE, TE, L * softmaxes)
    o.mem("moe.router.softmax.backward", "moe", "backward", 2 * TE, TE, L * softmaxes)
    o.mem("moe.router.topk", "moe", "forward", TE, TK + T * K * I64, L)
    o.mem("moe.router.topk.backward", "moe", "backward", TK + T * K * I64, TE, L, calls=2 * L)  # zeros, scatter
    if cfg.router == "topk-softmax":  # the softmax over the k logits
        o.mem("moe.router.topk_softmax", "moe", "forward", TK, TK, L)
        o.mem("moe.router.topk_softmax.backward", "moe", "backward", 2 * TK, TK, L)
    elif cfg.norm_topk:  # w / sum(w)
        o.mem("moe.router.norm_topk", "moe", "forward", 2 * TK, TK + T * 4, L, calls=2 * L)
        o.mem("moe.router.norm_topk.backward", "moe", "backward", 4 * TK, 2 * TK, L, calls=5 * L)
    if cfg.router_aux_coef > 0:  # P = mean over the tokens, f from the row ends: small
        o.mem("moe.balance.mean", "moe", "forward", TE, E * 4, L)
        o.mem("moe.balance.mean.backward", "moe", "backward", E * 4, TE, L)


def shared(o: Ops, lean: bool = False) -> None:
    """The shared experts: the efficient dense MLP of width shared_experts x shared_intermediate (gate_up, the
    fused activation, down), and the sum with the routed output."""
    cfg, T, L, c = o.cfg, o.run.tokens, o.cfg.layers, o.c
    if not cfg.shared_experts:
        return
    H, Is = cfg.hidden, cfg.shared_experts * cfg.shared_intermediate
    o.linear("moe.shared.gate_up", "moe", H, 2 * Is, L, fp32_grad=lean)
    for ph, name in (("forward", "moe.shared.swiglu"), ("backward", "moe.shared.swiglu.backward")):
        op = (f"swiglu.{ph}", Is)
        o.mem(name, "moe", ph, *fused_bytes(*op, T, c, o.r), L, host=op[0], fused=(*op, T))
    o.linear("moe.shared.down", "moe", Is, H, L, fp32_grad=lean)
    o.mem("moe.shared.sum", "moe", "forward", 2 * T * H * c, T * H * c, L)
    o.mem("moe.input_grad_sum", "moe", "backward", 2 * T * H * c, T * H * c, L)


def _grouped(o: Ops, name: str, rows: Counter, n: int, k: int, f: int, added: bool = False) -> None:
    """One grouped GEMM (N rows by expert, (n, k) weights per expert, k + f with a folded bias), forward and
    backward: the forward (N', n, k) and d(x) (N', k, n) each as one dense GEMM over the tile-rounded rows N' (the
    module's docstring); d(W) as what it is, each expert's own (n, k) reduction over its n_e rows, a batch of
    (n, k, n_e) GEMMs per distinct row count (short reductions run below the rate: the profile's k_half). One
    launch (host) per grouped GEMM. added: a bias added after it (efficient/moe.py's ExpertBias): the gather of
    each row's bias and the in-place add; in backward a ones block, d(bias) as the same per-expert reduction at
    width 8, and its first row's copy."""
    L, E, c, p = o.cfg.layers, o.cfg.experts, o.c, o.p
    N = sum(r * experts for r, experts in rows.items())
    m = sum(-(-r // GROUPED_TILE_M) * GROUPED_TILE_M * experts for r, experts in rows.items())  # fit.grouped_rows
    o.mm(name, "moe", "forward", m, n, k + f, L, host="op", grouped="forward")
    o.mm(f"{name}.grad_input", "moe", "backward", m, k + f, n, L, host="op", grouped="backward")
    for i, (r, experts) in enumerate(sorted(rows.items())):
        o.mm(f"{name}.grad_weight", "moe", "backward", n, k + f, r, L, batch=experts,
             host="op" if i == 0 else None, grouped="backward")
    if added:
        from llm_anatomy.calculator.moe_efficient import FOLD

        o.mem(f"{name}.bias_gather", "moe", "forward", E * n * c + N * 4, N * n * c, L)
        o.mem(f"{name}.bias_add", "moe", "forward", 2 * N * n * c, N * n * c, L)
        o.mem(f"{name}.grad_bias_ones", "moe", "backward", 0, N * FOLD * c, L)
        for i, (r, experts) in enumerate(sorted(rows.items())):
            o.mm(f"{name}.grad_bias", "moe", "backward", FOLD, n, r, L, batch=experts,
                 host="op" if i == 0 else None, grouped="backward")
        o.mem(f"{name}.grad_bias_copy", "moe", "backward", E * n * c, E * n * c, L)
    if o.amp:  # the stacked weight's cast, and dW's back to fp32
        o.mem(f"{name}.weight_cast", "moe", "forward", E * n * k * p, E * n * (k + f) * c, L)
        o.mem(f"{name}.grad_weight_cast", "moe", "backward", E * n * (k + f) * c, E * n * k * p, L, upcast=True)


def efficient_moe(o: Ops, hist=None) -> None:
    """The efficient block (llm_anatomy/efficient/moe.py) on its grouped-GEMM path, L layers."""
    from llm_anatomy.calculator.moe_efficient import added_bias, fold

    cfg, run, c = o.cfg, o.run, o.c
    T, L, H, E, K, I = run.tokens, cfg.layers, cfg.hidden, cfg.experts, cfg.experts_per_token, cfg.expert_intermediate
    N, lean = T * K, run.lean_block
    f, added = fold(cfg, run), added_bias(cfg, run)  # the grouped path (the phases refuse the loop of mm)
    router(o, lean)
    # the permutation: a stable argsort of the N expert ids, their gather, searchsorted, the inverse scatter
    o.mem("moe.permute.argsort", "moe", "forward", 3 * N * I64, 3 * N * I64, L, calls=3 * L)
    o.mem("moe.permute.index", "moe", "forward", 3 * N * I64 + E * I64, 2 * N * I64 + E * 4, L, calls=4 * L)
    o.mem("moe.permute.gather", "moe", "forward", N * H * c + N * I64, N * H * c, L)
    o.mem("moe.permute.backward", "moe", "backward", N * H * c + N * I64, T * H * c, L)  # the sum over k rows
    if f:  # the folded bias: x and h with a ones column block, each weight with its bias column
        o.mem("moe.experts.fold", "moe", "forward", N * (H + I) * c, N * (H + I + 2 * f) * c, L, calls=2 * L)
    if added:  # each row's expert: an arange and its searchsorted over offs
        o.mem("moe.experts.bias_rows", "moe", "forward", N * 4 + E * 4, 2 * N * 4, L, calls=2 * L)
    rows = _rows(o, hist)
    _grouped(o, "moe.experts.gate_up", rows, 2 * I, H, f, added)
    for ph, name in (("forward", "moe.experts.swiglu"), ("backward", "moe.experts.swiglu.backward")):
        op = (f"swiglu.{ph}", I)
        o.mem(name, "moe", ph, *fused_bytes(*op, N, c, o.r), L, host=op[0], fused=(*op, N))
    _grouped(o, "moe.experts.down", rows, H, I, f, added)
    o.mem("moe.unpermute", "moe", "forward", N * H * c + N * I64 + T * K * 4, T * H * c, L)
    o.mem("moe.unpermute.backward", "moe", "backward", T * H * c + N * H * c + N * I64 + T * K * 4,
          N * H * c + T * K * 4, L)
    o.mem("moe.router_grad_sum", "moe", "backward", 2 * T * H * c, T * H * c, L)  # the permute's d(x) and the router's
    shared(o, lean)


def _expert_linear(o: Ops, name: str, n: int, d_in: int, d_out: int, count: int, host: bool) -> None:
    """One expert's matmul on its n rows (a slice of the stacked weight): forward, d(x) and dW; under autocast
    the slice's cast and dW's copy to fp32; the slice's backward writes dW into a zero of the stacked weight,
    which is summed into its gradient (out of place: read two, write one). With expert biases the same for the
    bias slice (E, d_out), which addmm reads, and its gradient, a sum over the n rows of the output's."""
    E, c, p = o.cfg.experts, o.c, o.p
    h = "op" if host else None
    slices = (("weight", "", d_out * d_in),) + ((("bias", "bias_", d_out),) if o.cfg.expert_bias else ())
    if o.amp:
        for what, _, size in slices:
            o.mem(f"{name}.{what}_cast", "moe", "forward", size * p, size * c, count)
            o.mem(f"{name}.grad_{what}_cast", "moe", "backward", size * c, size * p, count, upcast=True)
    o.mm(name, "moe", "forward", n, d_out, d_in, count, host=h, extra=d_out * c if len(slices) > 1 else 0)
    o.mm(f"{name}.grad_input", "moe", "backward", n, d_in, d_out, count, host=h)
    o.mm(f"{name}.grad_weight", "moe", "backward", d_out, d_in, n, count, host=h)
    if len(slices) > 1:
        o.mem(f"{name}.grad_bias", "moe", "backward", n * d_out * c, d_out * c, count)
    for what, prefix, size in slices:
        stacked = E * size * p
        o.mem(f"{name}.{prefix}select_backward", "moe", "backward", size * p, stacked, count, calls=2 * count)
        o.mem(f"{name}.{prefix}grad_sum", "moe", "backward", 2 * stacked, stacked, count)


def baseline_moe(o: Ops, mlp, hist=None) -> None:
    """The baseline block (llm_anatomy/baseline/moe.py), L layers: the router, then for every expert torch.where
    over the choices (a host sync: nonzero's size; the loop skips an expert only after it), and per expert with
    rows (one launch each, its n rows): the gather of its rows, gate_up, the eager activation, down, the weighting
    and the index_add into the output (out of place: the (T, H) output read and written); backward the same in
    reverse, each gradient summed into its tensor's."""
    cfg, run, c, r = o.cfg, o.run, o.c, o.r
    T, L, H, K, I = run.tokens, cfg.layers, cfg.hidden, cfg.experts_per_token, cfg.expert_intermediate
    router(o)
    rows = _rows(o, hist)
    empty = cfg.experts - sum(rows.values())
    if empty:  # an expert no token chose still runs its where (and its sync) before the loop skips it
        o.mem("moe.expert.where", "moe", "forward", T * K * 8, 0, L * empty, sync=True, calls=3 * L * empty)
    for m, experts in sorted(rows.items()):
        k = L * experts
        o.mem("moe.expert.where", "moe", "forward", T * K * 8, m * 16, k, sync=True, calls=3 * k)
        o.mem("moe.expert.gather", "moe", "forward", m * H * r + m * I64, m * H * r, k)
        o.mem("moe.expert.gather.backward", "moe", "backward", m * H * r + m * I64, T * H * r, k, calls=2 * k)
        o.mem("moe.expert.input_grad_sum", "moe", "backward", 2 * T * H * r, T * H * r, k)
        if o.amp:  # F.linear casts the fp32 rows
            o.mem("moe.expert.input_cast", "moe", "forward", m * H * r, m * H * c, k)
            o.mem("moe.expert.input_cast.backward", "moe", "backward", m * H * c, m * H * r, k, upcast=r > c)
        _expert_linear(o, "moe.expert.gate_up", m, H, 2 * I, k, True)
        chains = ("eager_mlp",) + (("eager_clamp",) if cfg.mlp == "gpt-oss" else ())  # gpt-oss's clamps and +1
        for ph in ("forward", "backward"):
            for op in (f"{ch}.{ph}" for ch in chains):
                o.chain(op, "moe.expert.", "moe", ph, I, m, k, fused=(op, I, m) if c == 2 else ())
        o.mem("moe.expert.chunk.backward", "moe", "backward", 2 * m * I * c, 2 * m * I * c, k)  # cat
        _expert_linear(o, "moe.expert.down", m, I, H, k, True)
        o.mem("moe.expert.weighting", "moe", "forward", m * H * c + m * 4, m * H * c + m * c, k, calls=3 * k)
        o.mem("moe.expert.weighting.backward", "moe", "backward", 3 * m * H * c, 2 * m * H * c + m * 4, k, calls=5 * k)
        o.mem("moe.expert.weight_index.backward", "moe", "backward", m * 4, T * K * 4, k, calls=3 * k)
        o.mem("moe.expert.index_add", "moe", "forward", T * H * c + m * H * c, T * H * c, k)
        o.mem("moe.expert.index_add.backward", "moe", "backward", m * H * c + m * I64, m * H * c, k)
    if cfg.shared_experts:
        mlp(o, "moe.shared", "moe", cfg.shared_experts * cfg.shared_intermediate)
        o.mem("moe.shared.sum", "moe", "forward", 2 * T * H * c, T * H * c, L)
        o.mem("moe.input_grad_sum", "moe", "backward", 2 * T * H * r, T * H * r, L)


# forward kernels of the efficient block that a checkpoint's re-run in backward does not launch: the load-balancing
# mean (the re-run stashes no statistics: efficient/moe.py), and by the early stop, where the shared experts follow
# the routed ones, the shared down matmul (its inputs are saved before it runs) and the sum after it
NOT_RERUN = ("moe.balance.mean", "moe.shared.down", "moe.shared.sum")


def efficient_moe_recompute(o: Ops, hist=None) -> None:
    """Run.recompute: the block's forward kernels launched again in backward (backward_moe_recompute.py), each at its
    forward FLOPs and bytes, named with ".recompute", but NOT_RERUN's. Without shared experts the unpermute is the
    last: its output is made before its inputs are saved, so every forward kernel runs again."""
    fwd = Ops(o.cfg, o.run)
    efficient_moe(fwd, hist)
    o.k += [k._replace(name=k.name + ".recompute", phase="backward") for k in fwd.k
            if k.phase == "forward" and k.name not in NOT_RERUN]
