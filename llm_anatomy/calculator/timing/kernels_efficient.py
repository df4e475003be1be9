"""The kernels llm_anatomy/efficient launches in a training step on CUDA, with their FLOPs and minimal bytes:
one qkv and one gate_up matmul per layer, our fused rms_norm, rope_qkv and swiglu, cuDNN's SDPA (or another
backend) and the fused linear CE for the loss (Run.loss_impl: ours, anatomy_loss; Liger's, liger_loss); in the
lean block (Run.lean), its adds inside the norms, its re-made weight casts and SwiGLU output. Mirrors kernels_baseline.py,
component by component.
"""
from __future__ import annotations

from llm_anatomy.calculator.timing.kernels_fields import mask_kernels, sdpa_kernels, sink_kernels, whole_qk_norm_kernels
from llm_anatomy.calculator.timing.kernels_moe import efficient_moe, efficient_moe_recompute
from llm_anatomy.calculator.timing.op_bytes import dw_sum_bytes, fused_bytes
from llm_anatomy.calculator.timing.ops import Kernel, Ops, embedding, residual, rope_tables
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy import kernel_shapes
from llm_anatomy.kernel_shapes import chunk_rows, lce_chunk_rows, lce_vocab, rms_norm_programs


def efficient_kernels(cfg: ModelConfig, run: Run, sdpa_backend: str = "cudnn", hist=None) -> list[Kernel]:
    """llm_anatomy/efficient under the run's policy, on CUDA (cuDNN SDPA unless told otherwise); hist: a mixture of
    experts' rows per expert (calculator/moe.py; default balanced)."""
    o = Ops(cfg, run)
    if o.dt.compute != "bfloat16":
        raise ConfigError("the efficient variant's timing is modelled for bf16 compute (amp or bf16), where "
                          "its SDPA backends run")
    T, H, L, Hkv = run.tokens, cfg.hidden, cfg.layers, cfg.kv_dim
    q = cfg.q_dim  # heads x head_dim: q's and SDPA's output width
    D, c, r = q + 2 * Hkv, o.c, o.r
    embedding(o)
    rope_tables(o, cast=False)  # fp32 tables, built once per step
    # norms: read x (residual dtype), write y (compute dtype); backward reads dy, x, writes dx, and a
    # second launch sums the (programs, H) fp32 partials of dw
    # In the lean block (Run.lean, without recompute) every norm but the first runs fused with the residual add in front of it
    # (anatomy::add_rms_norm, efficient/transformer.py Block._fused): fused_norms(); its matmuls write dW in fp32
    # (llm_anatomy/kernels/lean.py: fp32_grad), so no cast of dW follows them
    fused = run.lean_block
    n_norms = 1 if fused else 2 * L + 1
    fw, bw = ("rms_norm.forward", H), ("rms_norm.backward", H)
    o.mem("norm.rms_norm", "norm", "forward", *fused_bytes(*fw, T, c, r), n_norms, host=fw[0], fused=(*fw, T))
    o.mem("norm.rms_norm.backward", "norm", "backward", *fused_bytes(*bw, T, c, r), n_norms, host=bw[0],
          fused=(*bw, T))
    o.mem("norm.rms_norm.dw_sum", "norm", "backward", *dw_sum_bytes(H, T), n_norms, host=None, fused=(*bw, T))
    # attention: one qkv matmul, fused split + RoPE, SDPA, o
    o.linear("attention.qkv", "attention", H, D, L, bias=cfg.qkv_bias, fp32_grad=fused)
    if cfg.qk_norm_whole:  # OLMoE: the fused norm on q's and k's columns, a cat, then the plain RoPE
        whole_qk_norm_kernels(o)
    if cfg.qk_norm and not cfg.qk_norm_whole:
        rope_norm_kernels(o)
    else:
        for ph, name in (("forward", "attention.rope_qkv"), ("backward", "attention.rope_qkv.backward")):
            op = (f"rope_qkv.{ph}", D)
            o.mem(name, "attention", ph, *fused_bytes(*op, T, c, r), L, host=op[0], fused=(*op, T))
    if cfg.attn_sinks:
        sink_kernels(o)
    mask_kernels(o)
    sdpa_kernels(o, sdpa_backend)  # causal layers on the backend, masked ones on cuDNN's masked kernel
    # its input: a view of SDPA's output (with sinks a copy: sink_kernels); gpt-oss's bias in its epilogue
    o.linear("attention.o", "attention", q, H, L, bias=cfg.o_bias, fp32_grad=fused)
    # where the residual adds run: in the block ("other"); in the MLP's checkpoint under "mlp"; in the block's
    # checkpoint, a module credited to attention (efficient/transformer.py, BlockCheckpoint), under "full"
    where = {"none": "other", "mlp": "moe" if cfg.moe else "mlp", "full": "attention"}[run.recompute]
    if not fused:
        residual(o, "attention", L, where)
    if cfg.moe:  # the MoE block in the MLP's place (kernels_moe.py), its residual add credited to it
        efficient_moe(o, hist)
    else:
        mlp(o, fused)
    if fused:
        fused_norms(o)
    else:
        residual(o, "moe" if cfg.moe else "mlp", L, where)
    if run.recompute != "none":
        recompute_kernels(o, sdpa_backend, hist)
    elif run.lean_block:
        lean_kernels(o)
    liger_loss(o) if run.loss_impl == "liger" else anatomy_loss(o)
    return o.k


