"""The efficient MoE block's forward inside a checkpoint (Run.recompute "mlp" or "full": llm_anatomy/efficient/moe.py
under efficient/mlp.py's recomputed_tail or efficient/transformer.py's BlockCheckpoint), allocation by allocation.

Inside a checkpoint nothing is saved: what lives is what the code still holds. The block's locals (the router's fp32
logits and state, the slot order, pos, offs, xs, y, the output) all live until the block returns; gate_up, h and the
expert biases' casts are Experts.forward's locals, gone when it returns y. So the block's largest moment is inside
it, at one of the allocations below; region_peak replays them in the code's order, the
order the live-storage traces on CPU show (llm_anatomy.measure.liveness), and returns the largest live sum. Under
autocast the router's and the shared experts' weight casts stay in autocast's cache to the end of the forward (they
are counted here when made, and by memory.py's cached casts for the other layers); the stacked experts' casts are
the block's own .to(), freed when their GEMM returns. Where the block folds expert biases into the GEMMs
(moe_efficient.FOLD, under autocast), each GEMM's folded input and weight are made by two cats beside the plain
ones; where it adds them after the GEMMs (no autocast), each row's expert (N,) int32 lives through both GEMMs and
each GEMM's gathered bias rows until the in-place add.

Pure Python (no torch): the calculator never reads the model.
"""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.moe import shared_width
from llm_anatomy.calculator.moe_efficient import FOLD, added_bias, fold
from llm_anatomy.calculator.types import BYTES
from llm_anatomy.config import ModelConfig, Run

I64, F32, I32 = 8, 4, 4


class Live:
    """Bytes alive by name (each rounded by rnd), and the largest sum seen after an allocation. saved: in a
    re-run in backward, the names an op saves, which the checkpoint keeps where the forward drops them."""

    def __init__(self, rnd, saved: tuple[str, ...] = ()):
        self.rnd, self.now, self.top, self.held, self.saved = rnd, 0, 0, {}, saved

    def alloc(self, name: str, nbytes: int) -> None:
        b = self.rnd(nbytes)
        self.held[name] = self.held.get(name, 0) + b
        self.now += b
        self.top = max(self.top, self.now)

    def free(self, *names: str) -> None:
        for n in names:
            if n not in self.saved:
                self.now -= self.held.pop(n, 0)


def moe_casts(cfg: ModelConfig, run: Run, rnd) -> int:
    """The MoE block's weight casts autocast caches per layer: the router's (and its bias's) and the shared
    experts' gate_up and down (nn.Linear's); 0 without autocast."""
    dt = dtypes(run)
    if not dt.autocast:
        return 0
    c, E, H, Is = BYTES[dt.compute], cfg.experts, cfg.hidden, shared_width(cfg)
    out = rnd(E * H * c) + (rnd(E * c) if cfg.router_bias else 0)
    return out + (rnd(2 * Is * H * c) + rnd(Is * H * c) if Is else 0)


# what the region's ops save but its code lets go: kept by a re-run in backward, freed in forward
RERUN_KEPT = ("topk values", "topk sum", "cast", "x folded", "w folded", "gate_up")


