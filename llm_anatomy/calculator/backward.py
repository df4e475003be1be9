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
CPU (llm_anatomy.measure.liveness). A stage's transients are the tensors of its largest moment, not every
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

from llm_anatomy.calculator import backward_baseline, backward_efficient
from llm_anatomy.calculator.attention import frees_mask
from llm_anatomy.calculator.allocator import BLOCK, rounded
from llm_anatomy.calculator.dtypes import dtypes
from llm_anatomy.calculator.types import BYTES, Estimate
from llm_anatomy.config import ModelConfig, Run

INPUTS = ("embedding.ids", "loss.targets")  # saved, but they are the step's inputs: no new storage


# what is live, by kind: the same kinds `anatomy forensics` gives each allocation
KINDS = ("parameter", "input", "optimizer state", "activation", "gradient / backward buffer")
GRAD = "gradient / backward buffer"
WALKED_LAYERS = 4  # stages listed: the last two layers' and the first two's (two walked, two shifted copies)
_HITS: dict[tuple, list[str]] = {}  # (saved names, free()'s names, keep) -> the saved names matched


def saved_sizes(est: Estimate, rnd) -> dict[str, int]:
    """{saved tensor's name: bytes of one instance, rounded by rnd} of the estimate's saved tensors but the
    step's inputs (INPUTS)."""
    return {s.name: rnd(prod(s.shape) * BYTES[s.dtype]) for c in est.components.values() for s in c.saved
            if s.name not in INPUTS}


@dataclass
class Stage:
    name: str  # e.g. "layer 3 attention.softmax"
    live: int  # bytes live at the stage's largest moment
    by_kind: dict[str, int] = field(default_factory=dict)  # the same bytes by KINDS


