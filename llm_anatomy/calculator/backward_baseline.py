"""The baseline's backward stages (llm_anatomy/baseline): the loss over full fp32 logits, the eager norm, the
MLP's separate gate and up, and attention over materialised (B, nh, S, S) scores. backward.walk runs them."""
from __future__ import annotations

from llm_anatomy.calculator import backward_moe


def loss(w) -> int:
    """nll_loss_backward makes the fp32 (T, V) gradient, log_softmax's backward a second one."""
    T, V, H, c = w.T, w.V, w.H, w.c
    backward_moe.balance(w)  # the load-balancing loss's, made after the CE's: it runs first
    if w.cuda:
        w.peak("loss", 4, T * V * 4, T * V * 4)
    else:  # on CPU the engine's 0-dim fp32 seed stays live to the end of backward (backward_efficient.loss)
        w.alloc(4)
        w.peak("loss", T * V * 4, T * V * 4)
    w.free("loss.log_probs", "loss.total_weight")
    w.alloc(T * V * c)  # the logits' gradient in the compute dtype (the fp32 ones are gone)
    return w.linear("loss.lm_head", H, V, T * V * c, "loss.", to_residual=True)


def norm(w, tag: str, g_in: int, kept: str | tuple = "norm.") -> int:
    """RMSNorm's backward in eager ops: x̂·g, g·w and the rstd terms in fp32; a bf16 residual adds its fp32
    copies (under bf16 the incoming gradient is first copied to fp32 and then freed). Leaves the input's
    gradient in the residual dtype."""
    T, H, r, p = w.T, w.H, w.r, w.p
    w.peak(tag, *([T * H * 4] * 3 + ([] if r == 4 else [T * H * 4 - T * H * r])))
    w.alloc(T * H * r, H * p)
    w.free_norm()
    w.alloc(-g_in)
    return T * H * r


def qk_norm(w, tag: str) -> None:
    """k_norm's then q_norm's eager backward, as norm()'s over (T·heads) rows of hd, from the compute dtype: each
    takes RoPE's d(k) or d(q) and leaves one of the same size, with its (hd,) weight gradient; its saved go."""
    c, p, hd = w.c, w.p, w.hd
    for name, heads in (("k_norm", w.nkv), ("q_norm", w.nh)):
        n = w.T * heads * hd
        w.peak(tag + "attention." + name, *([n * 4] * 3 + ([] if c == 4 else [n * 4 - n * c])))
        w.alloc(n * c, hd * p)
        w.free(f"attention.{name}.")
        w.alloc(-n * c)


def mlp(w, tag: str, gc: int, I: int, name: str) -> int:
    """The gated MLP's backward (width I, saved names under `name`) from its incoming gradient (gc bytes, freed
    after down); leaves d(x), the sum of gate's and up's input gradients, (T, H) in the residual dtype."""
    T, H, c, r = w.T, w.H, w.c, w.r
    gi = w.linear(tag + name + ".down", I, H, gc, name + ".down.")
    w.peak(tag + name + ".act", T * I * c, T * I * c)  # d(silu(gate)), d(up), d(gate) at once
    w.free(*(f"{name}.{n}" for n in ("gate", "up", "silu_gate", "gate_raw", "up_raw", "up_plus_1")))
    w.alloc(T * I * c, T * I * c, -gi)  # d(gate), d(up) live, d(h) gone
    gu = w.linear(tag + name + ".up", H, I, T * I * c, name + ".up.", to_residual=True)
    gg = w.linear(tag + name + ".gate", H, I, T * I * c, name + ".gate.", to_residual=True)
    w.free(name + ".")  # without autocast gate and up share one saved input ("mlp.gate+up.input")
    w.alloc(T * H * r)  # their sum
    w.peak(tag + name + ".sum")
    w.alloc(-gu, -gg)
    return T * H * r


