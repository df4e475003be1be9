"""The MoE block's op-level claims: the fused unpermute (llm_anatomy/kernels/moe_unpermute.py) against plain torch
on both paths, its fake implementation and opcheck; the grouped-GEMM fallback against torch._grouped_mm; and
no host sync in the efficient block's forward and backward on the grouped path, proved two ways: no op that
reads a tensor on the host is dispatched (aten._local_scalar_dense, behind .item(), and the ops whose output
shape depends on values), and the block compiles with torch.compile(fullgraph=True), which refuses the graph
break any host read makes (.tolist() included, which reads CPU memory without dispatching: the fallback's
read is the control)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llm_anatomy.efficient.moe import MoE, grouped_mm
from llm_anatomy.kernels.moe_unpermute import moe_unpermute
from llm_anatomy.models import autocast_ctx, init_weights
from llm_anatomy.config import Run
from validations.kernel_cases import BF16, FP32, PATHS, check_accuracy, gen, path_ctx
from validations.test_moe_efficient import NAMED_MOE


def plain_unpermute(y, pos, w):
    T, K = w.shape
    return (w.to(y.dtype).unsqueeze(-1) * y[pos].view(T, K, -1)).sum(1)


def _unpermute_case(dtype, T=7, K=3, H=40, seed=0):
    g = gen(seed)
    pos = torch.randperm(T * K, generator=g)
    inputs = dict(y=torch.randn(T * K, H, generator=g).to(dtype), w=torch.rand(T, K, generator=g))
    return (inputs, lambda t: (moe_unpermute(t["y"], pos, t["w"]),),
            lambda t: (plain_unpermute(t["y"], pos, t["w"]),))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 3, 40), (1, 1, 1), (5, 8, 1100)], ids=["T7K3H40", "T1K1H1", "T5K8H1100"])
def test_unpermute_accuracy(path, dtype, shape):
    """Output, d(y) and d(weights) within twice plain torch's error (plus one rounding unit)."""
    T, K, H = shape
    check_accuracy(*_unpermute_case(dtype, T, K, H), path=path_ctx(path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("amp", [False, True], ids=["plain", "amp"])
def test_unpermute_fast_path_is_the_op(path, amp):
    """The eager fast path (an autograd.Function) and the custom op (taken under any torch function mode) give
    the same bits and dtypes: output, d(y) and d(weights); the test sees which path ran."""
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):  # changes nothing, but is a mode: the custom op runs
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    g = gen(7)
    pos, dout = torch.randperm(15, generator=g), torch.randn(5, 24, generator=g).to(BF16)
    results = []
    for mode in (contextlib.nullcontext(), Mode()):
        y = torch.randn(15, 24, generator=gen(8)).to(BF16).requires_grad_()
        w = torch.rand(5, 3, generator=gen(9)).requires_grad_()
        with path_ctx(path), mode, torch.autocast("cpu", dtype=BF16, enabled=amp):
            out = moe_unpermute(y, pos, w)
            out.backward(dout)
        results.append((type(out.grad_fn).__name__, out, y.grad, w.grad, [t.dtype for t in (out, y.grad, w.grad)]))
    (fast, *a), (op, *b) = results
    assert fast == "_UnpermuteFnBackward" and fast != op
    for x1, x2 in zip(a[:3], b[:3]):
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
    assert a[3] == b[3] == [BF16, BF16, FP32]


def test_unpermute_meta_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    y, pos, w = torch.randn(12, 16, dtype=BF16), torch.randperm(12), torch.rand(4, 3)
    for make in (lambda t: t.to("meta"), FakeTensorMode().from_tensor):
        out = moe_unpermute(make(y), make(pos), make(w))
        assert (out.shape, out.dtype) == ((4, 16), BF16)
    torch.library.opcheck(torch.ops.anatomy.moe_unpermute.default, (y.float().requires_grad_(), pos,
                                                                     w.requires_grad_()))
    torch.library.opcheck(torch.ops.anatomy.moe_unpermute_backward.default,
                          (torch.randn(4, 16), y.float(), pos, w.detach()))
    with pytest.raises(ValueError, match="moe_unpermute"):
        moe_unpermute(y, pos[:5], w)


@pytest.mark.parametrize("bias", ["plain", "folded", "added"])
def test_fallback_matches_grouped_mm(bias):
    """torch._grouped_mm within twice the loop of mm's (addmm's) error against float64, for the output and the
    gradients of x, the weights and the bias (bf16, an empty group): plain, with a bias folded in as a column of
    ones (the weights cast here: fp32 in), and with a bias added after it to each row (ExpertBias: bf16 weights)."""
    g = gen(2)
    offs = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 gets no rows
    rows = torch.tensor([0] * 5 + [2] * 7 + [3] * 8, dtype=torch.int32)
    w = torch.randn(4, 24, 16, generator=g)
    inputs = dict(x=torch.randn(20, 16, generator=g).to(BF16), w=w if bias == "folded" else w.to(BF16))
    if bias != "plain":
        inputs["b"] = torch.randn(4, 24, generator=g).to(BF16)
    dt = lambda t: None if t["x"].dtype == torch.float64 else BF16  # noqa: E731 (the float64 reference: no cast)
    check_accuracy(inputs, lambda t: (grouped_mm(t["x"], t["w"], offs, None, t.get("b"), dt(t), rows),),
                   lambda t: (grouped_mm(t["x"], t["w"], offs, offs.tolist(), t.get("b"), dt(t)),))


@pytest.mark.parametrize("name", ["mixtral-like", "gptoss-like"])
def test_grouped_mm_flops_are_the_loops(name, monkeypatch):
    """The counter counts torch._grouped_mm as the mms it groups (llm_anatomy/measure/flops.py): the block's
    forward and backward count the same FLOPs on the grouped path as on the loop of mm (addmm) over the same
    rows, but for the 8 folded columns a bias adds to the grouped GEMMs' inner dimension."""
    from llm_anatomy.efficient import moe as moe_mod
    from llm_anatomy.measure.flops import flop_counter

    cfg = NAMED_MOE[name]
    x = torch.randn(2, 9, cfg.hidden, dtype=BF16)
    counts = []
    for native in (moe_mod._native, lambda *a: False):
        monkeypatch.setattr(moe_mod, "_native", native)
        block = _block(name, "amp")
        xg = x.clone().requires_grad_()
        with flop_counter() as fwd, autocast_ctx(Run(1, 1, "amp"), "cpu"):
            y = block(xg)
        with flop_counter() as bwd:
            y.float().sum().backward()
        counts.append((fwd.get_total_flops(), bwd.get_total_flops()))
    N, H, I = 18 * cfg.experts_per_token, cfg.hidden, cfg.expert_intermediate
    fold = 2 * N * 8 * (2 * I + H) if cfg.expert_bias else 0  # the ones column (and 7 zeros) in each GEMM
    assert counts[0] == (counts[1][0] + fold, counts[1][1] + 2 * fold)
    assert counts[1][0] >= 2 * N * H * 3 * I  # the expert GEMMs are in it


# ---- no host sync ---------------------------------------------------------------------------------------
SYNCS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "bincount", "repeat_interleave"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _block(name, policy):
    block = MoE(NAMED_MOE[name]).to(torch.float32 if policy == "amp" else BF16)
    init_weights(block)
    return block


GROUPED_CASES = [("mixtral-like", "bf16"), ("mixtral-like", "amp"), ("qwen-moe-like", "bf16"),
                 ("qwen-moe-like", "amp"), ("gptoss-like", "amp"),  # gpt-oss: biases folded into the GEMMs
                 ("gptoss-like", "bf16")]  # and added after them


@pytest.mark.parametrize("name,policy", GROUPED_CASES)
def test_no_host_sync_on_the_grouped_path(name, policy):
    """Every aten op of the forward and backward is dispatched through a mode that records it: none of them
    reads a value on the host (the bincount, nonzero and repeat_interleave a per-expert loop needs are absent;
    so is _local_scalar_dense, the op behind .item() and .tolist())."""
    block, ops = _block(name, policy), _Ops()
    x = torch.randn(2, 9, NAMED_MOE[name].hidden, dtype=BF16, requires_grad=True)
    with ops, autocast_ctx(Run(1, 1, policy), "cpu"):
        block(x).float().square().sum().backward()
    assert "_grouped_mm" in ops.seen and not ops.seen & SYNCS, sorted(ops.seen & SYNCS)


def test_fullgraph_catches_a_host_read():
    """The control for test_block_compiles_fullgraph: the fallback (fp32 here) reads the row ends with
    .tolist(), and fullgraph=True refuses it."""
    torch._dynamo.reset()
    block = MoE(NAMED_MOE["mixtral-like"])
    init_weights(block)
    x = torch.randn(2, 9, block.cfg.hidden)
    with pytest.raises(Exception, match="(?i)graph break|tolist|data-dependent|Unsupported"):
        torch.compile(block, fullgraph=True, backend="aot_eager")(x)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["bf16", "amp"])