class Walk:
    """The live bytes by kind, and the candidate peaks recorded so far. Also the shapes and dtype sizes a
    stage needs (T, H, I, V, B, S, nh, nkv, hd; c, r, p the compute, residual and parameter bytes)."""

    def __init__(self, cfg: ModelConfig, run: Run, variant: str, est: Estimate, rnd, start: dict[str, int],
                 one: dict[str, int] | None = None):
        dt = dtypes(run)
        self.cfg, self.run, self.variant, self.est, self.dt, self.rnd = cfg, run, variant, est, dt, rnd
        self.c, self.r, self.p, self.amp = BYTES[dt.compute], BYTES[dt.residual], BYTES[dt.param], dt.autocast
        self.T, self.H, self.I, self.V = run.tokens, cfg.hidden, cfg.intermediate, cfg.vocab
        self.B, self.S, self.nh, self.nkv, self.hd = run.batch, run.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cuda, self.recompute = est.device == "cuda", run.recompute  # "none", "mlp" or "full"
        self.lean = variant == "efficient" and run.lean_block  # Run.lean: the efficient model's lean block
        self.rec: list = []  # the candidates so far: (name, activation, gradient bytes) of a walked stage, or a _Shifted run
        self.freed: set[str] = set()
        # what is live by KINDS: parameters, inputs and optimizer state stay as they start (fixed); a stage frees
        # or re-makes activations (act) and allocates gradients and backward buffers (grad)
        self.fixed = tuple(start.get(k, 0) for k in KINDS[:3])
        self.act, self.grad = start.get("activation", 0), start.get(GRAD, 0)
        self.one = dict(one) if one is not None else saved_sizes(est, rnd)  # saved name -> bytes of one instance
        self._names = tuple(self.one)
        self._remade: dict[str, list[tuple[str, int]]] = {}  # remake's tensors, sized once per walk
        self._hits: dict[tuple, list[str]] = {}  # free()'s matches for the present names
        self._norm: int | None = None  # free_norm's bytes for the present sizes
        self.hist: tuple[int, ...] | None = None  # the MoE routing histogram of every layer (None: balanced)

        self.blocks = BLOCK if rnd is rounded else 0  # the CUDA allocator's rounding, which alloc writes out

    @property
    def by(self) -> dict[str, int]:
        """The live bytes by KINDS."""
        return dict(zip(KINDS, (*self.fixed, self.act, self.grad)))

    @property
    def live(self) -> int:
        return sum(self.fixed) + self.act + self.grad

    def peak(self, name: str, *transients: int, kind: str = GRAD) -> None:
        """Record a candidate: what is live now, with these transients (each rounded) of `kind` (GRAD or
        "activation")."""
        if not transients:
            self.rec.append((name, self.act, self.grad))
            return
        extra, rnd = 0, self.rnd
        for t in transients:
            extra += rnd(t)
        if kind == GRAD:
            self.rec.append((name, self.act, self.grad + extra))
        elif kind == "activation":
            self.rec.append((name, self.act + extra, self.grad))
        else:
            raise ValueError(f"a stage's transients are activations or {GRAD!r}, not {kind!r}")

    def stage(self, rec: tuple, off: tuple[int, int] = (0, 0), name: str | None = None) -> Stage:
        """The Stage of a walked record (name, activation, gradient bytes), shifted by off (bytes of each)."""
        by = (*self.fixed, rec[1] + off[0], rec[2] + off[1])
        return Stage(rec[0] if name is None else name, sum(by), dict(zip(KINDS, by)))

    def stages(self) -> list[Stage]:
        """Every candidate recorded, in execution order."""
        out = []
        for r in self.rec:
            if type(r) is tuple:
                out.append(self.stage(r))
            else:
                out += [r.stage(self, self.rec[i]) for i in range(r.first, r.end)]
        return out

    def top(self) -> Stage:
        """The first largest candidate (max over stages() by live), without listing the others: a shifted run's
        largest is its source's largest, shifted."""
        rec = self.rec
        lives = [r[1] + r[2] if type(r) is tuple else 0 for r in rec]  # live bytes less the fixed kinds'
        for j, r in enumerate(rec):
            if type(r) is not tuple:
                lives[j] = max(lives[r.first:r.end]) + r.total
        j = lives.index(max(lives))  # the first largest
        if type(rec[j]) is tuple:
            return self.stage(rec[j])
        r = rec[j]
        src = lives[r.first:r.end]
        return r.stage(self, rec[r.first + src.index(max(src))])

    def free(self, *names: str, keep: tuple[str, ...] = ()) -> None:
        """Free one instance of each saved tensor named (a name ending in '.' or '_' is a prefix),
        once per layer (begin() starts a layer)."""
        if (hits := self._hits.get((names, keep))) is None:  # this walk's matches, for its present names
            key = (self._names, names, keep)
            if (hits := _HITS.get(key)) is None:  # the same names recur in every layer and every walk
                hits = _HITS[key] = [n for n in self.one if not n.startswith(keep) and
                                     any(n == x or (x[-1] in "._" and n.startswith(x)) for x in names)]
            self._hits[(names, keep)] = hits
        freed = self.freed
        for n in hits:
            if n not in freed:  # each freed once per layer
                freed.add(n)
                self.act -= self.one[n]

    def free_norm(self) -> None:
        """One RMSNorm instance's saved tensors (2 per layer + the final one share the names)."""
        if self._norm is None:
            self._norm = sum(b for n, b in self.one.items() if n.startswith("norm."))
        self.act -= self._norm

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
            self.act += b
        self._norm = None
        if new:
            self._names, self._hits = tuple(one), {}  # a remade name may be new to free()'s matches

    def alloc(self, *nbytes: int) -> None:
        """Allocate gradients or backward buffers of these sizes; a negative size frees one (each
        rounded on its own)."""
        total, block = 0, self.blocks
        if block:  # allocator.rounded, written out: whole blocks, at least one (0 for 0)
            mask = block - 1  # BLOCK is a power of two: b & mask is 0 for whole blocks (and 0), at any sign
            for b in nbytes:
                if not b & mask:  # most sizes: already whole blocks
                    total += b
                elif b > 0:
                    total -= (-b // block) * block
                else:
                    total += (b // block) * block
        else:
            rnd = self.rnd
            for b in nbytes:
                total += rnd(b) if b >= 0 else -rnd(-b)
        self.grad += total

    # ---- the stages both variants share ----------------------------------------------------------------
    def linear(self, tag: str, din: int, dout: int, grad_out: int, *saved: str, to_residual: bool = False,
               recast: bool = False, bias: int = 0) -> int:
        """One matmul's backward: the weight gradient (the compute dtype under autocast) and the input
        gradient, then the incoming gradient and the saved tensors go; under autocast the weight
        gradient is copied to the parameter's dtype. recast: a lean matmul (llm_anatomy/kernels/lean.py),
        which casts the weight again for the input gradient, live with both gradients, and on CUDA writes
        the weight gradient in fp32 itself (lean.fp32_grad: no copy). bias: the elements of addmm's bias,
        whose gradient (the incoming gradient's column sum) is made after the weight's: under autocast in the
        compute dtype, live while the weight gradient is copied, then copied itself (a lean matmul's is
        allocated in the parameter dtype at the end). Returns the bytes of the gradient passed on."""
        T, c, r, p = self.T, self.c, self.r, self.p
        copy = self.amp and not (recast and self.cuda)  # the weight gradient's copy to the parameter dtype
        wg = din * dout * (c if copy else p)
        self.alloc(wg, T * din * c)
        self.peak(tag, *((din * dout * c,) if recast else ()))
        self.free(*saved)
        dx, sizes = T * din * c, [-grad_out]  # allocated together: no candidate between them
        if to_residual and r != c:  # the input was an autocast copy of the residual: back to its dtype
            sizes += (T * din * r, -dx)
            dx = T * din * r
        cast_bias = bias if copy and not recast else 0
        if copy:
            sizes += (cast_bias * c, din * dout * p)
            self.alloc(*sizes)
            self.peak(tag + " grad to fp32")
            self.alloc(-wg)
        else:
            self.alloc(*sizes)
        self.alloc(bias * p, -cast_bias * c)
        return dx

    def input_buffer_sum(self, tag: str, nbytes: int) -> None:
        """A gradient of nbytes joins an earlier one of the same size in autograd's InputBuffer, which adds into
        the earlier one in place when it holds the only reference and no dispatch mode is active (ATen's
        isTensorSubclassLike is true for every tensor under a mode). So on CUDA the new one goes; on CPU the walk
        gives what the live-storage instrument reads (measure/liveness.py, a TorchDispatchMode): the sum is made,
        then both go (a plain CPU run adds in place, as CUDA does)."""
        if self.cuda:
            self.alloc(-nbytes)
            return
        self.alloc(nbytes)
        self.peak(tag)
        self.alloc(-2 * nbytes)

    def residual_add(self, g: int, branch: int) -> int:
        """The branch's gradient joins the skip's: autograd's input buffer adds it in place, as on CUDA. Under the
        CPU's instrument that add is out of place (input_buffer_sum), a transient of `branch` bytes the walk leaves
        out: no CPU claim's peak falls there (test_memory_walk, test_recompute and test_memory_model pass with it
        counted too)."""
        self.alloc(-branch)
        return g


VARIANT_STAGES = {"baseline": backward_baseline, "efficient": backward_efficient}


def walk(cfg: ModelConfig, run: Run, variant: str, est: Estimate, start: dict[str, int], rnd,
         every_layer: bool = False) -> list[Stage]:
    """Candidate peaks of one backward, in execution order. start: bytes live when it starts, by KINDS.
    every_layer walks each layer (the reference the shortcut is tested against)."""
    return walked(cfg, run, variant, est, start, rnd, every_layer).stages()


def walked(cfg: ModelConfig, run: Run, variant: str, est: Estimate, start: dict[str, int], rnd,
           every_layer: bool = False, one: dict[str, int] | None = None, hist: tuple[int, ...] | None = None) -> Walk:
    """The Walk of one backward, its candidates recorded (Walk.stages lists them, Walk.top finds the first
    largest). one: saved_sizes(est, rnd), where the caller has it. hist: the MoE routing histogram, the same in
    every layer (None: balanced)."""
    stages = VARIANT_STAGES[variant]
    w = Walk(cfg, run, variant, est, rnd, start, one)
    w.hist = hist
    g = stages.loss(w)
    g = stages.norm(w, "final norm", g)
    L = cfg.layers
    # the layers walked one by one at the bottom: 0, and 1 where it frees a shared mask (attention.frees_mask)
    low = 1 if variant == "efficient" and run.recompute != "full" and L > 1 and frees_mask(cfg, 1) else 0
    # under "full" each re-run builds its layer's mask: where some layers have one and others not (a window on the
    # even layers, no sinks) the layers differ, and each is walked
    every_layer = every_layer or (variant == "efficient" and run.recompute == "full" and cfg.window is not None
                                  and cfg.window_pattern != "all" and not cfg.attn_sinks)
    if not every_layer and L > WALKED_LAYERS + low:  # layers L - 1, L - 2 .. low + 1 as one walk of L - 1
        act, grad, first = w.act, w.grad, len(w.rec)
        g = stages.layer(w, L - 1, g)
        d_act, d_grad, end = w.act - act, w.grad - grad, len(w.rec)  # one layer's change, its records
        for layer, n in ((L - 2, 1), (low + 1, L - 2 - low)):  # n: the layers walked before it
            w.rec.append(_Shifted(first, end, f"layer {L - 1} ", f"layer {layer} ", (n * d_act, n * d_grad)))
        w.act, w.grad = act + (L - 1 - low) * d_act, grad + (L - 1 - low) * d_grad  # after layer low + 1
        for layer in range(low, -1, -1):
            g = stages.layer(w, layer, g)
    else:
        for layer in range(L - 1, -1, -1):
            g = stages.layer(w, layer, g)
    stages.embedding(w)
    return w


class _Shifted:
    """A layer's stages as another's (the walked records first..end), each shifted by `off` (activation and
    gradient bytes), the live bytes between the two layers' starts: a layer but the first (stages.layer's
    i == 0) runs the same allocations and frees whatever its index, which only names its stages."""
    __slots__ = ("first", "end", "old", "new", "off", "total")

    def __init__(self, first: int, end: int, old: str, new: str, off: tuple[int, int]):
        self.first, self.end, self.old, self.new, self.off = first, end, old, new, off
        self.total = sum(off)  # bytes: exact integers

    def stage(self, w: Walk, rec: tuple) -> Stage:
        """The shifted copy of one walked record (name, activation, gradient bytes)."""
        return w.stage(rec, self.off, self.new + rec[0].removeprefix(self.old))