def mlp(o: Ops, fused: bool) -> None:
    """One gate_up matmul, the fused activation (saves gate_up; backward writes dgate/dup in place), down."""
    T, H, L, I, c, r = o.run.tokens, o.cfg.hidden, o.cfg.layers, o.cfg.intermediate, o.c, o.r
    o.linear("mlp.gate_up", "mlp", H, 2 * I, L, fp32_grad=fused)
    for ph, name in (("forward", "mlp.swiglu"), ("backward", "mlp.swiglu.backward")):
        op = (f"swiglu.{ph}", I)
        # the lean block's backward pass also writes h (lean.remake_grad): its bytes, the same kernel's rate
        priced = ("swiglu.backward_remake", I) if fused and ph == "backward" else op
        o.mem(name, "mlp", ph, *fused_bytes(*priced, T, c, r), L, host=op[0], fused=(*op, T))
    # (swiglu_packed owns the split, so no SplitBackward cats dgate and dup: d(gate_up) is gate_up's storage)
    o.linear("mlp.down", "mlp", I, H, L, fp32_grad=fused)


def rope_norm_kernels(o: Ops) -> None:
    """rope_qkv_norm (kernels/rope_norm.py): q_norm and k_norm inside the RoPE kernel. Forward reads qkv and
    writes q, k, v, as rope_qkv; backward reads dq, dk, dv and qkv's q and k columns, writes d(qkv), then a
    second kernel per weight sums the (programs, hd) fp32 partials (programs as rms_norm's over rows of 2·hd).
    Timed at rope_qkv's calibrated efficiency (the same one-program-per-token launch and layouts; the
    per-head reduction stays in registers; the hd-wide weights are left out of the bytes)."""
    T, L, c, hd = o.run.tokens, o.cfg.layers, o.c, o.cfg.head_dim
    qk, D = o.cfg.q_dim + o.cfg.kv_dim, o.cfg.q_dim + 2 * o.cfg.kv_dim
    fw, bw = ("rope_qkv.forward", D), ("rope_qkv.backward", D)
    o.mem("attention.rope_qkv_norm", "attention", "forward", T * D * c, T * D * c, L, host=fw[0], fused=(*fw, T))
    o.mem("attention.rope_qkv_norm.backward", "attention", "backward", T * (D + qk) * c, T * D * c, L, host=bw[0],
          fused=(*bw, T))
    programs = rms_norm_programs(2 * hd, T)
    o.mem("attention.rope_qkv_norm.dw_sum", "attention", "backward", 4 * programs * hd, 4 * hd, 2 * L, host=None)


def fused_norms(o: Ops) -> None:
    """The lean block: 2L residual adds, each fused with the norm that reads its sum (each block's mlp_norm,
    the next block's attn_norm, the final norm). Forward reads x and the branch, writes x_new and y; backward
    reads d_x_new, dy and x_new, writes d_x and d_branch (the final norm's x_new has no gradient: no d_x_new
    read), then sums the dw partials. What stays unfused: the first attn_norm (an rms_norm, priced with the
    others above) and autograd's sum of the embedding output's two gradients (that norm's and the residual's)."""
    T, H, L, c, r = o.run.tokens, o.cfg.hidden, o.cfg.layers, o.c, o.r
    fw, bw = ("add_rms_norm.forward", H), ("add_rms_norm.backward", H)
    o.mem("norm.add_rms_norm", "norm", "forward", *fused_bytes(*fw, T, c, r), 2 * L, host=fw[0], fused=(*fw, T))
    o.mem("norm.add_rms_norm.backward", "norm", "backward", *fused_bytes(*bw, T, c, r), 2 * L - 1, host=bw[0],
          fused=(*bw, T))
    o.mem("norm.add_rms_norm.backward.final", "norm", "backward", T * H * (r + c), T * H * (r + c), host=bw[0],
          fused=(*bw, T))
    o.mem("norm.add_rms_norm.dw_sum", "norm", "backward", *dw_sum_bytes(H, T), 2 * L, host=None, fused=(*bw, T))
    o.mem("norm.attention_input_grad_sum", "norm", "backward", 2 * T * H * r, T * H * r, order=2)


