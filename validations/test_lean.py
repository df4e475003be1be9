"""The lean matmuls (llm_anatomy/kernels/lean.py): the efficient model with them gives bitwise the loss and
every gradient it gives with nn.Linear and a saved SwiGLU output, and keeps neither the weight casts nor h."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.efficient.attention import Attention
from llm_anatomy.efficient.mlp import MLP
from llm_anatomy.kernels import swiglu_packed, triton_on_cpu
from llm_anatomy.kernels.lean import linear, remake_grad, swiglu_down
from llm_anatomy.kernels.swiglu import packed_grad
from llm_anatomy.measure.saved import SavedTensorTracer
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations.configs import NAMED

BF16 = torch.bfloat16
QWEN = ModelConfig(name="tiny-qkv-bias", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=128,
                   qkv_bias=True)


def _step(model, ids, targets, run, device="cpu"):
    model.zero_grad(set_to_none=True)
    with autocast_ctx(run, device):
        loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_bitwise(cfg: ModelConfig, run: Run, device: str = "cpu"):
    ids, targets = (t.to(device) for t in make_batch(cfg, run))
    out = []
    for lean in (False, True):  # the plain block; the lean one (its matmuls and its adds inside the norms)
        model = build_model(cfg, "efficient", device=device, dtype=param_dtype(run), lean=lean)
        assert model.lean == lean and all(m.lean == lean for m in model.modules() if isinstance(m, (Attention, MLP)))
        out.append(_step(model, ids, targets, run, device))
    (l0, g0), (l1, g1) = out
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert g0[n].dtype == g1[n].dtype and torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("policy", ["amp", "fp32", "bf16"])
@pytest.mark.parametrize("cfg", [NAMED["tiny"], NAMED["tiny-gqa"], NAMED["tiny-gptoss-tied"], QWEN], ids=lambda c: c.name)
def test_lean_model_is_bitwise_the_plain_one(cfg, policy):
    check_bitwise(cfg, Run(2, 16, policy))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
def test_lean_ops_are_bitwise_the_plain_ones_cuda(variant):
    """On the GPU (the model as a whole is not compared: SDPA's backward may sum in another order run to
    run): qkv-like linear with a bias, then SwiGLU + down, against nn.Linear and swiglu_packed; the
    Triton SwiGLU made again in backward, cuBLAS's products on the same operands. The output, the input's
    and the bias's gradients are bitwise; the weights' gradients are the GEMM's fp32 output (lean.fp32_grad)
    where nn.Linear's are that sum rounded to bf16: within bf16's rounding of them, and not all equal."""
    g = torch.Generator().manual_seed(0)
    x0, wq, b, wd = (torch.randn(*s, generator=g).cuda() for s in ((4, 512, 1024), (2 * 2816, 1024), (2 * 2816,),
                                                                    (1024, 2816)))
    plain = lambda x, wq, b, wd: F.linear(swiglu_packed(F.linear(x, wq, b), variant), wd)  # noqa: E731
    lean = lambda x, wq, b, wd: swiglu_down(linear(x, wq, b), wd, variant)  # noqa: E731
    res = []
    for fn in (plain, lean):
        args = [t.clone().requires_grad_() for t in (x0, wq, b, wd)]
        with torch.autocast("cuda", dtype=BF16):
            y = fn(args[0].to(BF16), *args[1:])
        y.backward(torch.ones_like(y))
        res.append([y] + [a.grad for a in args])
    for i, (a, b_) in enumerate(zip(*res)):
        assert a.dtype == b_.dtype
        if i in (2, 4):  # the weights' gradients
            assert torch.allclose(b_, a, rtol=2 ** -7, atol=0) and not torch.equal(a, b_)  # one bf16 ulp
            assert torch.equal(b_.to(BF16), a.to(BF16)) or (b_.to(BF16) != a.to(BF16)).float().mean() < 0.01
        else:
            assert torch.equal(a, b_)


@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
def test_lean_ops_through_the_triton_kernels_are_bitwise_the_plain_ones(variant):
    """swiglu_down under the interpreter, forward and backward: the h that SwiGLU's backward pass writes is
    the forward kernel's, so dW and d(gate_up) match. (Both inside triton_on_cpu.)"""
    g = torch.Generator().manual_seed(0)
    gu0 = torch.randn(2, 5, 2 * 24, generator=g) * 4  # * 4: gpt-oss's clamps at 7 are crossed
    w0 = torch.randn(16, 24, generator=g)
    res = []
    for fn in (lambda gu, w: torch.nn.functional.linear(swiglu_packed(gu, variant), w),
               lambda gu, w: swiglu_down(gu, w, variant)):
        gu, w = (gu0 * 1).requires_grad_(), w0.clone().requires_grad_()
        with triton_on_cpu():
            with torch.autocast("cpu", dtype=BF16):
                y = fn(gu * 1, w)  # gu * 1: a non-leaf, as the model's gate_up
            y.backward(torch.ones_like(y))
        res.append((y, gu.grad, w.grad))
    for a, b in zip(*res):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss"])
