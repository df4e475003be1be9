"""The efficient model's backward stages (llm_anatomy/efficient): the fused linear CE hands back what its
forward made, the fused norm's row pass and dw partials, the packed SwiGLU writing d(gate_up) in place, and
SDPA's backward; in the lean block (Run.lean) the weight casts and SwiGLU's h made again; under
recompute, the checkpoints' tensors made again. backward.walk runs them."""
from __future__ import annotations

from llm_anatomy.calculator import backward_moe
from llm_anatomy.calculator import attention_fields, attention_region
from llm_anatomy.calculator.attention import frees_mask, qk_norm_saved_efficient, sdpa_o_saved
from llm_anatomy.calculator.linear import linears_saved
from llm_anatomy.calculator.mlp import efficient_saved
from llm_anatomy.kernel_shapes import rms_norm_programs


def loss(w) -> int:
    T, H, V, c, p = w.T, w.H, w.V, w.c, w.p
    backward_moe.balance(w)  # the load-balancing loss's, made after the CE's: it runs first
    if w.run.loss_impl == "liger" and not w.cuda:
        # Liger's CPU mirror returns grad_input·g and grad_weight·g: new tensors, then the saved ones go;
        # g itself, the engine's 0-dim fp32 seed, stays live to the end of backward
        w.alloc(4, T * H * c, V * H * p)
        w.peak("loss")
        w.free("loss.")
    else:
        # ours (both devices) and Liger's on CUDA hand back what forward made, scaled in place by the seed g
        # (Liger's only when g is not 1, which it compares against a new 0-dim tensor): no new (T, H) or
        # (V, H) buffer. On CPU g is counted live to the end of backward, as above
        if w.cuda:
            w.peak("loss", *((4, 4) if w.run.loss_impl == "liger" else (4,)))
        else:
            w.alloc(4)
            w.peak("loss")
        # grad_input's storage flows on as the final norm's incoming gradient (freed with it); grad_weight's
        # becomes lm_head's .grad, still the storage forward allocated: counted as an activation, as the
        # forensics replay credits a storage to the phase that allocated it
        w.free("loss.grad_input")
        w.alloc(T * H * c)
    return T * H * c


def norm(w, tag: str, g_in: int, kept: str | tuple = "norm.", fused: bool | None = None) -> int:
    """RMSNorm's backward: takes the output's gradient, leaves the input's (residual dtype). kept: what goes
    with it ("norm.": its own saved x; under recompute, the checkpoint's tensors). fused (default: in the lean
    block, every norm but the first): add_rms_norm's backward, which also writes the branch's gradient
    (T, H) in the compute dtype, the one the branch's backward starts from (layer() allocates no cast)."""
    T, H, c, r, p = w.T, w.H, w.c, w.r, w.p
    db = T * H * c if (w.lean if fused is None else fused) else 0
    if w.cuda:  # the Triton backward: dx (and d_branch), the (programs, H) fp32 dw partials, dw
        w.alloc(T * H * r, db, rms_norm_programs(H, T) * H * 4, H * p)
        w.peak(tag)
        w.alloc(-rms_norm_programs(H, T) * H * 4)
    else:  # the CPU reference: dx in the residual dtype (d_x_new added in place), d_branch, dw in fp32 cast
        w.alloc(T * H * r, db, H * 4)
        w.peak(tag)
        w.alloc(H * p, -H * 4)
    w.free_norm() if kept == "norm." else w.free(*([kept] if isinstance(kept, str) else kept))
    w.alloc(-g_in)
    return T * H * r