def recompute_kernels(o: Ops, sdpa_backend: str, hist=None) -> None:
    """What the checkpoints run again in backward, before the layer's own backward kernels. Early stop:
    the region's last matmul (down; under "mlp" also qkv) does not run again. Under "mlp": both norms, the
    residual sum, gate_up and the activation. Under "full": the block's whole forward but down: both norms,
    qkv, RoPE, SDPA's forward, o, the sum, gate_up and the activation. The re-run add runs under the label
    of the node that asked for the re-run (down's backward: the MLP), as under "mlp"."""
    cfg, run, c, r = o.cfg, o.run, o.c, o.r
    T, H, L, I = run.tokens, cfg.hidden, cfg.layers, cfg.intermediate
    D = cfg.q_dim + 2 * cfg.kv_dim
    full = run.recompute == "full"
    branch = "moe" if cfg.moe else "mlp"  # the component of the node that asks for the re-run
    fw = ("rms_norm.forward", H)
    o.mem("norm.rms_norm.recompute", "norm", "backward", *fused_bytes(*fw, T, c, r), 2 * L, host=fw[0],
          fused=(*fw, T))
    if full:
        o.mm("attention.qkv.recompute", "attention", "backward", T, D, H, L)
        rp = ("rope_qkv.forward", D)
        if cfg.qk_norm_whole:
            whole_qk_norm_kernels(o, recompute=True)
        rope = "rope_qkv_norm" if cfg.qk_norm and not cfg.qk_norm_whole else "rope_qkv"  # the same bytes either way
        o.mem(f"attention.{rope}.recompute", "attention", "backward", *fused_bytes(*rp, T, c, r), L, host=rp[0],
              fused=(*rp, T))
        if cfg.attn_sinks:
            sink_kernels(o, recompute=True)
        mask_kernels(o, recompute=True)  # the model's mask cache lives only inside its forward
        sdpa_kernels(o, sdpa_backend, recompute=True)
        o.mm("attention.o.recompute", "attention", "backward", T, H, cfg.q_dim, L, extra=H * c if cfg.o_bias else 0)
    # the sum the MLP's norm reads, x + attention's branch (named for the MLP's checkpoint under "mlp");
    # under "full" priced as its forward launch is (fp32 + bf16: the calibrated residual_add)
    if full:
        mixed = ("residual_add", H, T) if c != r else ()
        o.mem("attention.residual_add.recompute", branch, "backward", *fused_bytes("residual_add", H, T, c, r), L,
              fused=mixed)
    else:
        o.mem("mlp.residual_add.recompute", branch, "backward", T * H * (r + c), T * H * r, L)
    if cfg.moe:  # the MoE block's forward again, its weight casts included (kernels_moe.py)
        efficient_moe_recompute(o, hist)
    else:
        o.mm("mlp.gate_up.recompute", "mlp", "backward", T, 2 * I, H, L)
        sw = ("swiglu.forward", I)
        o.mem("mlp.swiglu.recompute", "mlp", "backward", *fused_bytes(*sw, T, c, r), L, host=sw[0], fused=(*sw, T))
    if o.amp:  # autocast's weight casts are made again too (its cache ends with each forward)
        casts = [("attention.qkv", "attention", D * H)]
        casts += [] if cfg.moe else [("mlp.gate_up", "mlp", 2 * I * H), ("mlp.down", "mlp", I * H)]
        if full:
            casts.insert(1, ("attention.o", "attention", cfg.q_dim * H))
        for name, comp, n in casts:
            o.mem(f"{name}.weight_cast.recompute", comp, "backward", n * o.p, n * c, L)
        if cfg.qkv_bias:  # autocast casts qkv's bias with its weight
            o.mem("attention.qkv.bias_cast.recompute", "attention", "backward", D * o.p, D * c, L)
        if full and cfg.o_bias:  # and o's
            o.mem("attention.o.bias_cast.recompute", "attention", "backward", H * o.p, H * c, L)


