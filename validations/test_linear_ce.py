"""anatomy::linear_cross_entropy (llm_anatomy/kernels/linear_ce.py): accuracy, the row kernel, shapes under
fake tensors and torch.compile, autocast, no host sync, and the chunk rule (the in-place backward:
test_linear_ce_backward.py).

Accuracy follows test_kernels.py: err(op vs fp64) <= 2 * err(plain torch in the same dtypes vs fp64)
+ eps(dtype) * max|fp64|, "plain" being F.cross_entropy on x @ Wᵀ as autocast would run it, the fp64
reference the same code in float64 on the dtype-rounded inputs. The floor's dtype is x's (the compute
dtype) for every output, even the fp32 loss and an fp32 grad_w: the loss is a function of the (T, V)
logits and both gradients are products of their gradient, which the op and plain torch alike store in
the compute dtype, so one unit of that rounding is the least either can promise (at one hidden unit
and a vocab of 2, grad_w and the loss are that rounding alone, and plain torch's further roundings
cancel part of it by chance as often as not). Paths: "reference" (CPU CI), "triton"
(the Triton row kernel under TRITON_INTERPRET=1, inside triton_on_cpu()).
"""
from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from llm_anatomy.kernels import INTERPRET, triton_on_cpu
from llm_anatomy.kernels import linear_ce as lce
from llm_anatomy.kernels.linear_ce import linear_cross_entropy
from llm_anatomy.kernels.linear_ce_chunks import (C_MIN, LOGITS_BUDGET, chunk_rows, forward_bytes, liger_rows,
                                              peak_bytes, saved_bytes)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET=1 is not set (conftest sets it where "
                                       "nvidia-smi is absent); the gpu-marked test runs the kernel on CUDA")
PATHS = ["reference", pytest.param("triton", marks=needs_interpreter)]
DTYPES = {"fp32": (FP32, FP32), "bf16": (BF16, BF16), "bf16-w32": (BF16, FP32)}  # (x, weight)


def _path(name):
    return triton_on_cpu() if name == "triton" else contextlib.nullcontext()


