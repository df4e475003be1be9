"""A deliberate, calibrated GPU slowdown of one fused kernel or of attention: the gate's own check.

    ANATOMY_SLOWDOWN="rms_norm=1.15,attention=1.15"

is read only here (validations), never by anatomy/. For each named target, every call of its
implementation is followed by a spin kernel (torch.cuda._sleep) that lasts (factor - 1) x that
call's own GPU time, less the GPU time an extra kernel launch adds: the GPU then does what a kernel
`factor` times slower would. The call's own time is measured per target and argument shapes, with
events around its calls in the calibration rounds that the harness runs after its warm-up rounds,
when every round is queued behind the GPU round's spin (so the events time the GPU, not the host);
freeze() then fixes the spin per shape. Nothing is wrapped when the variable is unset or empty.

What each target wraps (module globals and methods that every path, the eager fast path and the
custom op alike, calls at run time; scripts/gate_check.sh slows each in turn):
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Callable

ENV = "ANATOMY_SLOWDOWN"


def _variant(pos: int, default: str = "swiglu") -> Callable:
    return lambda a, k: k.get("variant", a[pos] if len(a) > pos else default)


# target -> [(module, attribute, keep(args, kwargs) -> bool)]: the callables wrapped for it
TARGETS: dict[str, list[tuple[str, str, Callable]]] = {
    "rms_norm": [("llm_anatomy.kernels.rms_norm", "rms_norm_triton", None),
                 ("llm_anatomy.kernels.rms_norm", "rms_norm_backward_triton", None)],
    "swiglu": [("llm_anatomy.kernels.swiglu", "swiglu_triton", lambda a, k: _variant(2)(a, k) == "swiglu"),
               ("llm_anatomy.kernels.swiglu", "swiglu_backward_triton", lambda a, k: _variant(3)(a, k) == "swiglu")],
    "gpt_oss": [("llm_anatomy.kernels.swiglu", "swiglu_triton", lambda a, k: _variant(2)(a, k) == "gpt-oss"),
                ("llm_anatomy.kernels.swiglu", "swiglu_backward_triton", lambda a, k: _variant(3)(a, k) == "gpt-oss")],
    "rope_qkv": [("llm_anatomy.kernels.rope", "rope_qkv_triton", None),
                 ("llm_anatomy.kernels.rope", "rope_qkv_backward_triton", None)],
    # the whole fused op runs in forward (GEMMs, row kernel, gradients); backward only scales them
    "linear_ce": [("llm_anatomy.kernels.linear_ce", "_forward", None)],
    # SDPA forward here; its backward through hooks on the autograd node it creates
    "attention": [("torch.nn.functional", "scaled_dot_product_attention", None)],
    "adamw": [("torch.optim", "AdamW.step", None)],  # fused=True on CUDA: torch's _fused_adamw_
    "fused_ademamix": [("llm_anatomy.optim.efficient", "FusedAdEMAMix.step", None)],
}
__doc__ += "".join(f"    {t:15s} {', '.join(sorted({m + '.' + a for m, a, _ in w}))}\n" for t, w in TARGETS.items())


def parse(text: str) -> dict[str, float]:
    """'rms_norm=1.15, attention=1.15' -> {'rms_norm': 1.15, 'attention': 1.15}. Strict: every item is
    <target>=<factor>, the target one of TARGETS, named once, the factor a finite number > 1."""
    out: dict[str, float] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item and text.strip():
            raise ValueError(f"{ENV}: empty item in {text!r}")
        if not item:
            continue
        name, sep, factor = (s.strip() for s in item.partition("="))
        if not sep or name not in TARGETS:
            raise ValueError(f"{ENV}: bad item {item!r}: expected <target>=<factor>, target one of "
                             f"{', '.join(TARGETS)}")
        try:
            f = float(factor)
        except ValueError:
            f = math.nan
        if not (f > 1.0 and math.isfinite(f)):
            raise ValueError(f"{ENV}: factor {factor!r} for {name} must be a finite number > 1")
        if name in out:
            raise ValueError(f"{ENV}: {name} is named twice")
        out[name] = f
    return out


def from_env() -> dict[str, float]:
    return parse(os.environ.get(ENV, ""))


def _key(target: str, args, kwargs) -> tuple:
    """What a call's GPU time depends on: tensor shapes and dtypes, plain values; objects by identity."""
    import torch

    def one(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), str(v.dtype)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return tuple(one(u) for u in v)
        return type(v).__name__, id(v)
    return target, one(tuple(args)), one(tuple(sorted(kwargs.items())))


