"""The fused residual add + RMSNorm op (llm_anatomy/kernels/add_rms_norm.py): bitwise the unfused add and
rms_norm on CPU (forward, every gradient), the Triton kernels under the interpreter against the
reference, the absent x_new gradient, saved tensors, fake tensors, opcheck and torch.compile."""
from __future__ import annotations

import contextlib

import pytest
import torch

from llm_anatomy.kernels import add_rms_norm, rms_norm
from llm_anatomy.kernels.add_rms_norm import add_rms_norm_backward_triton, add_rms_norm_triton
from validations.kernel_cases import BF16, FP32, PATHS, gen, path_ctx

EPS = 1e-5


def _inputs(shape=(2, 7, 48), xdt=FP32, bdt=BF16, seed=0):
    g = gen(seed)
    x = torch.randn(shape, generator=g).to(xdt).requires_grad_()
    b = torch.randn(shape, generator=g).to(bdt).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).requires_grad_()
    dxn, dy = torch.randn(shape, generator=g).to(xdt), torch.randn(shape, generator=g)
    return x, b, w, dxn, dy


def _run(fused, x, b, w, dxn, dy, amp, use_dxn=True, device="cpu"):
    leaves = [t.detach().to(device).requires_grad_() for t in (x, b, w)]
    dxn, dy = dxn.to(device), dy.to(device)
    with torch.autocast(device, dtype=BF16, enabled=amp):
        if fused:
            xn, y = add_rms_norm(*leaves, EPS)
        else:
            xn = leaves[0] + leaves[1]
            y = rms_norm(xn, leaves[2], EPS)
    loss = (y.float() * dy).sum() + ((xn.float() * dxn.float()).sum() if use_dxn else 0)
    loss.backward()
    return [xn, y] + [t.grad for t in leaves]


@pytest.mark.parametrize("xdt,bdt,amp", [(FP32, BF16, True), (FP32, FP32, False), (BF16, BF16, False),
                                         (FP32, BF16, False)], ids=["amp", "fp32", "bf16", "fp32-bf16-branch"])
@pytest.mark.parametrize("use_dxn", [True, False], ids=["dxn", "no-dxn"])
def test_reference_is_bitwise_the_unfused_pair(xdt, bdt, amp, use_dxn):
    """Same fp32 ops in the same order: x + branch.to(x.dtype), rms_norm's reduction on the rounded sum;
    backward the norm's dx rounded to x's dtype plus d_x_new (a two-term sum, exact in either order)."""
    args = _inputs(xdt=xdt, bdt=bdt)
    fused, plain = _run(True, *args, amp, use_dxn), _run(False, *args, amp, use_dxn)
    for name, a, b in zip(("x_new", "y", "dx", "dbranch", "dw"), fused, plain):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 2048, 2048), (4, 1000, 576)])
@pytest.mark.parametrize("use_dxn", [True, False], ids=["dxn", "no-dxn"])
def test_cuda_bitwise_the_unfused_pair(shape, use_dxn):
    """On the GPU the fused kernels reduce in the same tiles and order as rms_norm's and round at the same
    points: x_new, y, d_x, d_branch and dw bitwise the add + rms_norm pair under amp."""
    args = _inputs(shape=shape, seed=1)
    fused, plain = _run(True, *args, True, use_dxn, "cuda"), _run(False, *args, True, use_dxn, "cuda")
    for name, a, b in zip(("x_new", "y", "dx", "dbranch", "dw"), fused, plain):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.skipif("triton" not in str(PATHS[-1]) or not __import__("llm_anatomy.kernels").kernels.INTERPRET,
                    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", [(2, 7, 48), (50, 1000), (9, 300), (3, 33)])
@pytest.mark.parametrize("use_dxn", [True, False], ids=["dxn", "no-dxn"])
def test_triton_matches_reference(shape, use_dxn):
    """The interpreter's kernels against the reference: x_new bitwise (one rounded add); y, dx, d_branch
    and dw within fp32 reduction-order error (the kernels sum rows in tiles, torch in its own order),
    then each rounded to its dtype: bf16 outputs within one bf16 ulp."""
    args = _inputs(shape=shape, seed=shape[-1])
    ref = _run(True, *args, True, use_dxn)
    with path_ctx("triton"):
        tri = _run(True, *args, True, use_dxn)
    assert torch.equal(tri[0], ref[0])
    for name, a, b, tol in zip(("y", "dx", "dbranch", "dw"), tri[1:], ref[1:], (8e-3, 1e-5, 8e-3, 1e-4)):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item(),
                                   msg=name)


@pytest.mark.skipif(not __import__("llm_anatomy.kernels").kernels.INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_launchers_direct():
    """The launchers on CPU tensors: empty rows, and the absent d_x_new (HAS_DXN=False)."""
    x, b, w, dxn, dy = (t.detach() for t in _inputs(shape=(5, 40)))
    xn, y = add_rms_norm_triton(x, b, w, EPS, BF16)
    assert torch.equal(xn, x + b.float()) and y.dtype == BF16
    dx0, db0, dw0 = add_rms_norm_backward_triton(None, dy, xn, w, EPS, BF16)
    dx1, db1, dw1 = add_rms_norm_backward_triton(dxn, dy, xn, w, EPS, BF16)
    torch.testing.assert_close(dx1, dx0 + dxn)
    assert torch.equal(dw0, dw1)
    # d_branch is d_x cast in the kernel; the interpreter casts fp32 -> bf16 toward zero (torch: to nearest
    # even), so the two agree within one bf16 ulp here and bitwise on the GPU's round-to-nearest cast
    for db, dx in ((db0, dx0), (db1, dx1)):
        torch.testing.assert_close(db.float(), dx, rtol=2 ** -7, atol=0)
    e = torch.empty(0, 40)
    assert add_rms_norm_triton(e, e, w, EPS)[1].shape == (0, 40)


def test_saves_x_new_and_weight_only():
    """What backward keeps: x_new (the residual dtype) and the weight, as the unfused norm kept its input."""
    x, b, w, _, _ = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=BF16):
            xn, y = add_rms_norm(x, b, w, EPS)
    assert len(saved) == 2 and saved[0].data_ptr() == xn.data_ptr() and saved[1] is w
    assert xn.dtype == FP32 and y.dtype == BF16