def lean_kernels(o: Ops) -> None:
    """In the lean block the matmuls are lean (llm_anatomy/kernels/lean.py): under autocast each one's
    backward casts its fp32 weight to bf16 again (the forward's cast is not kept). (h, down's input, is made
    again inside SwiGLU's backward pass: priced there, in efficient_kernels.)"""
    cfg, c = o.cfg, o.c
    H, L, I, D = cfg.hidden, cfg.layers, cfg.intermediate, cfg.q_dim + 2 * cfg.kv_dim
    # a mixture of experts: its shared experts' MLP is lean (the router and the stacked experts are not)
    Is = cfg.shared_experts * (cfg.shared_intermediate or 0)
    ffn = ((("moe.shared.gate_up", "moe", 2 * Is * H), ("moe.shared.down", "moe", Is * H)) if Is else ()) \
        if cfg.moe else (("mlp.gate_up", "mlp", 2 * I * H), ("mlp.down", "mlp", I * H))
    if o.amp:
        for name, comp, n in (("attention.qkv", "attention", D * H), ("attention.o", "attention", cfg.q_dim * H),
                              *ffn):
            o.mem(f"{name}.weight_recast", comp, "backward", n * o.p, n * c, L)


def anatomy_loss(o: Ops) -> None:
    """Our fused linear CE (llm_anatomy/kernels/linear_ce.py): the count of targets and the scale stay on the
    device (no sync); under amp the weight is cast to bf16 once; per chunk of C rows (kernel_shapes.
    lce_chunk_rows), logits = x_c Wᵀ (C, V) into one buffer, our row kernel (logsumexp, loss, d(logits) in
    place: one read of a row up to 32,768 wide, two past it), grad_x rows = d(logits) W written in place,
    grad_w (+)= d(logits)ᵀ x_c into the weight's dtype (fp32 under amp: mm/addmm with an fp32 out_dtype,
    the accumulating family, read and written every chunk after the first). The loss: the row losses
    summed in fp64 over n. Backward scales grad_x and grad_w by the incoming gradient, in place: a pass only
    when that gradient is not 1.

    Host: one custom-op call (the public function, the autocast rule, the autograd wrapper), the setup's
    eager ops and the chunk loop's Python (slices, two mm launches, a Triton launch, the grad_w mm); the
    profile has no measured figure for it, so each part counts as host_ops eager ops. The GEMMs run over V'
    (kernel_shapes.lce_vocab at LCE_ALIGN: the weight cast into a zero-padded buffer), the row kernel over V."""
    T, H, c, p = o.run.tokens, o.cfg.hidden, o.c, o.p
    V0, V = o.cfg.vocab, lce_vocab(o.cfg.vocab, kernel_shapes.LCE_ALIGN)  # the vocabulary, and the GEMMs' (padded) one
    C = lce_chunk_rows(T, H, V, c)
    full, rest = divmod(T, C)
    # targets != -100 and its sum, then clamp, to fp32 and the reciprocal: 0-d device tensors, no .item()
    o.mem("loss.count_targets", "loss", "forward", T * 8 + T, T + 8, order=2, host="linear_ce.forward",
          host_ops=12 + o.amp)  # the call (3), 5 small ops, the cast, 4 empties
    o.mem("loss.scale", "loss", "forward", 8, 8, 3, order=2, host=None)
    if o.amp or V != V0:  # the weight cast to bf16 (or padded) once per call (V', H), not per chunk
        o.mem("loss.lm_head.weight_cast", "loss", "forward", V0 * H * p, V * H * c, order=2, host=None)
    first = True
    for rows, n in ((C, full), (rest, 1 if rest else 0)):
        if not n:
            continue
        chunk = dict(order=2, loop=True, host=None)
        o.mm("loss.logits", "loss", "forward", rows, V, H, n, **dict(chunk, host="linear_ce.chunk"), host_ops=6)
        o.mem("loss.cross_entropy", "loss", "forward", *fused_bytes("anatomy_ce", V0, rows, c), n,
              fused=("linear_ce.anatomy", V0, rows) if c == 2 else (), **chunk)
        o.mm("loss.grad_input", "loss", "forward", rows, H, V, n, **chunk)
        # grad_w: the first chunk writes the (V, H) accumulator (weight's dtype), every later one reads and
        # writes it (under amp an fp32 accumulator: the mm/addmm out_dtype=fp32 family); the first group's
        # one read fewer is spread over its n launches, so the loop stays one entry per GEMM
        reads = (n - 1 if first else n) * V * H * p // n
        o.mm("loss.grad_weight", "loss", "forward", V, H, rows, n, extra=reads + V * H * p - V * H * c,
             accumulate=p == 4 and c == 2, **chunk)
        first = False
    o.mem("loss.sum", "loss", "forward", T * 4, 8, order=2, host=None)  # fp64 sum of the row losses
    o.mem("loss.mean", "loss", "forward", 16, 12, 2, order=2, host=None)  # / n, to fp32
    # backward: grad_x and grad_w scaled by the incoming gradient in place (linear_ce.scale_), then handed on;
    # a plain loss.backward() sends 1, so each kernel reads it (4 B) and returns without touching its tensor
    # (a loss scaled before backward would pay T·H·c and V·H·p read and written)
    o.mem("loss.scale_grad_input", "loss", "backward", 4, 0, order=0, host="linear_ce.backward", host_ops=5)
    o.mem("loss.scale_grad_weight", "loss", "backward", 4, 0, order=0, host=None)


