"""The efficient mixture-of-experts block: route on device, permute once, two grouped GEMMs around one fused
activation, and one fused unpermute + weighted sum.

    x (T, H) -> router logits (T, E) -> fp32 softmax/top-k -> weights (T, K), experts (T, K)
    slots s = t*K + j, stable-sorted by expert -> order (N,), N = T*K; pos = order's inverse (N,)
    xs = x[order // K] (N, H)                                    the only permute: one gather (Permute)
    gate_up = grouped_mm(xs, W_gu^T, offs) (+ b_gu[e])       (N, 2I)
    h = swiglu_packed(gate_up)                               (N, I)     llm_anatomy.kernels.swiglu
    y = grouped_mm(h, W_down^T, offs) (+ b_down[e])          (N, H)
    out[t] = sum_j w[t, j] * y[pos[t*K + j]]                 (T, H)     llm_anatomy.kernels.moe_unpermute
    (+ the shared experts: the efficient dense MLP of width shared_experts * shared_intermediate)

No host sync. Every routing quantity stays on the device: the sort is torch.argsort(stable=True), the
per-expert row ends are a searchsorted of the sorted expert ids (offs, int32, what torch._grouped_mm takes),
the inverse permutation a scatter. Nothing reads a tensor's value on the host (validations/
test_moe_efficient_ops.py dispatches the forward and backward and finds no op that syncs, and compiles the
block with fullgraph=True), so the host can run ahead of the GPU through the whole layer.

Grouped GEMMs. torch._grouped_mm runs every expert's GEMM in one launch over the sorted rows (CUTLASS on
CUDA sm90+; torch's own loop over the groups on CPU, reading offs in host memory). It takes bf16 operands
with 16-byte row strides only (H and I multiples of 8), which is also all its meta/fake kernel accepts, and
no bias: gpt-oss's expert biases ride in the GEMM as an extra input column of ones (_fold_bias) where the
weights are cast anyway (amp); where they are not (the bf16 policy, FSDP2's bf16 gathers) a fold would copy
every expert's weights, so each row gets its expert's bias added after the GEMM (ExpertBias). Where those do
not hold (fp32 training, odd widths, GPUs before sm90) the fallback is a loop of one mm (addmm) per expert
over the row ends, read to the host once per layer forward (one sync; backward reuses the slices autograd
recorded). The choice is by capability (_native), never a flag; all paths give the same function and keep the
same tensors but offs, which only the grouped kernel keeps, and the 8 folded columns of xs, h and the weight
casts with folded biases.

What is saved (T tokens, N = T*K rows, c = compute dtype bytes): the router's input x (T, H) and, under amp,
its weight cast; the fp32 softmax (T, E) (softmax-topk), or the top-k softmax (T, K) (topk-softmax); top-k's
indices (T, K) int64; the top-k sum (T, 1) and weights (T, K) fp32 when norm_topk divides by it; xs (N, H),
gate_up (N, 2I), h (N, I) and y (N, H) in c; offs (E,) int32 on the
grouped path; under amp the two expert weight casts; pos (N,) int64 and the fp32 weights (T, K) for the
unpermute. llm_anatomy/calculator/moe_efficient.py counts them.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from llm_anatomy.baseline.transformer import compute_dtype
from llm_anatomy.config import ModelConfig
from llm_anatomy.efficient.mlp import MLP, recomputed_tail
from llm_anatomy.kernels import swiglu_packed
from llm_anatomy.kernels.moe_unpermute import moe_unpermute


def route(logits: Tensor, cfg: ModelConfig) -> tuple[Tensor | None, Tensor, Tensor]:
    """logits (T, E) fp32 -> (softmax over all E (T, E) or None, weights (T, K) fp32, experts (T, K) int64).
    The softmax over all experts is returned where the router computes it anyway (softmax-topk)."""
    k = cfg.experts_per_token
    if cfg.router == "softmax-topk":
        probs = torch.softmax(logits, -1)  # saved: softmax's output
        w, idx = probs.topk(k, -1)  # saves its indices
        if cfg.norm_topk:
            w = w / w.sum(-1, keepdim=True)  # saves w and the (T, 1) sum
        return probs, w, idx
    v, idx = logits.topk(k, -1)
    return None, torch.softmax(v, -1), idx  # softmax saves its (T, K) output


def permutation(idx: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """idx (T, K) expert of each slot -> (order (N,) slots sorted by expert, stable so tokens keep their order
    within an expert; pos (N,) the sorted row of each slot; offs (E,) int32 the end row of each expert). All on
    idx's device, none read on the host."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)  # ascending
    offs = torch.searchsorted(expert, torch.arange(experts, device=idx.device), right=True).to(torch.int32)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=idx.device))
    return order, pos, offs