def test_remake_grad_writes_h_over_dh_and_the_gradient_over_gate_up(variant, triton):
    """One pass, no new storage: h (bitwise the forward op's) in d(h)'s storage, d(gate_up) (bitwise the
    packed backward's) in gate_up's; the same through the custom op (a dispatch mode: no fast path)."""
    g = torch.Generator().manual_seed(1)
    gu0 = (torch.randn(3, 7, 2 * 40, generator=g) * 4).to(BF16)
    dh0 = torch.randn(3, 7, 40, generator=g).to(BF16)
    with triton_on_cpu() if triton else torch.autocast("cpu", enabled=False):
        h_want = swiglu_packed(gu0, variant)
        dgu_want = packed_grad(dh0, gu0.clone(), variant, False)
        for mode in (None, FlopCounterMode):
            gu, dh = gu0.clone(), dh0.clone()
            ptrs = gu.data_ptr(), dh.data_ptr()
            with torch.no_grad(), (mode(display=False) if mode else torch.autocast("cpu", enabled=False)):
                h, dgu = remake_grad(dh, gu, variant, inplace=True)
            assert (dgu.data_ptr(), h.data_ptr()) == ptrs
            assert torch.equal(h, h_want) and torch.equal(dgu, dgu_want)


def test_lean_linear_keeps_no_weight_cast():
    """Under autocast: the plain linear keeps x and the (out, in) bf16 cast; the lean one x only (the fp32
    parameter is model state, not an activation). swiglu_down keeps gate_up only."""
    lin = torch.nn.Linear(32, 48, bias=True)
    x = torch.randn(4, 32, dtype=BF16, requires_grad=True)
    saved = {}
    for name, fn in (("plain", lin), ("lean", lambda x: linear(x, lin.weight, lin.bias))):
        with SavedTensorTracer(lin) as tr, torch.autocast("cpu", dtype=BF16):
            fn(x * 1)
        saved[name] = sorted((r.shape, r.dtype) for r in tr.report.records if r.storage_bytes)
    assert saved["plain"] == [((4, 32), "bfloat16"), ((32, 48), "bfloat16")]  # x, and the cast (a transposed view)
    assert saved["lean"] == [((4, 32), "bfloat16")]
    w = torch.nn.Parameter(torch.randn(48, 16))
    gu = torch.randn(4, 32, requires_grad=True)
    with SavedTensorTracer(torch.nn.ParameterList([w])) as tr, torch.autocast("cpu", dtype=BF16):
        swiglu_down(gu * 1, w)
    assert sorted((r.shape, r.dtype) for r in tr.report.records if r.storage_bytes) == [((4, 32), "bfloat16")]


def test_lean_ops_compile_fullgraph():
    """torch.compile(fullgraph=True) traces both nodes (no graph break); values and gradients equal eager's."""
    g = torch.Generator().manual_seed(0)
    x0, wq, b, wd = (torch.randn(*s, generator=g) for s in ((2, 5, 16), (40, 16), (40,), (16, 20)))

    def block(x, wq, b, wd):
        return swiglu_down(linear(x, wq, b), wd, "gpt-oss")

    torch._dynamo.reset()
    res = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        args = [t.clone().requires_grad_() for t in (x0, wq, b, wd)]
        with torch.autocast("cpu", dtype=BF16):
            y = fn(*args)
        y.backward(torch.ones_like(y))
        res.append([y] + [a.grad for a in args])
    for a, b_ in zip(*res):
        assert a.dtype == b_.dtype and torch.equal(a, b_)