class Slowdown:
    """Installed wrappers for the targets in `factors`: idle (calls pass through), then calibrate()
    (calls are timed), then freeze() (each call is followed by its spin).

    rate: the spin kernel's cycles per second; launch_s: GPU time one extra kernel launch adds
    (gpu_clock.references). event/sleep are injectable for the CPU tests."""

    ROUNDS = 3  # calibration rounds the harness runs between calibrate() and freeze()
    MAX_SAMPLES = 16  # timed calls per shape, at most

    def __init__(self, factors: dict[str, float], *, rate: float, launch_s: float,
                 event: Callable | None = None, sleep: Callable[[int], None] | None = None):
        if event is None or sleep is None:
            import torch

            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            sleep = sleep or torch.cuda._sleep
        self.factors, self.rate, self.launch_s, self.event, self.sleep = factors, rate, launch_s, event, sleep
        self.samples: dict[tuple, list] = {}
        self.cycles: dict[tuple, int] = {}
        self.injected: dict[tuple, float] = {}  # key -> injected GPU time / the call's own GPU time
        self.state = "idle"
        self.calls: dict[str, int] = {}  # target -> calls while counting, in every state: does the work contain it?
        self.counting = True  # bench() counts only inside the timed work
        self._undo: list[Callable] = []

    # ---- timing or spinning around one call -------------------------------------------------------
    @property
    def frozen(self) -> bool:
        return self.state == "frozen"

    def calibrate(self) -> None:
        self.state = "calibrating"

    def _timing(self, key: tuple) -> bool:
        return self.state == "calibrating" and len(self.samples.setdefault(key, [])) < self.MAX_SAMPLES

    def _around(self, target: str, key: tuple, call: Callable):
        if self.state == "idle":
            return call()
        if not self.frozen:
            if not self._timing(key):
                return call()
            e0, e1 = self.event(), self.event()
            e0.record()
            out = call()
            e1.record()
            self.samples[key].append((e0, e1))
            return out
        out = call()
        self.spin(key)
        return out

    def spin(self, key: tuple) -> None:
        if key not in self.cycles:
            raise RuntimeError(f"{ENV}: {key[0]} ran with arguments not seen while calibrating: {key[1:]}")
        self.sleep(self.cycles[key])

    def freeze(self) -> dict[tuple, float]:
        """Fix the spin per call shape from the calibration calls: (factor - 1) x their median own time,
        less one launch. Returns the injected fraction (injected / own GPU time) per shape."""
        for key, pairs in self.samples.items():
            if not pairs:
                continue
            pairs[-1][1].synchronize()
            own = statistics.median(a.elapsed_time(b) * 1e-3 for a, b in pairs)
            extra = (self.factors[key[0]] - 1.0) * own
            self.cycles[key] = max(0, round((extra - self.launch_s) * self.rate))
            self.injected[key] = (self.launch_s + self.cycles[key] / self.rate) / own if own else math.inf
        self.state = "frozen"
        return self.injected

    # ---- installing the wrappers ------------------------------------------------------------------
    def install(self) -> "Slowdown":
        import importlib

        by_attr: dict[tuple[str, str], list[tuple[str, Callable]]] = {}
        for target in self.factors:
            for mod, attr, keep in TARGETS[target]:
                by_attr.setdefault((mod, attr), []).append((target, keep))
        for (mod, attr), targets in by_attr.items():
            owner = importlib.import_module(mod)
            *path, name = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            self._wrap(owner, name, targets)
        return self

    def _wrap(self, owner, name: str, targets: list[tuple[str, Callable]]) -> None:
        own = name in vars(owner)  # a class may inherit the method: restore by deleting the override then
        orig = getattr(owner, name)
        me = self

        def wrapped(*args, **kwargs):
            target = next((t for t, keep in targets if keep is None or keep(args, kwargs)), None)
            if target is None:
                return orig(*args, **kwargs)
            if me.counting:
                me.calls[target] = me.calls.get(target, 0) + 1
            key = _key(target, args, kwargs)
            out = me._around(target, key, lambda: orig(*args, **kwargs))
            if target == "attention" and getattr(out, "grad_fn", None) is not None:
                me._hook_backward(out.grad_fn, ("attention.bwd",) + key[1:])
            return out

        wrapped.__wrapped__ = orig
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, orig) if own else delattr(owner, name))

    def _hook_backward(self, node, key: tuple) -> None:
        """SDPA's backward is autograd's, not a Python call: count, time or spin it through hooks on its
        node (the post-hook runs right after the node's kernels are enqueued)."""
        self.factors.setdefault("attention.bwd", self.factors["attention"])
        timing = self._timing(key)
        frozen = self.frozen
        e0, e1 = self.event(), self.event()

        def pre(grad_outputs):
            if timing:
                e0.record()

        def post(grad_inputs, grad_outputs):
            if self.counting:
                self.calls["attention"] = self.calls.get("attention", 0) + 1
            if timing:
                e1.record()
                self.samples[key].append((e0, e1))
            elif frozen:
                self.spin(key)

        node.register_prehook(pre)
        node.register_hook(post)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
