"""What a bias-free nn.Linear saves: the matmul keeps its input and its weight.

Under autocast both are bf16 casts. A weight's cast is cached for the step (a leaf that requires
grad), but a non-leaf input is cast anew by every linear that reads it: q, k and v each keep
their own bf16 copy of the same normed activations. Without autocast the input is saved as it is
(one storage, however many linears read it) and the weight is a parameter, not an activation.
"""
from __future__ import annotations

from anatomy.calculator.dtypes import Dtypes
from anatomy.calculator.types import Saved


def linears_saved(prefix: str, tokens: int, d_in: int, outs: dict[str, int], dt: Dtypes, count: int,
                  input_dtype: str | None) -> list[Saved]:
    """Saved tensors of len(outs) linears reading one (tokens, d_in) input.

    input_dtype: the input's dtype when it is saved here without autocast; None when another
    component already saved that storage (then it costs nothing here)."""
    if dt.autocast:
        out = [Saved(f"{prefix}.{n}.input_bf16", (tokens, d_in), "bfloat16", count,
                     "autocast's cast of the input, saved by the matmul") for n in outs]
        out += [Saved(f"{prefix}.{n}.weight_bf16", (d_in, d), "bfloat16", count,
                      "autocast's cached cast of the fp32 weight, saved by the matmul") for n, d in outs.items()]
        return out
    if input_dtype is None:
        return []
    return [Saved(f"{prefix}.input", (tokens, d_in), input_dtype, count, "the matmul's input")]
