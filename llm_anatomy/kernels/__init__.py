"""Fused kernels of the efficient model, each a torch custom op (namespace ``anatomy``).

    rms_norm(x, weight, eps)                    -> y                 saves x, weight
    add_rms_norm(x, branch, weight, eps)        -> (x_new, y)        saves x_new, weight
    swiglu(gate, up, variant)                   -> h                 saves gate, up
    swiglu_packed(gate_up, variant)             -> h                 saves gate_up; d(gate_up) in place
    rope_qkv(qkv, cos, sin, heads, kv_heads)    -> (q, k, v)         saves cos, sin
    rope_qkv_norm(qkv, q_w, k_w, cos, sin, heads, kv_heads, eps)
                                                -> (q, k, v)         saves qkv, q_w, k_w, cos, sin (per-head q/k RMSNorm)
    linear_cross_entropy(x, weight, targets)    -> loss              saves grad_x, grad_w (made in forward)
    lean.linear(x, weight, bias)                -> y                 saves x, the fp32 weight (cast again in backward)
    lean.swiglu_down(gate_up, weight, variant)  -> y                 saves gate_up, the weight (h made again in backward)

Each op: plain-torch reference on CPU (and any non-CUDA device), Triton kernel on CUDA, fake
implementation for meta/fake tensors and torch.compile, an explicit autocast rule, and a backward
that is itself a custom op (linear_cross_entropy's backward only scales its saved gradients).
(lean.py's two are autograd Functions over these ops and aten matmuls, not ops of their own.)
``*_triton`` are the Triton launchers, callable on CPU tensors under TRITON_INTERPRET=1;
``triton_on_cpu()`` routes the ops themselves through them. ``_dispatch.py``
documents the dispatch and autocast design; each op's module documents its fusion and savings.
"""
from llm_anatomy.kernels._dispatch import HAS_TRITON, INTERPRET, triton_on_cpu
from llm_anatomy.kernels.add_rms_norm import add_rms_norm
from llm_anatomy.kernels.linear_ce import ce_rows_reference, ce_rows_triton, linear_cross_entropy
from llm_anatomy.kernels.rms_norm import (rms_norm, rms_norm_backward_reference, rms_norm_backward_triton,
                                     rms_norm_reference, rms_norm_triton)
from llm_anatomy.kernels.rope import (rope_qkv, rope_qkv_backward_reference, rope_qkv_backward_triton, rope_qkv_reference,
                                  rope_qkv_triton)
from llm_anatomy.kernels.rope_norm import (rope_qkv_norm, rope_qkv_norm_backward_reference,
                                       rope_qkv_norm_backward_triton, rope_qkv_norm_reference, rope_qkv_norm_triton)
from llm_anatomy.kernels.swiglu import (VARIANTS as SWIGLU_VARIANTS, swiglu, swiglu_backward_reference, swiglu_packed,
                                    swiglu_backward_triton, swiglu_reference, swiglu_triton)

__all__ = [
    "HAS_TRITON", "INTERPRET", "triton_on_cpu", "SWIGLU_VARIANTS",
    "rms_norm", "add_rms_norm", "rms_norm_reference", "rms_norm_backward_reference", "rms_norm_triton", "rms_norm_backward_triton",
    "swiglu", "swiglu_packed", "swiglu_reference", "swiglu_backward_reference", "swiglu_triton",
    "swiglu_backward_triton",
    "rope_qkv", "rope_qkv_reference", "rope_qkv_backward_reference", "rope_qkv_triton", "rope_qkv_backward_triton",
    "rope_qkv_norm", "rope_qkv_norm_reference", "rope_qkv_norm_backward_reference", "rope_qkv_norm_triton",
    "rope_qkv_norm_backward_triton",
    "linear_cross_entropy", "ce_rows_reference", "ce_rows_triton",
]