def case(T=37, H=24, V=50, ignored=(3, 11), seed=0, device="cpu"):
    """x (T, H), weight (V, H) in fp64 before rounding, targets (T,) with some rows ignored. V = 50 is no
    multiple of 8 nor of a block; logits of O(3) so the softmax is not flat."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=FP64)
    w = torch.randn(V, H, generator=g, dtype=FP64) * (3 / H ** 0.5)
    t = torch.randint(0, V, (T,), generator=g)
    t[list(i for i in ignored if i < T)] = -100
    return x.to(device), w.to(device), t.to(device)


def plain(x, w, t, ls, reduction="mean"):
    """What a user writes under autocast: logits in x's dtype (the weight cast to it), torch's CE."""
    return F.cross_entropy(x @ w.to(x.dtype).t(), t, label_smoothing=ls, reduction=reduction)


def _err(a, ref):
    return (a.double() - ref).abs().max().item()


def run_grads(fn, x, w, t, xdt, wdt, dout=0.7):
    xl, wl = x.to(xdt).requires_grad_(), w.to(wdt).requires_grad_()
    loss = fn(xl, wl, t)
    gx, gw = torch.autograd.grad(loss, (xl, wl), torch.tensor(dout, dtype=loss.dtype, device=loss.device))
    return loss, gx, gw


def assert_within_reference(x, w, t, xdt, wdt, op, ls, red="mean"):
    ref = run_grads(lambda a, b, c: plain(a, b, c, ls, red), x.to(xdt).double(), w.to(wdt).double(), t, FP64, FP64)
    base = run_grads(lambda a, b, c: plain(a, b, c, ls, red), x, w, t, xdt, wdt)
    got = run_grads(op, x, w, t, xdt, wdt)
    assert (got[0].dtype, got[1].dtype, got[2].dtype) == (FP32, xdt, wdt)
    for name, o, p, r in zip(("loss", "grad_x", "grad_w"), got, base, ref):
        e_op, e_plain = _err(o, r), _err(p, r)
        floor = torch.finfo(xdt).eps * r.abs().max().item()  # x's dtype: see the module docstring
        assert e_op <= 2 * e_plain + floor, f"{name}: op error {e_op:.3g} > 2 x plain {e_plain:.3g} + floor {floor:.3g}"
    return got


# ---- accuracy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("ls", [0.0, 0.1], ids=["ls0", "ls0.1"])
@pytest.mark.parametrize("chunk", [0, 8], ids=["rule", "chunk8"])  # 8: T = 37 is no multiple of the chunk
def test_accuracy(path, dtypes, ls, chunk):
    x, w, t = case()
    xdt, wdt = DTYPES[dtypes]
    with _path(path):
        assert_within_reference(x, w, t, xdt, wdt, lambda a, b, c: linear_cross_entropy(a, b, c, -100, ls, chunk=chunk),
                                ls)


@pytest.mark.parametrize("path", PATHS)
def test_accuracy_sum(path):
    x, w, t = case()
    with _path(path):
        op = lambda a, b, c: linear_cross_entropy(a, b, c, label_smoothing=0.1, reduction="sum", chunk=8)  # noqa: E731
        assert_within_reference(x, w, t, BF16, FP32, op, 0.1, "sum")


@given(T=st.integers(1, 40), H=st.integers(1, 24), V=st.integers(2, 70), chunk=st.integers(0, 16),
       ls=st.sampled_from([0.0, 0.2]), seed=st.integers(0, 9))
def test_accuracy_shapes_hypothesis(T, H, V, chunk, ls, seed):
    x, w, t = case(T, H, V, ignored=(1,), seed=seed)
    if (t != -100).any():  # all-ignored is its own test (plain torch gives NaN there)
        assert_within_reference(x, w, t, BF16, FP32,
                                lambda a, b, c: linear_cross_entropy(a, b, c, label_smoothing=ls, chunk=chunk), ls)


@pytest.mark.parametrize("path", PATHS)
def test_all_ignored_is_zero_not_nan(path):
    x, w, t = case(T=9)
    t[:] = -100
    with _path(path):
        for red in ("mean", "sum"):
            loss, gx, gw = run_grads(lambda a, b, c, red=red: linear_cross_entropy(a, b, c, reduction=red), x, w, t,
                                     BF16, FP32)
            assert loss.item() == 0 and not gx.any() and not gw.any()
        with torch.no_grad():
            assert linear_cross_entropy(x.float(), w.float(), t).item() == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ls", [0.0, 0.1], ids=["ls0", "ls0.1"])
def test_eval_reductions_match_torch_and_training(path, ls):
    """Without a gradient only the row losses are computed (anatomy::linear_cross_entropy_rows); "mean"
    equals the training op's loss bit for bit (same kernels, same sum), "none" and "sum" match torch."""
    x, w, t = (v.float() if v.is_floating_point() else v for v in case())
    with _path(path):
        train = linear_cross_entropy(x.requires_grad_(), w, t, label_smoothing=ls)
        with torch.no_grad():
            got = {r: linear_cross_entropy(x, w, t, label_smoothing=ls, reduction=r) for r in lce.REDUCTIONS}
    assert torch.equal(got["mean"], train.detach())
    for red, v in got.items():
        ref = plain(x.double(), w.double(), t, ls, red)
        base = plain(x, w, t, ls, red)
        assert _err(v, ref) <= 2 * _err(base, ref) + torch.finfo(FP32).eps * ref.abs().max().item(), red
    assert got["none"].shape == t.shape and (got["none"][t == -100] == 0).all()


# ---- the row kernel against the reference --------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("V,block", [(50, 16), (37, 8), (64, 16), (50, 64), (64, 64), (5, 8)],
                         ids=["tail", "odd", "blocks-exact", "single-tail", "single-exact", "single-short"])
