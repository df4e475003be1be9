"""The efficient MoE block's backward stages (llm_anatomy/efficient/moe.py, its grouped-GEMM path), as
backward_efficient.layer runs them in place of the dense MLP's. Read off op-by-op traces of the live storages on
CPU (llm_anatomy.measure.liveness), in autograd's order: the nodes made last run first.

  shared    the shared experts' dense MLP (made last in forward): down, the in-place SwiGLU, gate_up; its d(x)
            stays until the permute's joins it
  unpermute d(y) (N, H) and d(w) (T, K) fp32; the branch gradient, y and (softmax-topk) the weights go
  down      (a bias added after the GEMM: its gradient, a ones (8, N) times d(y) per expert, (E, 8, H), of which
            the first row is copied out) the grouped GEMM's weight gradient (E, H, I') in c, then d(h) (N, I');
            d(y), h and the weight cast go;
            the weight gradient is copied to fp32 under autocast (I' = I + 8 with a folded bias: the bias's
            gradient is a view of the same storage, which lives until the bias's own cast node copies it, after
            gate_up's weight copy)
  act       the SwiGLU writes d(gate_up) over the saved gate_up; d(h) goes
  gate_up   the same as down, with d(xs) (N, H'); offs goes with the GEMM's saved tensors
  permute   the unpermute kernel at weight 1: a ones (T, K) in c and d(x) (T, H); d(xs), the ones and pos go
  router    the load-balancing loss's d(P) over every token (T, E) fp32 first (made last in forward), then the
            weights' division (norm_topk), top-k's scatter into a zero (T, E), the softmax, the fp32 logits' cast
            back to c, and the router's matmul, whose d(x) is summed with the permute's into the norm's gradient.
The load-balancing loss's (L, E) fp32 d(P) is made at the loss and lives until the first layer's router reads it.
"""
from __future__ import annotations

from llm_anatomy.calculator import backward_moe_recompute


def balance(w) -> None:
    """The load-balancing loss's backward at the loss: d(P) for every layer, stacked (L, E) fp32; f goes."""
    if w.cfg.router_aux_coef > 0:
        w.free("moe.balance.f", "moe.aux.f")  # the efficient model's name, the baseline's
        w.alloc(w.cfg.layers * w.cfg.experts * 4)


def _fold(w) -> int:
    from llm_anatomy.calculator.moe_efficient import fold

    return fold(w.cfg, w.run, w.est.device)


def _added_bias(w, tag: str, width: int) -> None:
    """A bias added after the grouped GEMM (efficient/moe.py's ExpertBias, no autocast), its backward first: a
    ones (8, N) and the (E, 8, width) grouped GEMM against d(out), whose first row is copied out as the bias's
    gradient (E, width) in the parameter dtype; the ones and the GEMM's output go."""
    from llm_anatomy.calculator.moe_efficient import FOLD, added_bias

    if not added_bias(w.cfg, w.run, w.est.device):
        return
    E, N, c = w.cfg.experts, w.T * w.cfg.experts_per_token, w.c
    w.alloc(N * FOLD * c, E * FOLD * width * c, E * width * w.p)
    w.peak(tag + " bias")
    w.alloc(-N * FOLD * c, -E * FOLD * width * c)


def layer(w, i: int, tag: str, gc: int, swiglu_down, rerun_attention) -> int:
    """The MoE branch's backward from its incoming gradient (gc bytes, 0 where it is a view of the residual's);
    returns the bytes of the gradient it hands the norm (T, H) in c. swiglu_down, rerun_attention: the dense
    block's stages (backward_efficient's), passed in so this module does not import it."""
    cfg, T, H, c, p = w.cfg, w.T, w.H, w.c, w.p
    E, K, I = cfg.experts, cfg.experts_per_token, cfg.expert_intermediate
    N, f, TH = T * K, _fold(w), T * H * c
    if w.recompute != "none":  # the checkpoint's re-run makes the block's saved tensors again
        backward_moe_recompute.rerun(w, i, tag, rerun_attention)
    dx = 0  # the (T, H) input gradients made so far, summed as they join
    if cfg.shared_experts:
        _shared(w, tag, cfg.shared_experts * cfg.shared_intermediate, swiglu_down)
        dx = TH
    w.alloc(N * H * c, T * K * 4)  # d(y), d(w)
    w.peak(tag + "moe.unpermute")
    w.free("moe.unpermute.y", *(("moe.router.weights",) if cfg.router == "softmax-topk" else ()))
    w.alloc(-gc)
    held = []  # bf16 weight gradients a folded bias's view holds until its cast node runs
    _added_bias(w, tag + "moe.experts.down", H)
    _gemm(w, tag + "moe.experts.down", E * H * (I + f), N * (I + f) * c, N * H * c, "moe.experts.h",
          "moe.experts.down.weight_cast", E * H * I, held)
    w.free("moe.activation.gate_up")  # d(gate_up) written over it: the same bytes change kind
    w.alloc(N * 2 * I * c)
    w.peak(tag + "moe.activation")
    w.alloc(-N * (I + f) * c)
    _added_bias(w, tag + "moe.experts.gate_up", 2 * I)
    _gemm(w, tag + "moe.experts.gate_up", E * 2 * I * (H + f), N * (H + f) * c, N * 2 * I * c, "moe.experts.xs",
          "moe.experts.gate_up.weight_cast", E * 2 * I * H, held, "moe.experts.offs")
    for width, wg in zip((H, 2 * I), held):  # the biases' casts: down's made last, so run first
        w.alloc(E * width * p)
        w.peak(tag + "moe.experts.bias grad to fp32")
        w.alloc(-wg)
    w.alloc(T * K * c, TH)  # the permute's backward: a ones (T, K) and d(x)
    w.peak(tag + "moe.permute")
    w.alloc(-T * K * c, -N * (H + f) * c)
    w.free("moe.unpermute.pos")
    if dx:  # the shared MLP's d(x) joins
        w.alloc(TH)
        w.peak(tag + "moe.input grad sum")
        w.alloc(-TH, -TH)
    wg = router(w, i, tag)
    w.alloc(-TH)  # its d(x) is summed into the permute's in place of both
    weight_copy(w, tag, wg)
    return TH


