"""What dtype each kind of tensor has under a dtype policy (see llm_anatomy.config.DTYPE_POLICIES)."""
from __future__ import annotations

from dataclasses import dataclass

from llm_anatomy.config import Run


@dataclass(frozen=True)
class Dtypes:
    param: str  # master weights
    compute: str  # matmul inputs and outputs
    residual: str  # the residual stream: the embedding output's dtype, kept by fp32 + bf16 promotion
    autocast: bool  # under autocast every matmul casts its fp32 operands, and those casts are saved


POLICIES = {
    "amp": Dtypes("float32", "bfloat16", "float32", True),
    "bf16": Dtypes("bfloat16", "bfloat16", "bfloat16", False),
    "fp32": Dtypes("float32", "float32", "float32", False),
}


def dtypes(run: Run) -> Dtypes:
    return POLICIES[run.dtype]