def layer(w, i: int, g: int) -> int:
    """One block's backward, the MLP branch then the attention branch; returns the residual gradient."""
    T, H, c, r = w.T, w.H, w.c, w.r
    B, S, nh, nkv, hd = w.B, w.S, w.nh, w.nkv, w.hd
    kv_exp, kv = attention_fields.sdpa_grads(w)  # SDPA's d(q), and d(k) and d(v) each
    tag = f"layer {i} "
    w.begin()
    lean = w.lean  # the lean block: lean matmuls, SwiGLU + down, adds inside the norms (llm_anatomy/kernels/lean.py)
    # the branch's incoming gradient: without recompute add_rms_norm's d_branch, already made by the norm after
    # it (norm(..., fused)); otherwise the residual gradient's cast for the bf16 matmul (a view when r == c)
    gc = T * H * c if r != c or lean else 0
    w.alloc(0 if lean else gc)
    if w.cfg.moe:  # the MoE branch in place of the MLP's (under recompute, backward_moe_recompute re-runs it first)
        gn = backward_moe.layer(w, i, tag, gc, swiglu_down, rerun_attention)  # the shared experts' lean tail is the dense MLP's
    else:
        gn = mlp(w, i, tag, gc)
    # under recompute the re-made sum goes with the norm (and under "mlp" the checkpoint's branch with it)
    kept = {"none": "norm.", "mlp": ("mlp.x", "mlp.branch", "moe.branch"), "full": "mlp.x"}[w.recompute]
    g = w.residual_add(g, norm(w, tag + "norm 2", gn, kept))
    # ---- attention branch
    w.begin()
    w.alloc(0 if lean else gc)
    # d(merged heads), (T, heads x hd)
    go = w.linear(tag + "attention.o", w.cfg.q_dim, H, gc, "attention.o.", recast=lean and w.amp,
                  bias=H if w.cfg.o_bias else 0)  # o's bias gradient, the column sum of d(out)
    if w.cfg.attn_sinks:  # the merge's backward writes d(out) into a zero padded (B, nh, S, hd + pad); d(merged) goes
        padded = B * nh * S * attention_fields.width(w) * c
        w.alloc(padded, -go)
        go = padded
    w.alloc(kv_exp, kv, kv)  # SDPA's backward: dq, dk, dv
    # under GQA, cuDNN's backward writes dk and dv per query head in fp32 into one workspace, with the
    # fp32 dot(dO, O) row sums, and then sums each group into dk, dv (timing: gqa_reduce):
    # 2*T*nh*hd*4 + 4*B*nh*S + 256 bytes at all four GQA/MQA rows `anatomy forensics` traced on the H200,
    # live at the step's backward peak in each
    ws = 2 * B * nh * S * hd * 4 + 4 * B * nh * S + 256 if nkv < nh and w.cuda else 0
    w.alloc(ws)
    w.peak(tag + "attention.sdpa")
    w.alloc(-ws, -go, nh * w.p if w.cfg.attn_sinks else 0)  # the sinks' gradient: d(q')'s sink column summed
    # the forward's masks are shared by the layers of a kind (frees_mask); a "full" re-run builds its own, where the
    # layer has one
    shared = not frees_mask(w.cfg, i) if w.recompute != "full" else not attention_region.has_mask(w.cfg, i)
    w.free("attention.sdpa.", keep=("attention.sdpa.mask",) if shared else ())
    if w.cfg.attn_sinks:  # F.pad's backward slices d(k') and d(v') to new (B, nkv, S, hd) tensors
        plain = B * nkv * S * hd * c
        w.alloc(plain, -kv, plain, -kv)
        kv = plain
    dqkv = T * (nh + 2 * nkv) * hd * c
    whole = w.cfg.qk_norm_whole  # OLMoE's norms run before the plain rope_qkv (attention_fields.py)
    if w.cfg.qk_norm and not whole:
        rope_norm(w, tag, dqkv)
    else:
        w.alloc(dqkv)  # rope_qkv's backward: d(qkv)
        w.peak(tag + "attention.rope")
    if i == 0 and w.recompute != "full":  # the last RoPE node to run lets the tables go (the checkpoints keep them)
        w.free("attention.rope_cos", "attention.rope_sin")
    w.alloc(-kv_exp, -kv, -kv)
    if whole:
        attention_fields.whole_qk_norm(w, tag, dqkv)
    elif w.cfg.qk_norm:
        w.free("attention.rope_qkv_norm.qkv")
    if w.recompute == "mlp":  # the qkv matmul's backward asks for its input: the norm runs again
        w.remake("qkv", lambda: linears_saved("attention", T, H, {"qkv": (nh + 2 * nkv) * hd}, w.dt, 1, w.dt.compute))
    gn = w.linear(tag + "attention.qkv", H, (nh + 2 * nkv) * hd, dqkv, "attention.qkv.", recast=lean and w.amp,
                  bias=(nh + 2 * nkv) * hd if w.cfg.qkv_bias else 0)
    if i == 0:
        w.free("attention.rope_")  # the tables are shared by every layer
    # under recompute the checkpoint's block input goes with the first norm (the block's first op)
    # layer 0's attn_norm is a plain rms_norm (no add in front of it)
    return w.residual_add(g, norm(w, tag + "norm 1", gn, "attention.x" if w.recompute != "none" else "norm.",
                                  fused=lean and i > 0))


def mlp(w, i: int, tag: str, gc: int) -> int:
    """Layer i's dense MLP's backward from its incoming gradient (gc bytes); returns the bytes of its d(x)."""
    T, H, I, c, lean = w.T, w.H, w.I, w.c, w.lean
    if w.recompute == "full":  # the down matmul's backward asks for its input: the block runs again
        rerun_block(w, i, tag)
    elif w.recompute == "mlp":  # the down matmul's backward asks for its input: the checkpoint re-runs the
        w.remake("mlp", lambda: efficient_saved(w.cfg, w.run, recomputed=True))  # sum, norm, gate_up, activation
    if lean:
        swiglu_down(w, tag, gc)
    else:
        gi = w.linear(tag + "mlp.down", I, H, gc, "mlp.down.")
        # swiglu_packed's backward writes d(gate_up) into the saved gate_up storage: the same (T, 2I) bytes
        # change kind from activation to gradient, and nothing is allocated
        w.free("mlp.gate_up")
        w.alloc(2 * T * I * c)
        w.peak(tag + "mlp.act")
        w.alloc(-gi)  # d(h) gone
    return w.linear(tag + "mlp.gate_up", H, 2 * I, 2 * T * I * c, "mlp.gate_up.", recast=lean and w.amp)


