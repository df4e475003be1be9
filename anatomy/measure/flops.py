"""FLOPs per component, counted with FlopCounterMode's own per-op formulas (the 'counter' convention).

The formulas are torch's (matmul 2mnk, SDPA backward 2.5× forward, no causal discount); only the
attribution to components is ours (see components.py). `total` comes from a FlopCounterMode run
alongside, so the per-component split is checked to add up to torch's own total."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from anatomy.measure.components import ComponentTracker


class _PerComponent(TorchDispatchMode):
    def __init__(self, tracker: ComponentTracker):
        super().__init__()
        self.tracker = tracker
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.counts[self.tracker.label] += formula(*args, **kwargs, out_val=out)
        return out


def count_flops(model: torch.nn.Module, run_forward, backward: bool = True) -> dict:
    """run_forward() -> scalar loss. Returns {'forward': {comp: flops, ..., 'total': n}, 'backward': {...}}."""
    res = {}
    with ComponentTracker(model, track_backward=backward) as tracker:
        with FlopCounterMode(display=False) as total, _PerComponent(tracker) as per:
            loss = run_forward()
        res["forward"] = dict(per.counts, total=total.get_total_flops())
        if backward:
            tracker.tag_backward()
            with FlopCounterMode(display=False) as total, _PerComponent(tracker) as per:
                loss.backward()
            res["backward"] = dict(per.counts, total=total.get_total_flops())
    return res