def liger_loss(o: Ops) -> None:
    """Liger's fused linear CE (liger_kernel 0.8.x, ops/fused_linear_cross_entropy.py): per chunk of C
    rows, logits = x_c Wᵀ (C, V); one Triton kernel reads each row twice (max/sum, then the gradient)
    and writes d(logits) in place; grad_input rows = d(logits) W; grad_weight += d(logits)ᵀ x_c. All
    three matmuls run in forward; backward only checks that the incoming gradient is 1.

    Host: calibrate times the call as the model makes it (calibrate_host.measure_liger_host), so one
    entry carries each measured part: the call's fixed forward (liger_ce.forward), each chunk's Python
    (liger_ce.chunk: slices, the autocast matmuls, a Triton launch of 25 keyword arguments, the
    copies) and the backward (liger_ce.backward); the other entries are issued inside those. host_ops
    is what each part counts as in eager ops where a profile did not measure it."""
    T, H, V, c, p = o.run.tokens, o.cfg.hidden, o.cfg.vocab, o.c, o.p
    C = chunk_rows(T, H, V)
    full, rest = divmod(T, C)
    o.mem("loss.count_targets", "loss", "forward", T * 8, 8, 2, sync=True, order=2, host=None)  # target != -100, sum, .item()
    o.mem("loss.zero_grad_input", "loss", "forward", 0, T * H * c, order=2, host="liger_ce.forward",
          host_ops=6 + o.amp)  # 3 zeros, the count (2), the loss sum; under amp the weight's cast
    o.mem("loss.zero_grad_weight", "loss", "forward", 0, V * H * p, order=2, host=None)
    o.mem("loss.zero_losses", "loss", "forward", 0, T * 4, order=2, host=None)
    if o.amp:
        # the fp32 weight reaches autocast mms inside the Function. `grad_logits @ weight` casts the
        # leaf once and autocast caches it; `x @ weight.t()` casts the transposed view, not a leaf,
        # anew in every chunk (both casts show in the H200 memory probe: calculator/memory.py)
        o.mem("loss.lm_head.weight_cast", "loss", "forward", V * H * p, V * H * c, order=2, host=None)
    for rows, n in ((C, full), (rest, 1 if rest else 0)):
        if not n:
            continue
        chunk = dict(order=2, loop=True, host=None)
        if o.amp:
            o.mem("loss.lm_head.weight_t_cast", "loss", "forward", V * H * p, V * H * c, n, **chunk)
        o.mm("loss.logits", "loss", "forward", rows, V, H, n, **dict(chunk, host="liger_ce.chunk"),
             host_ops=4 + 2 * o.amp)
        o.mem("loss.cross_entropy", "loss", "forward", *fused_bytes("liger_ce", V, rows, c), n,
              fused=("linear_ce", V, rows) if c == 2 else (), **chunk)
        o.mm("loss.grad_input", "loss", "forward", rows, H, V, n, **chunk)
        if o.amp:  # fp32 weight: no mm(out=), so the product is copied into grad_input's rows
            o.mem("loss.grad_input_copy", "loss", "forward", rows * H * c, rows * H * c, n, **chunk)
        # addmm into grad_weight (the weight's dtype): reads and writes the (V, H) accumulator every chunk
        # (under amp the accumulator is fp32: Liger's addmm(out_dtype=fp32), a slower kernel family)
        o.mm("loss.grad_weight", "loss", "forward", V, H, rows, n, extra=2 * V * H * p - V * H * c,
             accumulate=p == 4 and c == 2, **chunk)
    o.mem("loss.sum", "loss", "forward", T * 4, 4, order=2, host=None)
    o.mem("loss.backward_check", "loss", "backward", 8, 8, 2, sync=True, order=0, host="liger_ce.backward", calls=1,
          host_ops=2)  # ones_like seed; torch.equal(g, 1)