def rope_norm(w, tag: str, dqkv: int) -> None:
    """rope_qkv_norm's backward (the q/k norms inside the RoPE kernel), from SDPA's dq, dk, dv and the saved qkv
    output: d(qkv) and the two (hd,) weight gradients, which become q_norm's and k_norm's .grad; on CUDA also a
    (programs, hd) fp32 row of partials per weight (programs as rms_norm's over rows of 2·hd), summed by a
    second kernel and freed."""
    T, p, hd = w.T, w.p, w.hd
    parts = 2 * rms_norm_programs(2 * hd, T) * hd * 4 if w.cuda else 0
    w.alloc(dqkv, parts, 2 * hd * p)
    w.peak(tag + "attention.rope_qkv_norm")
    w.alloc(-parts)


def swiglu_down(w, tag: str, grad_out: int, I: int | None = None, name: str = "mlp") -> None:
    """The fused SwiGLU + down node (llm_anatomy/kernels/lean.py): down's weight cast again and d(h); the cast
    goes; one pass writes h over d(h) and d(gate_up) over gate_up's storage (the same bytes change kind);
    down's weight gradient (compute dtype under autocast, fp32 from the GEMM on CUDA: lean.fp32_grad); h and
    the incoming gradient go; under autocast on CPU the cast node makes the fp32 weight gradient. I and name:
    the MLP's width and saved-name prefix (default the dense MLP's; the MoE block's shared experts)."""
    T, H, c, p = w.T, w.H, w.c, w.p
    I = w.I if I is None else I
    copy = w.amp and not w.cuda
    wg = H * I * (c if copy else p)
    w.alloc(T * I * c)  # d(h)
    w.peak(tag + name + ".down", *((H * I * c,) if w.amp else ()))  # with the weight's cast
    w.free(name + ".gate_up")
    w.alloc(2 * T * I * c)
    w.peak(tag + name + ".act")  # h in d(h)'s storage, d(gate_up) in gate_up's
    w.alloc(wg)  # dW
    w.peak(tag + name + ".down.weight_grad")
    w.alloc(-T * I * c, -grad_out)  # h, the incoming gradient
    if copy:
        w.alloc(H * I * p)
        w.peak(tag + name + ".down grad to fp32")
        w.alloc(-wg)


def rerun_block(w, i: int, tag: str) -> None:
    """recompute="full": the block's forward runs again and stops (early stop) once down's input and weight
    cast are saved again, so every tensor the block saves without recompute is live again: one layer's
    qkv input (and cast), SDPA's tensors, o's cast, the residual sum, the MLP's. The block input is the
    checkpoint's own, the RoPE tables the model's: no new storage."""
    rerun_attention(w, i, tag)
    w.remake("mlp", lambda: efficient_saved(w.cfg, w.run, recomputed=True))


def rerun_attention(w, i: int, tag: str) -> None:
    """The attention half of recompute="full"'s re-run in layer i (rerun_block; the MoE block's too): each segment's
    largest moment (attention_region.py's replay, what the ops save kept: o's output while qkv's output lives, a
    local until attention returns; OLMoE's normed q and k and rope's cat beside rope's q, k, v; with sinks rope's q, k,
    v beside SDPA's padded copies), then what it saves stays; then the residual sum while attention's output lives,
    with the bias casts the re-run's autocast caches until it ends. A layer with a mask builds its own."""
    T, H, c, r = w.T, w.H, w.c, w.r
    D = (w.nh + 2 * w.nkv) * w.hd
    device = w.est.device
    for name, live in attention_region.segments(w.cfg, w.run, device, w.rnd, i, rerun=True).items():
        w.peak(tag + "recompute attention." + name, live, kind="activation")
    mask = "masked" if attention_region.has_mask(w.cfg, i) else "plain"
    w.remake("block " + mask, lambda: [s for s in linears_saved("attention", T, H, {"qkv": D}, w.dt, 1, w.dt.compute)
                                       + qk_norm_saved_efficient(w.cfg, w.run, 1) + sdpa_o_saved(w.cfg, w.run, device, 1)
                                       if mask == "masked" or s.name != "attention.sdpa.mask"])
    w.peak(tag + "recompute residual add", T * H * c, T * H * r, attention_region.bias_casts(w.cfg, w.run, w.rnd),
           kind="activation")


def embedding(w) -> None:
    """embedding_dense_backward's (V, H) gradient. Tied: the head already left a gradient in the shared
    weight; AccumulateGrad adds in place when it holds the only reference to that .grad, so on CUDA, where
    the fused CE's grad_weight storage became the .grad, nothing more; on CPU the sum is a third (V, H)
    tensor, under either loss (the live-storage walk of validations/test_memory_walk.py)."""
    V, H, p = w.V, w.H, w.p
    w.alloc(V * H * p)
    if w.cfg.tie_embeddings and not w.cuda:
        w.alloc(V * H * p)
    w.peak("embedding")
