"""The baseline MoE block's backward stages (llm_anatomy/baseline/moe.py: the per-expert loop), as
backward_baseline.layer runs them in place of the dense MLP's. Read off op-by-op traces of the live storages on
CPU (llm_anatomy.measure.liveness), in autograd's order: the nodes made last run first.

  balance   the load-balancing loss's P = mean(probs) (made last in forward): d(probs) (T, E) fp32, live until
            the router's softmax reads it
  shared    the shared experts' dense MLP (backward_baseline.mlp); its d(x) (T, H) waits in the block input's
            gradient until the experts' and the router's join it
  experts   one expert at a time, the last expert with rows first, each on its n rows:
              index_add's backward gathers the n rows of the branch gradient; the weighting's product gives d(y)
              and d(w) for the n rows, which the routing weights' index writes into a zero (T, K) fp32, summed
              into the weights' gradient; down's matmul: dW (H, I) and d(h) (n, I), dW copied to fp32 under
              autocast and written into a zero (E, H, I) by the slice's backward, summed into the stacked
              weight's gradient; the activation; gate_up's matmul, the same with (E, 2I, H); the gathered
              input's d(x) (n, H), written into a zero (T, H) in the residual dtype and summed into the block
              input's gradient. Each sum is autograd's InputBuffer's: in place on CUDA, out of place under the
              CPU's instrument (backward.Walk.input_buffer_sum).
            The branch gradient goes with the last index_add's backward (the first expert with rows).
  router    backward_moe.router, then its d(x) summed into the experts' (and the shared MLP's) gradient.
The per-expert tensors follow that expert's row count: the histogram decides the peak (the largest expert's
transients, and the saved tensors of the experts not yet walked).
"""
from __future__ import annotations

from llm_anatomy.calculator import backward_moe


def layer(w, i: int, tag: str, gc: int, mlp) -> None:
    """The MoE branch's backward from its incoming gradient (gc bytes, 0 where it is a view of the residual's);
    leaves the block input's gradient (T, H) in the residual dtype for the norm, which frees it."""
    from llm_anatomy.calculator.moe import balanced

    cfg, T, H, r = w.cfg, w.T, w.H, w.r
    hist = w.hist or balanced(cfg, w.run)
    if cfg.router_aux_coef > 0:
        backward_moe.balance_mean(w, i)
    shared = cfg.shared_experts * (cfg.shared_intermediate or 0)
    if shared:
        mlp(w, tag, 0, shared, "moe.shared")  # the branch gradient stays: the experts read it
    hit = [e for e in range(cfg.experts) if hist[e]][::-1]
    for j, e in enumerate(hit):
        _expert(w, tag + f"moe.expert {e} ", hist[e], j > 0, gc if j == len(hit) - 1 else 0)
    wg = backward_moe.router(w, i, tag, mean_done=True)
    c = w.c
    if w.amp:  # its d(x) back to the residual dtype
        w.alloc(T * H * r)
        w.alloc(-T * H * c)
        w.alloc(T * H * r)  # summed with the experts'
        w.peak(tag + "moe.input grad sum")
        w.alloc(-2 * T * H * r)
    else:
        w.alloc(T * H * r)
        w.peak(tag + "moe.input grad sum")
        w.alloc(-T * H * c, -T * H * r)
    backward_moe.weight_copy(w, tag, wg)
    if shared:  # the view's gradient joins the shared MLP's in the block input's
        w.alloc(T * H * r)
        w.peak(tag + "moe.shared input grad sum")
        w.alloc(-2 * T * H * r)


def _expert(w, tag: str, n: int, accumulate: bool, branch: int) -> None:
    """One expert's backward on its n rows (module docstring). accumulate: an expert walked before it left the
    stacked weights', the routing weights' and the input's gradients, which this one's are summed into. branch:
    the bytes of the branch gradient, freed after this expert's index_add (the last one run)."""
    cfg, T, H, c, r, p = w.cfg, w.T, w.H, w.c, w.r, w.p
    E, K, I = cfg.experts, cfg.experts_per_token, cfg.expert_intermediate
    nH, nI = n * H * c, n * I * c

    def drop(*nbytes: int) -> None:  # saved tensors of this expert (sized by n, not by name)
        w.act -= sum(nbytes)

    w.alloc(nH)  # index_add's backward: the n rows of the branch gradient
    drop(nH)  # its saved source (the weighted output)
    w.alloc(-branch)
    w.alloc(nH, nH, n * c)  # the weighting: d(y), d(w)'s product and its row sum
    w.peak(tag + "weighting")
    w.alloc(-nH, -nH)  # the rows gathered, the product
    drop(nH, n * c)  # y and the routing weight, which the product kept
    if w.amp:  # d(w) back to fp32
        w.alloc(n * 4, -n * c)
    dw = n * (4 if w.amp else c)
    w.alloc(T * K * 4, T * K * 4)  # the index's backward: a zero (T, K) fp32 and the rows written into it
    w.peak(tag + "routing weights")
    w.alloc(-T * K * 4, -dw)
    if accumulate:
        w.input_buffer_sum(tag + "routing weights sum", T * K * 4)
    # down: dW (H, I), d(h) (n, I) (and the bias's (H,)); d(y), h and the weight slice's cast go
    bias = cfg.expert_bias
    _linear(w, tag + "down", H * I, nI, nH, (nI, H * I * c if w.amp else 0), E * H * I * p, accumulate,
            bias=H if bias else 0)
    (_gpt_oss if cfg.mlp == "gpt-oss" else _swiglu)(w, tag, n * I, drop)
    # gate_up: dW (2I, H), d(x) (n, H); d(gate_up), x and the slice's cast go; d(x) back to the residual dtype
    _linear(w, tag + "gate_up", 2 * I * H, nH, 2 * nI, (nH, 2 * I * H * c if w.amp else 0), E * 2 * I * H * p,
            accumulate, n * H * r if w.amp else 0, bias=2 * I if bias else 0)
    if bias:  # the bias slices' backward (made first in forward, so run last): down's, then gate_up's
        for width in (H, 2 * I):
            w.alloc(E * width * p)  # a zero (E, width) with the row written in
            w.peak(tag + "bias select")
            w.alloc(-width * (4 if w.amp else p))  # the row
            if accumulate:
                w.input_buffer_sum(tag + "bias sum", E * width * p)
    # index_select's backward: a zero (T, H) and the rows added into it; d(x) and the row indices go
    w.alloc(T * H * r, T * H * r)
    w.peak(tag + "input rows")
    w.alloc(-T * H * r, -n * H * r)
    drop(n * 2 * 8)
    if accumulate:
        w.input_buffer_sum(tag + "input grad sum", T * H * r)


