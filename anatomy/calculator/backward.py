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
elsewhere (validations/test_memory_walk.py: within ±3% on CPU; reports/cpu/claims.json).

Each variant's stages are in their own module (backward_baseline.py, backward_efficient.py). Identical
layers are walked once: every layer but the first runs the same allocations and frees whatever its index
(which only names its stages), so its live bytes change by the same amount from one layer to the next and
its stages are the last layer's shifted by the bytes between their starts. The walk runs the last layer and
the first, and lists the last two and the first two (layer L - 2's and layer 1's stages as the last
layer's, shifted); the candidates of the layers between are the same shifted again, their largest at one
end (a linear function of the layer), so the peak is the full walk's. Stages of those layers are not listed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from anatomy.calculator import backward_baseline, backward_efficient
from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.types import BYTES, Estimate
from anatomy.config import ModelConfig, Run

INPUTS = ("embedding.ids", "loss.targets")  # saved, but they are the step's inputs: no new storage


# what is live, by kind: the same kinds `anatomy forensics` gives each allocation
KINDS = ("parameter", "input", "optimizer state", "activation", "gradient / backward buffer")
GRAD = "gradient / backward buffer"
WALKED_LAYERS = 4  # stages listed: the last two layers' and the first two's (two walked, two shifted copies)
_HITS: dict[tuple, list[str]] = {}  # (saved names, free()'s names, keep) -> the saved names matched


@dataclass
class Stage:
    name: str  # e.g. "layer 3 attention.softmax"
    live: int  # bytes live at the stage's largest moment
    by_kind: dict[str, int] = field(default_factory=dict)  # the same bytes by KINDS


class Walk:
    """The live bytes by kind, and the candidate peaks recorded so far. Also the shapes and dtype sizes a
    stage needs (T, H, I, V, B, S, nh, nkv, hd; c, r, p the compute, residual and parameter bytes)."""

    def __init__(self, cfg: ModelConfig, run: Run, variant: str, est: Estimate, rnd, start: dict[str, int]):
        dt = dtypes(run)
        self.cfg, self.run, self.variant, self.est, self.dt, self.rnd = cfg, run, variant, est, dt, rnd
        self.c, self.r, self.p, self.amp = BYTES[dt.compute], BYTES[dt.residual], BYTES[dt.param], dt.autocast
        self.T, self.H, self.I, self.V = run.tokens, cfg.hidden, cfg.intermediate, cfg.vocab
        self.B, self.S, self.nh, self.nkv, self.hd = run.batch, run.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cuda, self.recompute = est.device == "cuda", run.recompute  # "none", "mlp" or "full"
        self.stages: list[Stage] = []
        self.freed: set[str] = set()
        self.by = {k: start.get(k, 0) for k in KINDS}
        self.one = {}  # saved name -> bytes of one instance
        for comp in est.components.values():
            for s in comp.saved:
                if s.name not in INPUTS:
                    self.one[s.name] = rnd(prod(s.shape) * BYTES[s.dtype])
        self._names = tuple(self.one)
        self._remade: dict[str, list[tuple[str, int]]] = {}  # remake's tensors, sized once per walk
        self._hits: dict[tuple, list[str]] = {}  # free()'s matches for the present names
        self._norm: int | None = None  # free_norm's bytes for the present sizes
        from anatomy.calculator.memory import BLOCK, rounded  # (memory imports this module)

        self.blocks = BLOCK if rnd is rounded else 0  # the CUDA allocator's rounding, which alloc writes out

    @property
    def live(self) -> int:
        return sum(self.by.values())

    def peak(self, name: str, *transients: int, kind: str = GRAD) -> None:
        by = dict(self.by)
        if transients:
            rnd = self.rnd
            for t in transients:
                by[kind] += rnd(t)
        self.stages.append(Stage(name, sum(by.values()), by))

    def free(self, *names: str, keep: tuple[str, ...] = ()) -> None:
        """Free one instance of each saved tensor named (a name ending in '.' or '_' is a prefix),
        once per layer (begin() starts a layer)."""
        if (hits := self._hits.get((names, keep))) is None:  # this walk's matches, for its present names
            key = (self._names, names, keep)
            if (hits := _HITS.get(key)) is None:  # the same names recur in every layer and every walk
                hits = _HITS[key] = [n for n in self.one if not n.startswith(keep) and
                                     any(n == x or (x[-1] in "._" and n.startswith(x)) for x in names)]
            self._hits[(names, keep)] = hits
        for n in hits:
            if n not in self.freed:
                self.freed.add(n)
                self.by["activation"] -= self.one[n]

    def free_norm(self) -> None:
        """One RMSNorm instance's saved tensors (2 per layer + the final one share the names)."""
        if self._norm is None:
            self._norm = sum(b for n, b in self.one.items() if n.startswith("norm."))
        self.by["activation"] -= self._norm

    def begin(self) -> None:
        self.freed = set()

    def remake(self, what: str, saved) -> None:
        """A checkpoint's recompute makes these saved tensors again (one instance each), as activations. saved:
        a function giving them, called once per walk (every layer remakes the same); what names it."""
        if (sized := self._remade.get(what)) is None:
            sized = self._remade[what] = [(s.name, self.rnd(prod(s.shape) * BYTES[s.dtype])) for s in saved()]
        one, new = self.one, False
        for n, b in sized:
            new = new or n not in one
            one[n] = b
            self.by["activation"] += b
        self._norm = None
        if new:
            self._names, self._hits = tuple(one), {}  # a remade name may be new to free()'s matches

    def alloc(self, *nbytes: int) -> None:
        """Allocate gradients or backward buffers of these sizes; a negative size frees one (each
        rounded on its own)."""
        total, block = 0, self.blocks
        if block:  # memory.rounded, written out: whole blocks, at least one (0 for 0)
            for b in nbytes:
                if b > 0:
                    total -= (-b // block) * block
                elif b < 0:
                    total += (b // block) * block
        else:
            rnd = self.rnd
            for b in nbytes:
                total += rnd(b) if b >= 0 else -rnd(-b)
        self.by[GRAD] += total

    # ---- the stages both variants share ----------------------------------------------------------------
    def linear(self, tag: str, din: int, dout: int, grad_out: int, *saved: str, to_residual: bool = False,
               recast: bool = False) -> int:
        """One matmul's backward: the weight gradient (the compute dtype under autocast) and the input
        gradient, then the incoming gradient and the saved tensors go; under autocast the weight
        gradient is copied to the parameter's dtype. recast: a lean matmul (anatomy/kernels/lean.py),
        which casts the weight again for the input gradient, live with both gradients. Returns the bytes
        of the gradient passed on."""
        T, c, r, p = self.T, self.c, self.r, self.p
        wg = din * dout * (c if self.amp else p)
        self.alloc(wg, T * din * c)
        self.peak(tag, *((din * dout * c,) if recast else ()))
        self.alloc(-grad_out)
        self.free(*saved)
        dx = T * din * c
        if to_residual and r != c:  # the input was an autocast copy of the residual: back to its dtype
            self.alloc(T * din * r)
            self.alloc(-dx)
            dx = T * din * r
        if self.amp:
            self.alloc(din * dout * p)
            self.peak(tag + " grad to fp32")
            self.alloc(-wg)
        return dx

    def residual_add(self, g: int, branch: int) -> int:
        """The branch's gradient joins the skip's: autograd's input buffer adds it in place."""
        self.alloc(-branch)
        return g


VARIANT_STAGES = {"baseline": backward_baseline, "efficient": backward_efficient}


def walk(cfg: ModelConfig, run: Run, variant: str, est: Estimate, start: dict[str, int], rnd,
         every_layer: bool = False) -> list[Stage]:
    """Candidate peaks of one backward, in execution order. start: bytes live when it starts, by KINDS.
    every_layer walks each layer (the reference the shortcut is tested against)."""
    stages = VARIANT_STAGES[variant]
    w = Walk(cfg, run, variant, est, rnd, start)
    g = stages.loss(w)
    g = stages.norm(w, "final norm", g)
    L = cfg.layers
    if not every_layer and L > WALKED_LAYERS:  # layers L - 1, L - 2 and 1 as one walk of L - 1, then 0
        start, first = dict(w.by), len(w.stages)
        g = stages.layer(w, L - 1, g)
        src = w.stages[first:]
        delta = {k: w.by[k] - start[k] for k in KINDS}  # one layer's change
        for layer, n in ((L - 2, 1), (1, L - 2)):  # n: the layers walked before it
            _repeat(w, src, L - 1, layer, {k: n * delta[k] for k in KINDS})
        w.by = {k: start[k] + (L - 1) * delta[k] for k in KINDS}  # after layer 1
        g = stages.layer(w, 0, g)
    else:
        for layer in range(L - 1, -1, -1):
            g = stages.layer(w, layer, g)
    stages.embedding(w)
    return w.stages


def _repeat(w: Walk, src: list[Stage], src_layer: int, layer: int, off: dict[str, int]) -> None:
    """Layer `layer`'s stages as layer `src_layer`'s (src), each shifted by `off`, the live bytes between the
    two layers' starts: a layer but the first (stages.layer's i == 0) runs the same allocations and frees
    whatever its index, which only names its stages."""
    old, new = f"layer {src_layer} ", f"layer {layer} "
    moved, total = [(k, b) for k, b in off.items() if b], sum(off.values())  # bytes: exact integers
    for st in src:
        by = dict(st.by_kind)
        for k, b in moved:
            by[k] += b
        w.stages.append(Stage(new + st.name.removeprefix(old), st.live + total, by))
