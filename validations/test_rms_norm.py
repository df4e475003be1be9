"""The fused RMSNorm op (llm_anatomy/kernels/rms_norm.py): accuracy against the reference's own error
(validations/kernel_cases.py), odd shapes, the row tiles of the Triton launchers, and the backward's
program count against the calculator's."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

from llm_anatomy.kernel_shapes import RMS_MIN_ROWS, rms_norm_programs
from llm_anatomy.kernels import HAS_TRITON, INTERPRET, rms_norm_backward_triton, rms_norm_triton
from llm_anatomy.kernels.rms_norm import MAX_BLOCK, backward_programs
from validations.kernel_cases import BF16, FP32, PATHS, check_accuracy, path_ctx, rms_case


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,wdtype", [(FP32, FP32), (BF16, BF16), (BF16, FP32)], ids=["fp32", "bf16", "bf16-w32"])
def test_rms_norm_accuracy(path, dtype, wdtype):
    out = check_accuracy(*rms_case(dtype, wdtype), path=path_ctx(path))["op"]
    assert out[0][0].dtype == dtype and out[1][0].dtype == dtype and out[1][1].dtype == wdtype


@given(rows=st.integers(1, 6), n=st.integers(1, 80), dtype=st.sampled_from([FP32, BF16]), seed=st.integers(0, 9))
def test_rms_norm_shapes_hypothesis(rows, n, dtype, seed):
    """Any row count and hidden size (powers of two or not): the op, and the Triton launchers called
    directly on CPU tensors where the interpreter is on."""
    inputs, op, plain, scale = rms_case(dtype, shape=(rows, n), seed=seed)
    check_accuracy(inputs, op, plain, scale)
    if INTERPRET:
        launch = lambda t: (_RmsTriton.apply(t["x"], t["w"]),)  # noqa: E731
        check_accuracy(inputs, launch, plain, scale)


@pytest.mark.skipif(not INTERPRET, reason="the Triton launchers run on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows,n", [(50, 1000), (37, 300), (9, 5000), (130, 33)])
def test_rms_norm_row_tiles(rows, n):
    """The kernels pack narrow rows into tiles (_fwd_tile, _bwd_tile): the backward's 2-row tiles over a
    program's 7 rows with a masked tail (50 x 1000), forward tiles of 4 and 32 rows with a masked last
    tile, one row per tile (5000 wide), and the dw sum's narrow column blocks, all against the
    reference's error."""
    inputs, _, plain, scale = rms_case(FP32, shape=(rows, n), seed=rows)
    check_accuracy(inputs, lambda t: (_RmsTriton.apply(t["x"], t["w"]),), plain, scale)


@pytest.mark.skipif(not HAS_TRITON, reason="the launcher's program count is computed with triton.cdiv")
@given(M=st.integers(1, 1 << 20), N=st.integers(1, MAX_BLOCK), sms=st.sampled_from([108, 132, 170]))
def test_rms_norm_backward_programs_are_the_calculators(M, N, sms):
    """The fused backward's programs on a CUDA device (one fp32 row of dw partials each: the memory
    model's transient, and the partial sum's rows in the timing model) are what the calculator computes
    for itself (calculator/fused.rms_norm_programs): the rule lives in both, and must not drift."""
    props = SimpleNamespace(multi_processor_count=sms)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device: props):
        programs, per = backward_programs(torch.device("cuda"), M, N)
    assert programs == rms_norm_programs(N, M, sms)
    assert (programs - 1) * per < M <= programs * per  # every program has rows, and all rows are covered
    assert per >= min(M, RMS_MIN_ROWS) and programs <= sms * max(1, 8192 // N)


class _RmsTriton(torch.autograd.Function):  # the bare launchers, no custom op around them
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return rms_norm_triton(x, w, 1e-5)

    @staticmethod
    def backward(ctx, dy):
        return rms_norm_backward_triton(dy, *ctx.saved_tensors, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 7, 48), (4, 512, 4096)], ids=["small", "llama-1b"])
def test_gpu_rms_norm(shape):
    check_accuracy(*rms_case(BF16, FP32, device="cuda", shape=shape))
