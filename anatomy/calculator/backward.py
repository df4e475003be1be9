"""The peak inside backward: a walk over the backward pass, stage by stage, in the order autograd runs it.

Pure Python. It starts from the live set at the end of forward (parameters, inputs, every saved
tensor, the loss) and, for each stage from the loss down to the embedding:
  - adds the stage's transients at their largest moment (the gradients it makes before it frees
    what it read) and records that as a candidate peak;
  - frees the stage's saved tensors (autograd releases a node's saved tensors once it has run);
  - allocates the parameter gradients the stage produces (they stay: no optimizer step inside backward);
  - keeps one residual-stream gradient live between stages (a branch's gradient is added into it in
    place, as autograd's input buffer does).
The peak is the largest candidate. The stages were read off op-by-op traces of the live storages on
CPU (anatomy.measure.liveness). A stage's transients are the tensors of its largest moment, not every
temporary: exact where the peak usually is (the loss's two fp32 (T, V) gradients, the baseline's
fp32 (B, nh, S, S) score gradients in the last layer, the first MLP of the efficient model), close
elsewhere (validations/test_memory_walk.py: within ±3% on CPU; see reports/cpu/claims.json).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.kernel_shapes import rms_norm_programs
from anatomy.calculator.linear import linears_saved
from anatomy.calculator.mlp import efficient_saved
from anatomy.calculator.types import BYTES, Estimate
from anatomy.config import ModelConfig, Run

INPUTS = ("embedding.ids", "loss.targets")  # saved, but they are the step's inputs: no new storage


# what is live, by kind: the same kinds `anatomy forensics` gives each allocation
KINDS = ("parameter", "input", "optimizer state", "activation", "gradient / backward buffer")
GRAD = "gradient / backward buffer"


@dataclass
class Stage:
    name: str  # e.g. "layer 3 attention.softmax"
    live: int  # bytes live at the stage's largest moment
    by_kind: dict[str, int] = field(default_factory=dict)  # the same bytes by KINDS


class _Walk:
    def __init__(self, est: Estimate, rnd, start: dict[str, int]):
        self.rnd, self.stages, self.freed = rnd, [], set()
        self.by = {k: start.get(k, 0) for k in KINDS}
        self.one = {}  # saved name -> bytes of one instance
        for comp in est.components.values():
            for s in comp.saved:
                if s.name not in INPUTS:
                    self.one[s.name] = rnd(prod(s.shape) * BYTES[s.dtype])

    @property
    def live(self) -> int:
        return sum(self.by.values())

    def peak(self, name: str, *transients: int) -> None:
        by = dict(self.by)
        by[GRAD] += sum(self.rnd(t) for t in transients)
        self.stages.append(Stage(name, sum(by.values()), by))

    def free(self, *names: str, keep: tuple[str, ...] = ()) -> None:
        """Free one instance of each saved tensor named (a name ending in '.' or '_' is a prefix),
        once per layer (begin() starts a layer)."""
        for n, b in self.one.items():
            hit = any(n == x or (x[-1] in "._" and n.startswith(x)) for x in names)
            if hit and n not in self.freed and not n.startswith(keep):
                self.freed.add(n)
                self.by["activation"] -= b

    def free_norm(self) -> None:
        """One RMSNorm instance's saved tensors (2 per layer + the final one share the names)."""
        self.by["activation"] -= sum(b for n, b in self.one.items() if n.startswith("norm."))

    def begin(self) -> None:
        self.freed = set()

    def remake(self, saved) -> None:
        """A checkpoint's recompute makes these saved tensors again (one instance each), as activations."""
        for s in saved:
            self.one[s.name] = b = self.rnd(prod(s.shape) * BYTES[s.dtype])
            self.by["activation"] += b

    def alloc(self, *nbytes: int) -> None:
        """Allocate gradients or backward buffers of these sizes; a negative size frees one (each
        rounded on its own)."""
        self.by[GRAD] += sum(self.rnd(b) if b >= 0 else -self.rnd(-b) for b in nbytes)