@pytest.mark.parametrize("name", ["mixtral-like", "qwen-moe-like", "gptoss-like"])
def test_no_host_sync_cuda(name, policy):
    """On the GPU, CUDA's own sync detector: torch.cuda.set_sync_debug_mode("error") raises on any op that
    waits for the device (a copy to the host, .item(), nonzero), through the forward and the backward."""
    block = MoE(NAMED_MOE[name]).to("cuda", torch.float32 if policy == "amp" else BF16)
    init_weights(block)
    x = torch.randn(2, 64, block.cfg.hidden, dtype=BF16, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with autocast_ctx(Run(1, 1, policy), "cuda"):
            y = block(x)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name,policy", [("mixtral-like", "bf16"), ("qwen-moe-like", "amp"), ("gptoss-like", "amp"),
                                       ("gptoss-like", "bf16")])
def test_block_compiles_fullgraph(name, policy):
    """fullgraph=True raises on a graph break, which any host read of a routing value would cause; the compiled
    block (aot_eager) gives eager's values and gradients bit for bit."""
    torch._dynamo.reset()
    block = _block(name, policy)
    x = torch.randn(2, 9, block.cfg.hidden, dtype=BF16, generator=gen(5), requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (block, compiled):
        with autocast_ctx(Run(1, 1, policy), "cpu"):
            y = fn(x)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *block.parameters()])
        results.append((y, grads))
    (ye, ge), (yc, gc) = results
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
