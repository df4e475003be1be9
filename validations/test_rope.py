"""The fused RoPE-on-QKV op (llm_anatomy/kernels/rope.py): accuracy against the reference's own error
(validations/kernel_cases.py) over head counts and head dims, the q/k/v layouts, and that no output
keeps the qkv input alive."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, strategies as st

from llm_anatomy.kernels import INTERPRET, rope_qkv
from validations.kernel_cases import BF16, FP32, PATHS, check_accuracy, path_ctx, rope_case, rope_tables


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 8), (3, 3, 6), (4, 1, 2)], ids=["gqa", "mha-odd", "mqa-d2"])
def test_rope_qkv_accuracy(path, dtype, heads, kv_heads, head_dim):
    q, k, v = check_accuracy(*rope_case(dtype, H=heads, KV=kv_heads, D=head_dim), path=path_ctx(path))["op"][0]
    assert k.is_contiguous() and v.is_contiguous() and all(t.dtype == dtype for t in (q, k, v))
    assert q.transpose(1, 2).is_contiguous()  # q is laid out (B, S, heads, D): SDPA's output follows it
    assert q.shape == (2, heads, 7, head_dim) and k.shape == v.shape == (2, kv_heads, 7, head_dim)


@given(B=st.integers(1, 2), S=st.integers(1, 3), kv=st.integers(1, 3), group=st.integers(1, 3), half=st.integers(1, 6))
def test_rope_qkv_shapes_hypothesis(B, S, kv, group, half):
    """Head counts and head dims around the kernel's power-of-two tiles. (B, S) only set the grid, one
    program per token, so they stay small: the interpreter runs programs one after another."""
    paths = ["reference"] + (["triton"] if INTERPRET else [])
    for path in paths:
        check_accuracy(*rope_case(FP32, B=B, S=S, H=kv * group, KV=kv, D=2 * half), path=path_ctx(path))


def test_rope_keeps_no_reference_to_qkv():
    qkv = torch.randn(2, 7, 80, requires_grad=True) * 1.0  # a non-leaf: only the graph could keep it alive
    q, k, v = rope_qkv(qkv, *rope_tables(7, 8), 6, 2)
    assert all(t.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr() for t in (q, k, v))
    ref = weakref.ref(qkv)
    del qkv
    gc.collect()
    assert ref() is None


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(2, 7, 6, 2, 8), (2, 1024, 32, 4, 64), (1, 512, 32, 8, 128)],
                         ids=["small", "tinyllama", "llama3"])
def test_gpu_rope_qkv(cfg):
    B, S, H, KV, D = cfg
    check_accuracy(*rope_case(BF16, device="cuda", B=B, S=S, H=H, KV=KV, D=D))