def walk(cfg: ModelConfig, run: Run, variant: str, est: Estimate, start: dict[str, int], rnd) -> list[Stage]:
    """Candidate peaks of one backward, in execution order. start: bytes live when it starts, by KINDS."""
    dt = dtypes(run)
    c, r, p, amp = BYTES[dt.compute], BYTES[dt.residual], BYTES[dt.param], dt.autocast
    T, H, I, V, L = run.tokens, cfg.hidden, cfg.intermediate, cfg.vocab, cfg.layers
    B, S, nh, nkv, hd = run.batch, run.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    scores = B * nh * S * S
    w = _Walk(est, rnd, start)
    recompute = run.recompute == "mlp"

    def linear(tag: str, din: int, dout: int, grad_out: int, *saved: str, to_residual: bool = False) -> int:
        """One matmul's backward: the weight gradient (the compute dtype under autocast) and the input
        gradient, then the incoming gradient and the saved tensors go; under autocast the weight
        gradient is copied to the parameter's dtype. Returns the bytes of the gradient passed on."""
        wg = din * dout * (c if amp else p)
        w.alloc(wg, T * din * c)
        w.peak(tag)
        w.alloc(-grad_out)
        w.free(*saved)
        dx = T * din * c
        if to_residual and r != c:  # the input was an autocast copy of the residual: back to its dtype
            w.alloc(T * din * r)
            w.alloc(-dx)
            dx = T * din * r
        if amp:
            w.alloc(din * dout * p)
            w.peak(tag + " grad to fp32")
            w.alloc(-wg)
        return dx

    def norm(tag: str, g_in: int, kept: str | tuple = "norm.") -> int:
        """RMSNorm's backward: takes the output's gradient, leaves the input's (residual dtype). kept:
        what goes with it ("norm.": its own saved x; under recompute, the checkpoint's tensors)."""
        if variant == "baseline":  # x̂·g, g·w and the rstd terms in fp32; a bf16 residual adds its fp32 copies
            # under bf16 the incoming gradient is first copied to fp32 and then freed
            w.peak(tag, *([T * H * 4] * 3 + ([] if r == 4 else [T * H * 4 - T * H * r])))
            w.alloc(T * H * r, H * p)
        elif est.device == "cuda":  # the Triton backward: dx, the (programs, H) fp32 dw partials, dw
            w.alloc(T * H * r, rms_norm_programs(H, T) * H * 4, H * p)
            w.peak(tag)
            w.alloc(-rms_norm_programs(H, T) * H * 4)
        else:  # the CPU reference: dx in the residual dtype and dw in fp32, cast to the weight's dtype
            w.alloc(T * H * r, H * 4)
            w.peak(tag)
            w.alloc(H * p, -H * 4)
        w.free_norm() if kept == "norm." else w.free(*([kept] if isinstance(kept, str) else kept))
        w.alloc(-g_in)
        return T * H * r

    def residual_add(tag: str, g: int, branch: int) -> int:
        """The branch's gradient joins the skip's: autograd's input buffer adds it in place."""
        w.alloc(-branch)
        return g

    if variant == "baseline":
        # nll_loss_backward makes the fp32 (T, V) gradient, log_softmax's backward a second one
        w.peak("loss", 4, T * V * 4, T * V * 4)
        w.free("loss.log_probs", "loss.total_weight")
        w.alloc(T * V * c)  # the logits' gradient in the compute dtype (the fp32 ones are gone)
        g = linear("loss.lm_head", H, V, T * V * c, "loss.", to_residual=True)
    elif est.device == "cuda":
        # Liger's backward hands back what forward made (scaled in place unless the incoming gradient
        # is 1, which it compares against a new 0-dim tensor): no new (T, H) or (V, H) buffer
        w.peak("loss", 4, 4)
        w.free("loss.")
        w.alloc(T * H * c, V * H * p)  # the same storages, now the flowing gradient and lm_head's .grad
        g = T * H * c
    else:
        # the CPU mirror returns grad_input·g and grad_weight·g: new tensors, then the saved ones go;
        # g itself, the engine's 0-dim fp32 seed, stays live to the end of backward
        w.alloc(4, T * H * c, V * H * p)
        w.peak("loss")
        w.free("loss.")
        g = T * H * c
    g = norm("final norm", g)
    kv_exp = B * nh * S * hd * c  # one (B, nh, S, hd) tensor: q's size, or k/v expanded to all heads
    for layer in reversed(range(L)):
        w.begin()
        tag = f"layer {layer} "
        # ---- mlp branch: gradient of the block output -> gradient of norm 2's output
        gc = T * H * c if r != c else 0  # the residual gradient cast for the bf16 matmul (a view when r == c)
        w.alloc(gc)
        if recompute:  # the down matmul's backward asks for its input: the checkpoint re-runs the
            w.remake(efficient_saved(cfg, run, recomputed=True))  # sum, norm, gate_up, activation
        gi = linear(tag + "mlp.down", I, H, gc, "mlp.down.")
        if variant == "baseline":
            w.peak(tag + "mlp.act", T * I * c, T * I * c)  # d(silu(gate)), d(up), d(gate) at once
            w.free("mlp.gate", "mlp.up", "mlp.silu_gate", "mlp.gate_raw", "mlp.up_raw", "mlp.up_plus_1")
            w.alloc(T * I * c, T * I * c, -gi)  # d(gate), d(up) live, d(h) gone
            gu = linear(tag + "mlp.up", H, I, T * I * c, "mlp.up.", to_residual=True)
            gg = linear(tag + "mlp.gate", H, I, T * I * c, "mlp.gate.", to_residual=True)
            w.free("mlp.")  # without autocast gate and up share one saved input ("mlp.gate+up.input")
            w.alloc(T * H * r)  # their sum
            w.peak(tag + "mlp.sum")
            w.alloc(-gu, -gg)
            gn = T * H * r
        else:
            # swiglu_packed's backward writes d(gate_up) into the saved gate_up storage: the same
            # (T, 2I) bytes change kind from activation to gradient, and nothing is allocated
            w.free("mlp.gate_up")
            w.alloc(2 * T * I * c)
            w.peak(tag + "mlp.act")
            w.alloc(-gi)  # d(h) gone
            gn = linear(tag + "mlp.gate_up", H, 2 * I, 2 * T * I * c, "mlp.gate_up.")
        # under recompute the re-made sum goes with the norm, and the checkpoint's branch with it
        g = residual_add(tag + "mlp residual add", g, norm(tag + "norm 2", gn, ("mlp.x", "mlp.branch")
                                                             if recompute else "norm."))
        # ---- attention branch
        w.begin()
        w.alloc(gc)
        go = linear(tag + "attention.o", H, H, gc, "attention.o.")  # d(merged heads), (T, H)
        if variant == "baseline":
            w.alloc(T * H * c, -go)  # made contiguous as (B, nh, S, hd)
            w.alloc(kv_exp, scores * c)  # P@V's backward: d(v) expanded, d(P)
            w.peak(tag + "attention.pv")
            w.free("attention.probs_cast", "attention.v")
            w.alloc(-T * H * c)
            w.alloc(scores * 4, -scores * c)  # d(P) to fp32
            # softmax's backward; on CUDA it first makes tmp = grad * output, a third fp32 (B, nh, S, S)
            # (aten/src/ATen/native/cuda/SoftMax.cu, softmax_backward_cuda_out), freed when it returns
            tmp = scores * 4 if est.device == "cuda" else 0
            w.alloc(scores * 4, tmp)
            w.peak(tag + "attention.softmax")
            w.alloc(-tmp)
            w.free("attention.probs_fp32")
            w.alloc(scores * c, -scores * 4, -scores * 4)  # back to the scores' dtype, then scaled
            w.alloc(2 * kv_exp)  # QKᵀ's backward: d(q), d(k) expanded
            w.peak(tag + "attention.qk")
            w.free("attention.q", "attention.k")
            w.alloc(-scores * c)
            dqkv = T * (nh + 2 * nkv) * hd * c
            w.alloc(dqkv)  # d(k), d(v) summed over each group; RoPE's backward for q and k
            w.peak(tag + "attention.rope")
            w.alloc(-kv_exp, -kv_exp, -kv_exp)
            gq = linear(tag + "attention.q", H, nh * hd, T * nh * hd * c, "attention.q.", to_residual=True)
            gk = linear(tag + "attention.k", H, nkv * hd, T * nkv * hd * c, "attention.k.", to_residual=True)
            gv = linear(tag + "attention.v", H, nkv * hd, T * nkv * hd * c, "attention.v.", to_residual=True)
            # without autocast q, k and v share one saved input ("attention.q+k+v.input")
            w.free("attention.", keep=() if layer == 0 else ("attention.rope_",))
            w.alloc(T * H * r)
            w.peak(tag + "attention.sum")
            w.alloc(-gq, -gk, -gv)
            gn = T * H * r
        else:
            w.alloc(kv_exp, B * nkv * S * hd * c, B * nkv * S * hd * c)  # SDPA's backward: dq, dk, dv
            # under GQA, cuDNN's backward writes dk and dv per query head in fp32 into one workspace, with
            # the fp32 dot(dO, O) row sums, and then sums each group into dk, dv (launches: gqa_reduce):
            # 2*T*nh*hd*4 + 4*B*nh*S + 256 bytes at all four GQA/MQA rows `anatomy forensics` traced on
            # the H200 (reports/h200/session13-mem/forensics), live at the step's backward peak in each
            ws = 2 * B * nh * S * hd * 4 + 4 * B * nh * S + 256 if nkv < nh and est.device == "cuda" else 0
            w.alloc(ws)
            w.peak(tag + "attention.sdpa")
            w.alloc(-ws, -go)
            w.free("attention.sdpa.")
            dqkv = T * (nh + 2 * nkv) * hd * c
            w.alloc(dqkv)  # rope_qkv's backward: d(qkv)
            w.peak(tag + "attention.rope")
            w.alloc(-kv_exp, -B * nkv * S * hd * c, -B * nkv * S * hd * c)
            if recompute:  # the qkv matmul's backward asks for its input: the norm runs again
                w.remake(linears_saved("attention", T, H, {"qkv": (nh + 2 * nkv) * hd}, dt, 1, dt.compute))
            gn = linear(tag + "attention.qkv", H, (nh + 2 * nkv) * hd, dqkv, "attention.qkv.")
        if layer == 0:
            w.free("attention.rope_")  # the tables are shared by every layer
        g = residual_add(tag + "attention residual add", g, norm(tag + "norm 1", gn,
                                                                  "attention.x" if recompute else "norm."))
    w.alloc(V * H * p)  # embedding_dense_backward's (V, H) gradient
    # tied: the head already left a gradient in the shared weight. AccumulateGrad adds in place when it
    # holds the only reference to that .grad: so on CUDA, where Liger's grad_weight storage became the
    # .grad, nothing more. Otherwise (autograd's own head gradient, or the CPU mirror's) the sum is a third.
    if cfg.tie_embeddings and not (variant == "efficient" and est.device == "cuda"):
        w.alloc(V * H * p)
    w.peak("embedding")
    return w.stages
