"""What nn.Linear layers keep: the matmul keeps its input and its weight. A bias adds nothing: the
linear is then one addmm, which keeps the same two operands (its bias's gradient is a sum of the output's).

Under autocast both are bf16. A weight's cast is cached for the step (a leaf that requires grad),
but an fp32 input that is not a leaf is cast anew by every linear that reads it: q, k and v each
keep their own bf16 copy of the same normed activations. An input already in bf16 is kept as it
is: one storage, however many linears read it. Without autocast the weight is a parameter, not
an activation, and the input is kept as it is.

weight_cast=False: the efficient model's lean matmuls (llm_anatomy/kernels/lean.py) keep the fp32 weight
itself, not its cast, and cast it again in backward: only the input is new storage.
"""
from __future__ import annotations

from llm_anatomy.calculator.dtypes import Dtypes
from llm_anatomy.calculator.types import Saved


def linears_saved(prefix: str, tokens: int, d_in: int, outs: dict[str, int], dt: Dtypes, count: int,
                  input_dtype: str, weight_cast: bool = True) -> list[Saved]:
    """Saved tensors of len(outs) linears that read one (tokens, d_in) input of `input_dtype`."""
    if dt.autocast and input_dtype != dt.compute:
        out = [Saved(f"{prefix}.{n}.input_cast", (tokens, d_in), dt.compute, count,
                     "autocast's cast of the input, one per linear, saved by its matmul") for n in outs]
    else:
        out = [Saved(f"{prefix}.{'+'.join(outs)}.input", (tokens, d_in), input_dtype, count,
                     "the matmul's input, kept as it is")]
    if dt.autocast and weight_cast:
        out += [Saved(f"{prefix}.{n}.weight_cast", (d_in, d), dt.compute, count,
                      "autocast's cached cast of the fp32 weight, saved by the matmul") for n, d in outs.items()]
    return out