def region_peak(cfg: ModelConfig, run: Run, rnd, rerun: bool = False) -> int:
    """The largest live bytes inside the last layer's MoE region in forward, beyond what lived before it: from the
    residual sum its norm reads to the block output's add, with the region's cached casts and, with a load-balancing
    loss, the statistics every MoE layer stashes until the loss (less the model's f, which the loss makes from them
    and the saved list counts).

    rerun: the same inside a layer's re-run in backward (backward_moe_recompute.py), from its sum to the early stop:
    the tensors the ops save stay (RERUN_KEPT), no statistics are stashed, and it stops at the last tensor saved
    (the shared experts' down's input and cast, else the unpermute's, after its output is made)."""
    dt = dtypes(run)
    T, H, E, K, I = run.tokens, cfg.hidden, cfg.experts, cfg.experts_per_token, cfg.expert_intermediate
    N, c, r, Is = T * K, BYTES[dt.compute], BYTES[dt.residual], shared_width(cfg)
    f, added = fold(cfg, run), added_bias(cfg, run)  # the grouped path (the phases refuse the loop of mm)
    v = Live(rnd, RERUN_KEPT if rerun else ())
    v.alloc("sum", T * H * r)
    v.alloc("x", T * H * c)  # the norm's output, the block's input
    if dt.autocast:  # cached
        v.alloc("router cast", E * H * c)
        if cfg.router_bias:
            v.alloc("router bias cast", E * c)
    v.alloc("logits", T * E * c)
    v.alloc("logits32", T * E * F32)
    v.free("logits")
    _route(v, cfg, T, E, K)
    _permutation(v, N, E)
    if cfg.router_aux_coef > 0 and cfg.router == "topk-softmax":  # the balance's softmax over every expert
        v.alloc("probs", T * E * F32)
    if cfg.router_aux_coef > 0 and not rerun:  # the statistics: torch.diff's prepend and cat, then f and P
        v.alloc("counts zero", I32)
        v.alloc("counts cat", (E + 1) * I32)
        v.alloc("counts", E * I32)
        v.free("counts zero", "counts cat")
        v.alloc("f", E * F32)
        v.alloc("P", E * F32)
    v.alloc("order // k", N * I64)
    v.alloc("xs", N * H * c)
    v.free("order // k")
    if f:  # the biases' casts, Experts.forward's locals
        v.alloc("bias casts", E * 2 * I * c)
        v.alloc("bias casts", E * H * c)
    if added:  # each row's expert: searchsorted of an arange over offs
        v.alloc("rows arange", N * I32)
        v.alloc("rows", N * I32)
        v.free("rows arange")
    _gemm(v, "gate_up", N, H, 2 * I, E, c, f, dt.autocast, added)
    v.alloc("h", N * I * c)
    _gemm(v, "y", N, I, H, E, c, f, dt.autocast, added)
    # Experts.forward returns y: its locals go, but a re-run keeps what an op saved: gate_up (the activation's
    # input) and h (the down GEMM's, unless it folds a bias and saves the folded copy instead)
    v.free("gate_up", "rows", *(("h", "bias casts") if f else () if rerun else ("h",)))
    v.alloc("out", T * H * c)  # the unpermute
    if Is:
        if dt.autocast:
            v.alloc("shared casts", 2 * Is * H * c)
        v.alloc("shared gate_up", T * 2 * Is * c)
        v.alloc("shared h", T * Is * c)
        if dt.autocast:
            v.alloc("shared casts", Is * H * c)
        if rerun:
            return v.top
        v.alloc("shared out", T * H * c)
        v.free("shared gate_up", "shared h")
        v.alloc("sum out", T * H * c)
        v.free("out", "shared out")
    return v.top if rerun else v.top + stash(cfg, rnd)


def stash(cfg: ModelConfig, rnd) -> int:
    """With a load-balancing loss, in forward: the (f, P) the layers before the last stash until the loss, less the
    model's f, which the saved list counts and the loss makes from them (0 without the loss)."""
    if not (cfg.moe and cfg.router_aux_coef > 0):
        return 0
    return (cfg.layers - 1) * 2 * rnd(cfg.experts * F32) - rnd(cfg.experts * F32)


def _route(v: Live, cfg: ModelConfig, T: int, E: int, K: int) -> None:
    """efficient/moe.py's route: what stays is the block's local state (probs, weights, indices)."""
    if cfg.router == "softmax-topk":
        v.alloc("probs", T * E * F32)
        v.alloc("topk values", T * K * F32)
        v.alloc("idx", T * K * I64)
        if cfg.norm_topk:
            v.alloc("topk sum", T * F32)
            v.alloc("w", T * K * F32)
            v.free("topk sum", "topk values")
        return
    v.alloc("values", T * K * F32)
    v.alloc("idx", T * K * I64)
    v.alloc("w", T * K * F32)
    v.free("values")


def _permutation(v: Live, N: int, E: int) -> None:
    """efficient/moe.py's permutation: the stable sort's values go at once; the sorted ids, the aranges and
    searchsorted's int64 row ends go before it returns; order, offs and pos stay."""
    v.alloc("sorted", N * I64)
    v.alloc("order", N * I64)
    v.free("sorted")
    v.alloc("expert", N * I64)
    v.alloc("arange E", E * I64)
    v.alloc("ends", E * I64)
    v.free("arange E")
    v.alloc("offs", E * I32)
    v.free("ends")
    v.alloc("pos", N * I64)
    v.alloc("arange N", N * I64)
    v.free("arange N", "expert")


def _gemm(v: Live, out: str, N: int, k: int, n: int, E: int, c: int, f: int, cast: bool, added: bool) -> None:
    """One grouped GEMM (N rows, (n, k) weights per expert, k + f with a folded bias) and its output, kept as a
    local: under autocast the stacked weight's cast first (the weights are in the compute dtype otherwise: no
    copy); a folded bias's ones block, input cat, zeros and weight cat; all but the output go when it returns.
    added: the bias rows gathered after it (N, n), gone once added into the output in place."""
    if cast:
        v.alloc("cast", E * n * k * c)
    if f:
        v.alloc("ones", N * FOLD * c)
        v.alloc("x folded", N * (k + f) * c)
        v.alloc("zeros", E * n * (FOLD - 1) * c)
        v.alloc("w folded", E * n * (k + f) * c)
        v.free("zeros", "ones")
        if cast:  # the plain cast's last name is rebound to the folded one (saved in its place)
            v.now -= v.held.pop("cast")
        v.alloc(out, N * n * c)
        v.free("x folded", "w folded")
        return
    v.alloc(out, N * n * c)
    if added:
        v.alloc("bias rows", N * n * c)
        v.free("bias rows")
    if cast:
        v.free("cast")