def test_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    make = FakeTensorMode().from_tensor
    xn, y = add_rms_norm(make(torch.randn(2, 7, 48)), make(torch.randn(2, 7, 48, dtype=BF16)), make(torch.randn(48)))
    assert (xn.dtype, y.dtype, y.shape) == (FP32, FP32, (2, 7, 48))
    x, b, w, dxn, dy = (t.detach() for t in _inputs())
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    ops = torch.ops.anatomy
    torch.library.opcheck(ops.add_rms_norm.default, (rg(x), rg(b), rg(w), EPS, BF16))
    torch.library.opcheck(ops.add_rms_norm_backward.default, (dxn, dy, x, w, EPS, BF16))
    torch.library.opcheck(ops.add_rms_norm_backward.default, (None, dy, x, w, EPS, FP32))


@pytest.mark.parametrize("path", PATHS)
def test_compile_fullgraph(path):
    """fullgraph=True through the custom op: values and gradients equal eager's."""
    torch._dynamo.reset()

    def f(x, b, w):
        xn, y = add_rms_norm(x, b, w, EPS)
        xn2, y2 = add_rms_norm(xn, y, w, EPS)
        return y2.float().square().sum() + xn2.sum()

    x, b, w, _, _ = _inputs(shape=(3, 16))
    results = []
    with path_ctx(path):
        for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
            leaves = [t.detach().clone().requires_grad_() for t in (x, b, w)]
            with torch.autocast("cpu", dtype=BF16):
                loss = fn(*leaves)
            loss.backward()
            results.append([loss] + [t.grad for t in leaves])
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="branch shape"):
        add_rms_norm(torch.randn(2, 4), torch.randn(2, 5), torch.randn(4))
    with pytest.raises(ValueError, match="weight shape"):
        add_rms_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(5))


# ---- the efficient model: each norm fused with the residual add in front of it ------------------
def _unfused_forward(model, ids, targets):
    """The efficient model as it runs without add_rms_norm: each block's _block (x + attn(norm(x)),
    x + mlp(norm(x))), then the final norm."""
    from llm_anatomy.baseline.transformer import rope_tables

    x = model.embed(ids)
    cos, sin = rope_tables(ids.shape[1], model.cfg.head_dim, model.cfg.rope_theta, ids.device, torch.float32)
    for layer in model.layers:
        x = layer._block(x, cos, sin)
    return model.head(model.norm(x), targets)


@pytest.mark.parametrize("policy", ["amp", "fp32", "bf16"])
@pytest.mark.parametrize("cfg", ["tiny", "tiny-gqa", "tiny-gptoss-tied"])
def test_model_is_bitwise_the_unfused_one(cfg, policy):
    """The lean block (Run.lean): loss and every gradient torch.equal to the same model's unfused adds and norms."""
    from llm_anatomy.config import Run
    from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
    from validations.configs import NAMED

    cfg, run = NAMED[cfg], Run(2, 16, policy, lean=True)
    ids, targets = make_batch(cfg, run)
    model = build_model(cfg, "efficient", device="cpu", dtype=param_dtype(run), lean=run.lean)
    assert model.lean and all(layer.lean for layer in model.layers)  # the fused path, not _block
    out = []
    for fwd in (lambda: model(ids, targets), lambda: _unfused_forward(model, ids, targets)):
        model.zero_grad(set_to_none=True)
        with autocast_ctx(run, "cpu"):
            loss = fwd()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert g0[n].dtype == g1[n].dtype and torch.equal(g0[n], g1[n]), n



@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_fast_path_equals_the_custom_op(path, amp):
    """The eager autograd.Function (_AddRMSNormFn) and the dispatcher's custom op: the same bits, saved
    tensors and gradients (validations/test_fast_path.py's check for the other ops)."""
    from validations.test_fast_path import _Dispatcher

    x, b, w, dxn, dy = _inputs(shape=(3, 5, 48))
    runs = []
    for mode in (contextlib.nullcontext(), _Dispatcher()):
        leaves = [t.detach().clone().requires_grad_() for t in (x, b, w)]
        saved = []
        with path_ctx(path), mode:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.shape, t.dtype)) or t,
                                                          lambda t: t):
                with torch.autocast("cpu", dtype=BF16, enabled=amp):
                    xn, y = add_rms_norm(*leaves, EPS)
            node = type(y.grad_fn).__name__
            torch.autograd.backward([xn, y], [dxn, dy.to(y.dtype)])
        runs.append(([xn.detach(), y.detach()] + [t.grad for t in leaves], saved, node))
    assert runs[0][2].startswith("_AddRMSNormFn") and not runs[1][2].startswith("_AddRMSNormFn")
    for a, b_ in zip(runs[0][0], runs[1][0], strict=True):
        assert a.dtype == b_.dtype and torch.equal(a, b_)
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) == 2