@pytest.mark.parametrize("ls", [0.0, 0.3], ids=["ls0", "ls0.3"])
def test_row_kernel_matches_reference(V, block, ls):
    """Several column blocks with a masked tail, and one block (the row kept in registers): losses and the
    in-place gradient against the same math in fp64 on the same bf16 logits, within twice the plain-torch
    reference's own error."""
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(7, V, generator=g) * 4).to(BF16)
    t = torch.randint(0, V, (7,), generator=g)
    t[2] = -100
    scale = torch.tensor(1 / 6)
    out = {}
    for name, fn, dt in (("triton", lce.ce_rows_triton, BF16), ("ref", lce.ce_rows_reference, BF16),
                         ("fp64", lce.ce_rows_reference, FP64)):
        lg, losses = logits.to(dt, copy=True), torch.empty(7, dtype=FP64 if dt is FP64 else FP32)
        kw = dict(block=block) if name == "triton" else {}
        fn(lg, t, losses, scale.to(losses.dtype), -100, ls, True, **kw)
        out[name] = (losses, lg)
    for i, what in enumerate(("losses", "grad")):
        r = out["fp64"][i]
        floor = torch.finfo(out["triton"][i].dtype).eps * r.abs().max().item()
        assert _err(out["triton"][i], r) <= 2 * _err(out["ref"][i], r) + floor, what
    assert out["triton"][0][2] == 0 and not out["triton"][1][2].any()  # the ignored row: loss 0, zero gradient


# ---- shapes, compile, autocast ------------------------------------------------------------------------
def test_meta_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for make in (lambda v: v.to("meta"), FakeTensorMode().from_tensor):
        x, w, t = (make(v) for v in (torch.randn(2, 5, 8, dtype=BF16), torch.randn(11, 8), torch.zeros(2, 5).long()))
        loss = linear_cross_entropy(x.requires_grad_(), w, t)
        assert (loss.shape, loss.dtype) == ((), FP32)
        with torch.no_grad():
            assert linear_cross_entropy(x, w, t, reduction="none").shape == (2, 5)
        out = torch.ops.anatomy.linear_cross_entropy(x.view(10, 8), w, t.view(10))
        assert [(o.shape, o.dtype) for o in out] == [((), FP32), ((10, 8), BF16), ((11, 8), FP32)]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out-of-place"])
def test_opcheck(inplace):
    x, w, t = (v.float() if v.is_floating_point() else v for v in case(T=9, H=8, V=13))
    torch.library.opcheck(torch.ops.anatomy.linear_cross_entropy.default,
                          (x.requires_grad_(), w.clone().requires_grad_(), t, -100, 0.1, "mean", 4, inplace))
    torch.library.opcheck(torch.ops.anatomy.linear_cross_entropy_rows.default, (x.detach(), w, t, -100, 0.0, 4))


def _head(h, proj, w, t):
    return linear_cross_entropy(h @ proj, w, t, label_smoothing=0.1)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_fullgraph(backend):
    """fullgraph=True raises on any graph break; the op is opaque, so compiled values and gradients equal
    eager's (backward scales out of place when compiled, in place in eager: the same products)."""
    torch._dynamo.reset()
    x, w, t = case()
    proj = torch.randn(24, 24, dtype=FP64) / 5
    results = []
    for fn in (_head, torch.compile(_head, fullgraph=True, backend=backend)):
        leaves = [v.float().requires_grad_() for v in (x, proj, w)]
        with torch.autocast("cpu", dtype=BF16):
            loss = fn(leaves[0], leaves[1], leaves[2], t)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (le, ge), (lc, gc) = results
    assert torch.equal(le, lc) and all(map(torch.equal, ge, gc))


def test_autocast_dtypes_and_one_weight_cast():
    """Under bf16 autocast: the op sees x in bf16 and the fp32 weight, saves grad_x in bf16 and grad_w in
    fp32, returns an fp32 loss, and the fp32 leaves get fp32 gradients; the weight is cast once per call
    (a dispatch mode counts the (V, H) casts of a 5-chunk call), never per chunk."""
    x, w, t = (v.float() if v.is_floating_point() else v for v in case())
    x.requires_grad_(), w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        with torch.autocast("cpu", dtype=BF16):
            loss = linear_cross_entropy(x, w, t, chunk=8)
    loss.backward()
    assert loss.dtype == FP32 and x.grad.dtype == FP32 and w.grad.dtype == FP32
    assert [(v.shape, v.dtype) for v in saved] == [(x.shape, BF16), (w.shape, FP32)]
    assert sum(v.numel() * v.element_size() for v in saved) == saved_bytes(37, 24, 50, 2, 4)

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == tuple(w.shape):
                Casts.n += 1
            return func(*args, **(kwargs or {}))

    with Casts():
        lce._forward(x.detach().to(BF16), w.detach(), t, -100, 0.0, "mean", 8, lce.ce_rows_reference, False)
    assert Casts.n == 1