def _swiglu(w, tag: str, m: int, drop) -> None:
    """silu(gate) * up's backward on m = n·I elements, from d(h): d(gate_up) (the chunk's cat) left for gate_up."""
    c = w.c
    w.alloc(m * c, m * c)  # d(silu(gate)) and d(up)
    drop(m * c)  # silu(gate)
    w.alloc(-m * c)  # d(h)
    w.alloc(m * c)  # d(gate)
    w.peak(tag + "activation")
    drop(2 * m * c)  # gate_up, which silu's gate kept
    w.alloc(-m * c)  # d(silu(gate))
    w.alloc(2 * m * c)  # the chunk's backward: d(gate_up)
    w.peak(tag + "activation cat")
    w.alloc(-2 * m * c)  # d(gate), d(up)


def _gpt_oss(w, tag: str, m: int, drop) -> None:
    """silu(clamp(gate)) * (clamp(up) + 1)'s backward on m = n·I elements, from d(h): the product's two gradients
    (its saved silu and up + 1 go with d(h)), silu's (the clamped gate goes), then each clamp's, up's first, as
    where(mask, grad, 0) with a 0-dim zero and bool masks (two for up's two bounds, one for gate's); each clamp's
    incoming gradient goes after it; the raw gate_up, which the clamps kept, goes; the chunk's cat."""
    c = w.c
    w.alloc(m * c, m * c)  # d(silu), d(up + 1)
    w.peak(tag + "activation")
    drop(2 * m * c)
    w.alloc(-m * c)  # d(h)
    w.alloc(m * c)  # d(clamped gate)
    w.peak(tag + "activation silu")
    drop(m * c)
    w.alloc(-m * c)  # d(silu)
    for name, masks in (("up", 2), ("gate", 1)):
        w.alloc(c, *[m] * masks, m * c)
        w.peak(tag + f"activation clamp {name}")
        w.alloc(-c, *[-m] * masks, -m * c)  # the zero, the masks, the incoming gradient
    drop(2 * m * c)  # the raw gate_up, once both clamps have run
    w.alloc(2 * m * c)  # the chunk's backward: d(gate_up)
    w.peak(tag + "activation cat")
    w.alloc(-2 * m * c)  # d(gate), d(up)


def _linear(w, tag: str, weight: int, d_in: int, grad_out: int, saved: tuple[int, int], stacked: int,
            accumulate: bool, d_in_copy: int = 0, bias: int = 0) -> None:
    """An expert's matmul on its rows: dW (`weight` elements) and d(x) (d_in bytes), and with a bias (`bias`
    elements) its gradient, the rows' sum; the incoming gradient and its saved input and weight cast (saved bytes)
    go; d_in_copy: d(x)'s copy to the residual dtype; under autocast dW's copy to fp32, then the bias's (which
    waits, in fp32, for the bias slice's backward at the expert's end); the slice's backward writes dW into a
    zero of the stacked weight (stacked bytes), summed into the weight's gradient."""
    c, p = w.c, w.p
    wg = weight * (c if w.amp else p)
    w.alloc(wg, d_in, bias * c)
    w.peak(tag)
    w.alloc(-grad_out)
    w.act -= sum(saved)
    if d_in_copy:
        w.alloc(d_in_copy, -d_in)
    if w.amp:
        w.alloc(weight * p)
        w.peak(tag + " grad to fp32")
        if bias:
            w.alloc(bias * 4, -bias * c)
    w.alloc(stacked, -wg)  # the slice's backward; the compute-dtype dW goes
    w.peak(tag + " select")
    if w.amp:
        w.alloc(-weight * p)
    if accumulate:
        w.input_buffer_sum(tag + " sum", stacked)

