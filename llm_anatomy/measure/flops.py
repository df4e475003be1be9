"""FLOPs per component, counted with FlopCounterMode's own per-op formulas (the 'counter' convention).

The formulas are torch's (matmul 2mnk, SDPA backward 2.5× forward, no causal discount); only the
attribution to components is ours (see components.py). `total` comes from a FlopCounterMode run
alongside, so the per-component split is checked to add up to torch's own total.

Two gaps in some torch releases are bridged through FlopCounterMode's custom_mapping, each by
re-calling torch's own formula with arguments it accepts (the counts themselves are unchanged):
- torch 2.11's SDPA formulas reject grouped-query shapes (k/v with fewer heads than q); counted as
  the kernel computes them: k/v broadcast to the query's heads (torch 2.13's formula does the same).
- addmm's dtype overload (`out_dtype=`, used by Liger's fp32 weight-gradient accumulation) passes
  an extra positional that collides with the formula's out_shape; counted as the mm it is.
One op has no formula in torch 2.13: aten._grouped_mm (the MoE block's expert GEMMs) counts 0. It is counted as
the mms it groups, 2mnk summed over the groups, which its shapes give whatever the offsets (_grouped_mm_flops).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from llm_anatomy.measure.components import ComponentTracker

aten = torch.ops.aten


def _heads_as_query(formula, qi: int):
    """Call `formula` with k/v (positions qi+1, qi+2) given the query's head count (dim 1)."""
    def f(*args, out_val=None, **kwargs):
        args, h = list(args), args[qi].shape[1]
        for j in (qi + 1, qi + 2):
            t = args[j]
            args[j] = torch.empty((t.shape[0], h, *t.shape[2:]), dtype=t.dtype, device="meta")
        return formula(*args, out_val=out_val, **kwargs)
    f._get_raw = True
    return f


def _addmm_as_mm(self, mat1, mat2, *rest, out_val=None, **kwargs):
    return flop_registry[aten.mm](mat1, mat2, out_val=out_val)


_addmm_as_mm._get_raw = True

def _grouped_mm_flops(a, b, *rest, out_val=None, **kwargs):
    """2 x the multiply-adds of every group: two 2D operands (a weight gradient, a (K, N) x (N, M) split along
    N into (E, K, M)) contract over all of N; otherwise each output element contracts over a's last dim."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


_grouped_mm_flops._get_raw = True

CUSTOM_MAPPING = {aten.addmm: _addmm_as_mm, aten._grouped_mm: _grouped_mm_flops}
for _op, _qi in ((aten._scaled_dot_product_cudnn_attention, 0), (aten._scaled_dot_product_flash_attention, 0),
                 (aten._scaled_dot_product_efficient_attention, 0),
                 (aten._scaled_dot_product_cudnn_attention_backward, 1),
                 (aten._scaled_dot_product_flash_attention_backward, 1),
                 (aten._scaled_dot_product_efficient_attention_backward, 1)):
    CUSTOM_MAPPING[_op] = _heads_as_query(flop_registry[_op], _qi)


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CUSTOM_MAPPING)


class _PerComponent(TorchDispatchMode):
    def __init__(self, tracker: ComponentTracker):
        super().__init__()
        self.tracker = tracker
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # flop_registry read at call time: a custom op's formula (anatomy::linear_cross_entropy) may register later
        formula = CUSTOM_MAPPING.get(func._overloadpacket) or flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.counts[self.tracker.label] += formula(*args, **kwargs, out_val=out)
        return out


def count_flops(model: torch.nn.Module, run_forward, backward: bool = True) -> dict:
    """run_forward() -> scalar loss. Returns {'forward': {comp: flops, ..., 'total': n}, 'backward': {...}}."""
    res = {}
    with ComponentTracker(model, track_backward=backward) as tracker:
        with flop_counter() as total, _PerComponent(tracker) as per:
            loss = run_forward()
        res["forward"] = dict(per.counts, total=total.get_total_flops())
        if backward:
            tracker.tag_backward()
            with flop_counter() as total, _PerComponent(tracker) as per:
                loss.backward()
            res["backward"] = dict(per.counts, total=total.get_total_flops())
    return res