# ---- no host sync ------------------------------------------------------------------------------------
class NoSync(TorchDispatchMode):
    """Fails on every op that copies a device value to the host (a sync on CUDA)."""
    SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.equal.default,
            torch.ops.aten.is_nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNC:
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", PATHS)
def test_no_host_sync(path):
    """The implementations run op by op under the mode (it sees every aten call they make), and the whole
    public call with its backward (the mode sees the op and the backward's scaling)."""
    x, w, t = case()
    xb, wf = x.to(BF16), w.float()
    rows_fn = lce.ce_rows_triton if path == "triton" else lce.ce_rows_reference
    with _path(path), NoSync():
        lce._forward(xb, wf, t, -100, 0.1, "mean", 8, rows_fn, False)
        lce._rows_forward(xb, wf, t, -100, 0.1, 8, rows_fn)
        xl, wl = xb.clone().requires_grad_(), wf.clone().requires_grad_()
        linear_cross_entropy(xl, wl, t, chunk=8).backward()
        with torch.no_grad():
            linear_cross_entropy(xb, wf, t)
    with pytest.raises(AssertionError, match="host sync"), NoSync():
        t.sum().item()  # the mode does catch a sync


@pytest.mark.parametrize("align", [1, 8], ids=["unpadded", "align8"])
@pytest.mark.parametrize("wdt", [FP32, BF16], ids=["w32", "w16"])
@pytest.mark.parametrize("T,chunk", [(100, 32), (100, 0), (7, 0)], ids=["chunks", "rule", "short"])
def test_cuda_path_bytes_are_the_table(wdt, T, chunk, align):
    """The CUDA path (the native grad_w accumulation; the row kernel, which allocates nothing, left out)
    on meta tensors under the liveness walk: every storage it makes, and their peak, are what
    linear_ce_chunks tabulates, to the byte. V = 300 is a multiple of 4, not of 8: at align 8 the table's
    V' = 304, and a bf16 weight, which needs no cast, gets the padded copy."""
    from llm_anatomy.measure.liveness import LiveStorage

    H, V = 16, 300
    x, w = torch.empty(T, H, dtype=BF16, device="meta"), torch.empty(V, H, dtype=wdt, device="meta")
    t = torch.zeros(T, dtype=torch.long, device="meta")
    live = LiveStorage()
    live.track(x, w, t)
    inputs = live.allocated
    with live:
        out = lce._forward(x, w, t, -100, 0.0, "mean", chunk, lambda *a: None, True, align)
        row = live.phase("forward")
    p = wdt.itemsize
    assert row["peak"] - inputs == peak_bytes(T, H, V, 2, p, chunk, align)
    assert row["allocated"] - inputs == saved_bytes(T, H, V, 2, p, align) + 4  # what stays: grad_x, grad_w, the loss
    assert [o.untyped_storage().nbytes() for o in out] == [4, T * H * 2, (304 if align == 8 else V) * H * p]
    assert align == 1 or peak_bytes(T, H, V, 2, p, chunk, align) > peak_bytes(T, H, V, 2, p, chunk)


def test_cuda_accumulation_calls_are_valid():
    """The CUDA grad_w accumulation (mm / addmm with an fp32 out_dtype over bf16 operands, CUDA-only
    kernels in torch) checked for schema and result dtype on meta tensors, which have those kernels."""
    m = lambda *s, dt=BF16: torch.empty(*s, dtype=dt, device="meta")
    gw = m(11, 8, dt=FP32)
    for first in (True, False):
        lce.accumulate_grad_weight(gw, m(5, 11).t(), m(5, 8), first, native=True)
    assert gw.dtype == FP32 and gw.shape == (11, 8)


def test_bad_arguments():
    x, w, t = (v.float() if v.is_floating_point() else v for v in case(T=4))
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="for evaluation"):
        linear_cross_entropy(x.requires_grad_(), w, t, reduction="none")
    with pytest.raises(ValueError, match="want x"):
        linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(x, w, t, label_smoothing=1.5)