def weight_copy(w, tag: str, wg: int) -> None:
    """Under autocast the router's weight (and bias) gradient, wg bytes in c, copied to the parameter dtype."""
    if w.amp:
        E, p = w.cfg.experts, w.p
        w.alloc(E * w.H * p + (E * p if w.cfg.router_bias else 0))
        w.peak(tag + "moe.router grad to fp32")
        w.alloc(-wg)


def _gemm(w, tag: str, weight: int, d_in: int, grad_out: int, x: str, cast: str, param: int, held: list,
          *more: str) -> None:
    """A grouped GEMM's backward: the weight gradient (`weight` elements, in c), then the input's (d_in bytes);
    grad_out, the input x and the weight cast go; under autocast the weight's (param elements) copy to the
    parameter dtype, the compute-dtype gradient held while a folded bias's view of it waits (held)."""
    c, p = w.c, w.p
    w.alloc(weight * (c if w.amp else p), d_in)
    w.peak(tag)
    w.free(x, cast, *more)
    w.alloc(-grad_out)
    if w.amp:
        w.alloc(param * p)
        w.peak(tag + " grad to fp32")
        if weight != param:
            held.append(weight * c)
        else:
            w.alloc(-weight * c)


def _shared(w, tag: str, Is: int, swiglu_down) -> None:
    """The shared experts' efficient dense MLP, from the branch gradient, which stays (the unpermute reads it);
    in the lean block its lean form (backward_efficient.swiglu_down, gate_up's lean matmul)."""
    T, c = w.T, w.c
    if w.lean:
        swiglu_down(w, tag, 0, Is, "moe.shared")
        w.linear(tag + "moe.shared.gate_up", w.H, 2 * Is, 2 * T * Is * c, "moe.shared.gate_up.", recast=w.amp)
        return
    gi = w.linear(tag + "moe.shared.down", Is, w.H, 0, "moe.shared.down.", "moe.shared.h")
    w.free("moe.shared.gate_up")
    w.alloc(2 * T * Is * c)
    w.peak(tag + "moe.shared.act")
    w.alloc(-gi)
    w.linear(tag + "moe.shared.gate_up", w.H, 2 * Is, 2 * T * Is * c, "moe.shared.gate_up.")


def balance_mean(w, i: int) -> None:
    """P = mean(probs)'s backward: d(probs) (T, E) fp32 over every token; the first layer reads the stacked
    d(P) for the last time."""
    w.alloc(w.T * w.cfg.experts * 4)
    if i == 0:
        w.alloc(-w.cfg.layers * w.cfg.experts * 4)


def router(w, i: int, tag: str, mean_done: bool = False) -> int:
    """The router's backward, from d(w) (T, K) fp32 to the router matmul's d(x) (T, H) in c, which the caller sums
    (module docstring). mean_done: the load-balancing loss's mean has made d(probs) already (the baseline block,
    where it is made last in forward). Returns the bytes of the weight gradient in c, which weight_copy takes to
    the parameter dtype under autocast."""
    cfg, T, H, c, p = w.cfg, w.T, w.H, w.c, w.p
    E, K = cfg.experts, cfg.experts_per_token
    TE, TK = T * E * 4, T * K * 4
    aux = cfg.router_aux_coef > 0
    if aux and not mean_done:
        balance_mean(w, i)
    if cfg.router == "topk-softmax":
        if aux:  # the load-balancing loss's own softmax over every expert
            w.alloc(TE)
            w.peak(tag + "moe.router.balance softmax")
            w.free("moe.router.softmax")
            w.alloc(-TE)
        w.alloc(TK)  # the softmax over the k logits
        w.peak(tag + "moe.router.softmax")
        w.free("moe.router.weights")
        w.alloc(-TK)
    elif cfg.norm_topk:  # w = v / sum(v): the division's terms, at most four (T, K) at once
        w.peak(tag + "moe.router.division", TK, TK, TK, TK)
        w.free("moe.router.topk_values", "moe.router.topk_sum")
    w.alloc(TE, TE)  # top-k's backward: a zero (T, E) and the scatter into it
    w.peak(tag + "moe.router.topk")
    w.alloc(-TE)
    if aux:
        w.alloc(TE)
        w.peak(tag + "moe.router.balance sum")
        w.alloc(-TE, -TE)
    w.alloc(-TK)
    w.free("moe.router.topk_indices")
    if cfg.router == "softmax-topk":
        w.alloc(TE)  # softmax's backward
        w.peak(tag + "moe.router.softmax")
        w.free("moe.router.softmax")
        w.alloc(-TE)
    if c != 4:  # the logits' cast to fp32, back to c
        w.alloc(T * E * c)
        w.alloc(-TE)
    copy = w.amp
    wg = E * H * (c if copy else p) + (E * (c if copy else p) if cfg.router_bias else 0)
    w.alloc(wg, T * H * c)  # the router's weight (and bias) gradient, its d(x)
    w.peak(tag + "moe.router")
    w.free(*(n for n in w.one if n.startswith("moe.router")))  # its input (or cast, or the shared input) and cast
    w.alloc(-T * E * c)  # d(logits)
    return wg