class Permute(torch.autograd.Function):
    """xs = x[order // K] (N, H): the tokens in expert order, one gather. Backward sums each token's K rows of
    d(xs) with the unpermute kernel at weight 1 (fp32 sums, one rounding, no atomics: deterministic, where
    index_select's own backward is an atomic index_add), and keeps only pos, which the unpermute keeps anyway."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, pos: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(pos)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, dxs: Tensor):
        (pos,) = ctx.saved_tensors
        return moe_unpermute(dxs, pos, dxs.new_ones(pos.numel() // ctx.k, ctx.k)), None, None, None


def _native(dtype: torch.dtype, widths: tuple[int, ...], device: torch.device) -> bool:
    """Does torch._grouped_mm have a kernel for these operands: bf16, every width a multiple of 8 elements
    (16-byte strides), on CPU or meta (torch's loop, and its fake kernel) or on CUDA sm90+ (CUTLASS)?"""
    if dtype is not torch.bfloat16 or any(w % 8 for w in widths):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type in ("cpu", "meta")


PAD = 8  # the bias column and 7 zeros: the folded K stays a multiple of 8 (16-byte bf16 strides)


def _fold_bias(x: Tensor, w: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """x (N, K), w (E, M, K), bias (E, M) -> x' (N, K+8) = [x, 1, 0...], w' (E, M, K+8) = [w, bias, 0...]: then
    x' @ w'[e]^T = x @ w[e]^T + bias[e], summed in the GEMM's fp32 accumulator and rounded once, as addmm does."""
    ones = x.new_zeros(x.shape[0], PAD)
    ones[:, 0] = 1
    return torch.cat([x, ones], 1), torch.cat([w, bias.unsqueeze(-1), w.new_zeros(*w.shape[:2], PAD - 1)], 2)


class ExpertBias(torch.autograd.Function):
    """out (N, M) rows sorted by expert, in place += bias (E, M) of each row's expert (rows (N,) int32): a bias
    after the grouped GEMM, which has no bias epilogue (torch raises "Bias not supported yet"), rounding the sum
    twice where addmm rounds once (one bf16 ulp). Backward: d(bias)[e] is the sum of d(out)'s rows of e, taken
    as one grouped GEMM of a ones block against d(out) over the same row ends (fp32 sums, one rounding, no
    atomics, where index_select's own backward is a bf16 atomic index_add); keeps only offs, which the GEMM
    keeps anyway."""

    @staticmethod
    def forward(ctx, out: Tensor, bias: Tensor, rows: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(offs)
        ctx.mark_dirty(out)
        out.add_(bias.index_select(0, rows))
        return out  # the dirty input itself (torch.compile traces mark_dirty only so)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        (offs,) = ctx.saved_tensors
        ones = d_out.new_ones(d_out.shape[0], PAD).t()  # (8, N) column-major: 16-byte strides for any N
        d_bias = torch._grouped_mm(ones, d_out, offs=offs)  # (E, 8, M), every one of the 8 rows the sum
        return d_out, d_bias[:, 0].contiguous(), None, None


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor, bounds: list[int] | None, bias: Tensor | None = None,
               dtype: torch.dtype | None = None, rows: Tensor | None = None) -> Tensor:
    """x (N, K) rows sorted by group, w (E, M, K) (nn.Linear's layout per group), offs (E,) int32 row ends,
    bias (E, M) or None -> (N, M): the rows of group e times w[e]^T, plus bias[e]. bounds None: torch._grouped_mm
    (one launch; a bias folded into it where w is cast here (_fold_bias), else added after it to each row of
    rows (N,) int32, its group (ExpertBias)); else the fallback, one mm (addmm with a bias, as nn.Linear adds it)
    per group over the host's copy of offs.
    dtype: w is cast here, so the unfolded cast is this frame's own local and dies when the fold replaces it. A
    cast made in the caller's argument list would live as long as the caller's call does wherever CPython runs
    frames through a PEP 523 evaluator (torch.compile installs one; it stays for the process), so its lifetime,
    and the block's peak, would depend on what ran earlier in the process."""
    cast = dtype is not None and w.dtype != dtype
    w = w.to(dtype) if cast else w
    if bounds is None:
        if bias is not None and cast:
            x, w = _fold_bias(x, w, bias)
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # saves x, the (cast) weight and offs
        return out if bias is None or cast else ExpertBias.apply(out, bias, rows, offs)
    out, start = [], 0
    for e, end in enumerate(bounds):  # each mm saves its row slice (a view of x) and w[e]
        wt = w[e].t()
        out.append(x[start:end] @ wt if bias is None else torch.addmm(bias[e], x[start:end], wt))
        start = end
    return torch.cat(out)


class Experts(nn.Module):
    """The routed experts' weights, stacked (nn.Linear's (out, in) convention per expert), and their MLP over rows
    sorted by expert. Expert parallel (distributed/expert_parallel.py) keeps a slice of them on each rank and runs
    this same forward on the rows it receives."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.experts, cfg.hidden, cfg.expert_intermediate
        self.cfg = cfg
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))  # rows 0..I-1 the gate, I..2I-1 the up
        self.down = nn.Parameter(torch.empty(E, H, I))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I)) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(E, H)) if cfg.expert_bias else None

    def forward(self, xs: Tensor, offs: Tensor, dt: torch.dtype) -> Tensor:
        """xs (N, H) in dt, rows sorted by expert; offs (E,) int32 the row end of each of this module's experts
        -> y (N, H): two grouped GEMMs around the fused activation."""
        cfg, H, I = self.cfg, self.cfg.hidden, self.cfg.expert_intermediate
        bounds = None if _native(dt, (H, I), xs.device) else offs.tolist()  # the loop's one host read
        b_gu, b_down = (None if b is None else b.to(dt) for b in (self.gate_up_bias, self.down_bias))
        rows = None  # each row's expert, for biases added after the GEMMs (weights not cast: ExpertBias)
        if bounds is None and cfg.expert_bias and self.gate_up.dtype == dt:
            rows = torch.searchsorted(offs, torch.arange(xs.shape[0], device=xs.device, dtype=offs.dtype),
                                      right=True, out_int32=True)  # (N,) int32, on the device
        gate_up = grouped_mm(xs, self.gate_up, offs, bounds, b_gu, dt, rows)  # (N, 2I)
        h = swiglu_packed(gate_up, cfg.mlp)  # (N, I)
        return grouped_mm(h, self.down, offs, bounds, b_down, dt, rows)  # (N, H)


class MoE(nn.Module):
    component = "moe"

    def __init__(self, cfg: ModelConfig, lean: bool = False):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=cfg.router_bias)
        self.experts = Experts(cfg)
        if cfg.shared_experts:  # lean: the shared MLP's own lean form (llm_anatomy/kernels/lean.py)
            self.shared = MLP(cfg.hidden, cfg.shared_experts * cfg.shared_intermediate, cfg.mlp, lean)
        self.aux: tuple[Tensor, Tensor] | None = None  # (f, P) of the last forward, when router_aux_coef > 0
        # does this forward stash (f, P)? The model's forward sets it and its loss clears it: a checkpoint's re-run
        # in backward (Run.recompute) stashes nothing, as a stash would hold P's graph, and with it the re-run's
        # saved tensors, past the step
        self.collect = False

    def forward(self, x: Tensor, norm: nn.Module | None = None, branch: Tensor | None = None) -> Tensor:
        """x (B, S, H), normed -> the block's MoE output; with norm and branch (Run.recompute == "mlp") x is the
        block's input and the result the block's output (efficient/mlp.py's recomputed_tail)."""
        return self._moe(x) if norm is None else recomputed_tail(self._moe, x, norm, branch)

    def _moe(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        E, K, H = cfg.experts, cfg.experts_per_token, cfg.hidden
        # the router's dtype: autocast's, or the one FSDP2's MixedPrecisionPolicy gathers it in; the experts may be
        # FSDP2's ignored fp32 parameters (expert parallel under amp), which Experts.forward casts to it
        dt = compute_dtype(self.router.weight)
        x2 = x.reshape(-1, H).to(dt)  # (T, H)
        logits = self.router(x2).float()  # (T, E), computed in dt, routed in fp32
        probs, w, idx = route(logits, cfg)
        order, pos, offs = permutation(idx, E)
        if cfg.router_aux_coef > 0:  # the softmax over every expert runs in a checkpoint's re-run too (it saves)
            probs = torch.softmax(logits, -1) if probs is None else probs
            if self.collect:
                counts = torch.diff(offs, prepend=offs.new_zeros(1))
                self.aux = (counts.float().div_(x2.shape[0]), probs.mean(0))  # f (E,) detached, P (E,)
        xs = Permute.apply(x2, order, pos, K)  # (N, H): the token of each sorted row
        y = self.experts(xs, offs, dt)  # (N, H)
        out = moe_unpermute(y, pos, w)  # (T, H); rounds w to dt inside, returns d(w) in fp32
        if cfg.shared_experts:
            out = out + self.shared(x2)
        return out.view(x.shape)


class LoadBalancingLoss(nn.Module):
    """transformers' load_balancing_loss_func over every layer's tokens together: E * sum_e f_e * P_e, with f
    (slots routed to e per token) and P (mean router probability) each averaged over the layers first. A module
    of the "moe" component so that what it keeps, the layer-mean f (E,) fp32 for P's gradient, is credited to it."""
    component = "moe"

    def forward(self, stats: list[tuple[Tensor, Tensor]], experts: int) -> Tensor:
        f = torch.stack([s[0] for s in stats]).mean(0)
        p = torch.stack([s[1] for s in stats]).mean(0)
        return experts * (f * p).sum()  # the product keeps f