# ---- the chunk rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,H,V,rows", [(16384, 2048, 32000, 4096), (16384, 2048, 128256, 4096),
                                        (65536, 512, 16000, 4096), (16384, 2048, 262144, 2048),
                                        (3000, 512, 32000, 3000),
                                        (131072, 8192, 128256, 8192)],
                         ids=["1b-32k", "1b-128k", "seed", "256k-budget", "short", "large-liger"])
def test_chunk_rows_named_shapes(T, H, V, rows):
    assert chunk_rows(T, H, V) == rows


@given(T=st.integers(1, 1 << 20), H=st.integers(64, 16384), V=st.integers(2, 1 << 18), c=st.sampled_from([2, 4]))
def test_chunk_rows_rule(T, H, V, c):
    C, L = chunk_rows(T, H, V, c), liger_rows(T, H, V)
    assert L <= C <= T
    assert C <= max(C_MIN, L)  # never longer than needed for the GEMMs' efficiency, unless Liger's already is
    assert C == min(T, L) or min(C, T) * V * c <= max(LOGITS_BUDGET, T * H * 2)  # the budget, unless Liger's rows
    b = forward_bytes(T, H, V, c, 4)
    assert b["logits"] == min(C, T) * V * c and b["grad_w"] == V * H * 4


def test_chunks_module_imports_without_torch():
    """The calculator (no torch) can use the rule: the module imports nothing from torch."""
    spec = importlib.util.find_spec("llm_anatomy.kernels.linear_ce_chunks")
    code = (f"import sys, importlib.util; sys.modules['torch'] = None\n"
            f"s = importlib.util.spec_from_file_location('m', {spec.origin!r})\n"
            f"m = importlib.util.module_from_spec(s)\n"
            f"s.loader.exec_module(m); assert m.chunk_rows(16384, 2048, 128256) == 4096")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- CUDA ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", ["bf16-w32", "bf16"])
def test_cuda_accuracy_and_no_sync(cuda_device, dtypes):
    """The Triton kernel and the out_dtype GEMMs on the GPU: accuracy as on CPU, at a shape with several
    chunks and a vocab no multiple of the block, and no host sync (CUDA's sync debug mode raises)."""
    x, w, t = case(T=1000, H=256, V=5003, ignored=range(0, 1000, 7), device=cuda_device)
    xdt, wdt = DTYPES[dtypes]
    op = lambda a, b, c: linear_cross_entropy(a, b, c, label_smoothing=0.1, chunk=384)
    assert_within_reference(x, w, t, xdt, wdt, op, 0.1)
    xl, wl = x.to(xdt).requires_grad_(), w.to(wdt).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(xl, wl, t).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
def test_bench_dry_run(tmp_path):
    """bench/linear_ce.py end to end on CPU at a tiny shape (the GPU run's code path, minus the GPU): its
    JSON has a row per implementation and chunk, ours beside its predicted peak, the command; bad flags exit 2."""
    import json

    from bench import linear_ce as bench

    out = tmp_path / "lce.json"
    bench.main(["--dry-run", "--no-liger", "--reps", "10", "--shapes", "40x8x30", "--chunks", "0,16", "--breakdown",
                "--row-blocks", "0,16", "--json", str(out)])
    res = json.loads(out.read_text())
    assert [(r["impl"], r["chunk"]) for r in res["rows"]] == [("ours", 0), ("ours-c16", 16)]
    assert res["rows"][1]["predicted_peak_mib"] * 2 ** 20 == peak_bytes(40, 8, 30, 2, 4, 16)
    blocks = {"row_kernel[0]", "row_kernel[16]"} if INTERPRET else set()  # the Triton row kernel at each width
    assert set(res["rows"][0]["breakdown_ms"]) == {"weight_cast", "logits_mm", "row_kernel", "grad_x_mm",
                                                   "grad_w_addmm", "backward_scale", "backward_scale_not_one"} | blocks
    assert res["command"].startswith("python3 -m bench.linear_ce --dry-run")
    sustained = res["matmul_tflop_s_sustained"]  # each row against the ceiling of the power limit too
    assert sustained > 0 and all(r["frac_ceiling_sustained"] == pytest.approx(r["tflop_s"] / sustained)
                                 for r in res["rows"])
    for bad in (["--shapes", "1x2"], ["--row-blocks", "24"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--dry-run", *bad])
        assert e.value.code == 2