def layer(w, i: int, g: int) -> int:
    """One block's backward, the MLP branch then the attention branch; returns the residual gradient."""
    T, H, I, c, r = w.T, w.H, w.I, w.c, w.r
    B, S, nh, nkv, hd = w.B, w.S, w.nh, w.nkv, w.hd
    scores, kv_exp = B * nh * S * S, B * nh * S * hd * c  # one S x S tensor; q's size, or k/v expanded
    tag = f"layer {i} "
    w.begin()
    gc = T * H * c if r != c else 0  # the residual gradient cast for the bf16 matmul (a view when r == c)
    w.alloc(gc)
    if w.cfg.moe:  # the MoE branch in place of the MLP's (backward_moe_baseline.py)
        from llm_anatomy.calculator import backward_moe_baseline

        backward_moe_baseline.layer(w, i, tag, gc, mlp)  # the shared experts walk as the dense MLP
    else:
        mlp(w, tag, gc, I, "mlp")
    g = w.residual_add(g, norm(w, tag + "norm 2", T * H * r))
    # ---- attention branch
    w.begin()
    w.alloc(gc)
    go = w.linear(tag + "attention.o", w.cfg.q_dim, H, gc, "attention.o.")  # d(merged heads), (T, H)
    if w.cfg.o_bias:  # o's bias gradient, the column sum of d(out), in the parameter's dtype
        w.alloc(H * w.p)
    w.alloc(T * nh * hd * c, -go)  # made contiguous as (B, nh, S, hd)
    w.alloc(kv_exp, scores * c)  # P@V's backward: d(v) expanded, d(P)
    w.peak(tag + "attention.pv")
    w.free("attention.probs_cast", "attention.v")
    w.alloc(-T * nh * hd * c)
    w.alloc(scores * 4, -scores * c)  # d(P) to fp32
    sinks = w.cfg.attn_sinks
    wide = B * nh * S * (S + sinks)  # with sinks each softmax row has one more logit, the head's sink
    if sinks:  # dropping the sink column's backward: d(P) written into a zero (B, nh, S, S + 1)
        w.alloc(wide * 4, -scores * 4)
    # softmax's backward; on CUDA it first makes tmp = grad * output, a third fp32 (B, nh, S, S [+ 1])
    # (aten/src/ATen/native/cuda/SoftMax.cu, softmax_backward_cuda_out), freed when it returns
    tmp = wide * 4 if w.cuda else 0
    w.alloc(wide * 4, tmp)
    w.peak(tag + "attention.softmax")
    w.alloc(-tmp)
    w.free("attention.probs_fp32")
    # the scores' columns of d(softmax input) (a view) back to the scores' dtype, then scaled; the sink column's
    # sum over batch and positions is the sinks' gradient, in the parameter's dtype
    w.alloc(scores * c, -wide * 4, -wide * 4, nh * w.p if sinks else 0)
    w.alloc(2 * kv_exp)  # QKᵀ's backward: d(q), d(k) expanded
    w.peak(tag + "attention.qk")
    w.free("attention.q", "attention.k")
    w.alloc(-scores * c)
    w.alloc(T * (nh + 2 * nkv) * hd * c)  # d(k), d(v) summed over each group; RoPE's backward for q and k
    w.peak(tag + "attention.rope")
    w.alloc(-kv_exp, -kv_exp, -kv_exp)
    if w.cfg.qk_norm:
        qk_norm(w, tag)
    gq = w.linear(tag + "attention.q", H, nh * hd, T * nh * hd * c, "attention.q.", to_residual=True)
    gk = w.linear(tag + "attention.k", H, nkv * hd, T * nkv * hd * c, "attention.k.", to_residual=True)
    gv = w.linear(tag + "attention.v", H, nkv * hd, T * nkv * hd * c, "attention.v.", to_residual=True)
    # without autocast q, k and v share one saved input ("attention.q+k+v.input")
    w.free("attention.", keep=() if i == 0 else ("attention.rope_",))
    w.alloc(T * H * r)
    w.peak(tag + "attention.sum")
    w.alloc(-gq, -gk, -gv)
    if i == 0:
        w.free("attention.rope_")  # the tables are shared by every layer
    return w.residual_add(g, norm(w, tag + "norm 1", T * H * r))


def embedding(w) -> None:
    """embedding_dense_backward's (V, H) gradient; a tied head's gradient from autograd is a third: the
    sum AccumulateGrad makes when another reference to the .grad exists."""
    V, H, p = w.V, w.H, w.p
    w.alloc(V * H * p)
    if w.cfg.tie_embeddings:
        w.alloc(V * H * p)
    w.peak("embedding")
