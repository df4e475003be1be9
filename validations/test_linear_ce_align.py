"""anatomy::linear_cross_entropy with a padded vocabulary (align, kernel_shapes.lce_vocab): the GEMMs run over
V' = V rounded up to a multiple of `align`, so a vocabulary that is not a multiple of 8 leaves the misaligned
GEMM rates. The pad rows of the weight are zeros, so the pad logits are exact zeros, the row kernel never
reads them, and they add nothing to grad_x or grad_w: every output is the unpadded op's to rounding. Not bit for
bit: the GEMMs run over other shapes, and no BLAS promises the same summation order for another shape.
The bytes are the table's with V' (grad_w is the first V rows of a (V', H) accumulator): test_linear_ce.py's
test_cuda_path_bytes_are_the_table at align 8."""
from __future__ import annotations

import pytest
import torch

from llm_anatomy.kernel_shapes import lce_vocab
from llm_anatomy.kernels import linear_ce as lce
from llm_anatomy.kernels.linear_ce import linear_cross_entropy
from validations.test_linear_ce import BF16, DTYPES, PATHS, _path, case


def _run(x, w, t, align, **kw):
    """(loss, grad_x, grad_w) of one training call, then the eval row losses, at this align."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, t, align=align, **kw)
    loss.backward()
    with torch.no_grad():
        rows = linear_cross_entropy(x, w, t, align=align, reduction="none", chunk=kw.get("chunk", 0))
    return loss.detach(), x.grad, w.grad, rows


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtypes", ["bf16-w32", "fp32"])
@pytest.mark.parametrize("align", [8, 64])
def test_a_padded_vocabulary_changes_no_output(path, dtypes, align):
    """V = 50 over chunks of 16 rows, label smoothing and ignored rows: every output at align 8 and 64 is the
    unpadded op's to rounding; grad_w keeps the (V, H) shape over a (V', H) storage.

    The bound: each output ends in one rounding to its dtype (2 u_out, one ulp, where the two runs' fp32 values
    straddle a rounding boundary) after fp32 sums whose order may differ with the GEMM's shape; two orders of an
    n-term sum differ by at most n u_fp32 of its absolute sum, and the longest chain here is the logits' H terms
    then the gradients' max(T, V') (the usual gamma_n bound, e.g. Higham, Accuracy and Stability, 3.1). A pad row
    that leaked into any output would move it by about a softmax probability, 1/V, far above the bound."""
    xdt, wdt = DTYPES[dtypes]
    T, H, V = 37, 24, 50
    x, w, t = case(T=T, H=H, V=V)
    x, w = x.to(xdt), w.to(wdt)
    with _path(path):
        want = _run(x, w, t, 1, label_smoothing=0.1, chunk=16)
        got = _run(x, w, t, align, label_smoothing=0.1, chunk=16)
    n = H + max(T, lce_vocab(V, align))
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        rtol = torch.finfo(a.dtype).eps + n * torch.finfo(torch.float32).eps / 2
        torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * a.abs().max().item())
    gw = got[2]
    assert gw.shape == (50, 24) and gw.is_contiguous()
    assert gw.untyped_storage().nbytes() == lce_vocab(50, align) * 24 * wdt.itemsize


@pytest.mark.parametrize("path", PATHS)
def test_unpadded_grad_w_is_the_buffer_itself(path):
    """Where nothing is padded (align 1, or a vocabulary already a multiple of align), grad_w is the op's
    accumulator itself, not a view of it: a view keeps the accumulator alive past where the byte table frees it."""
    x, w, t = (v.float() if v.is_floating_point() else v for v in case(T=37, H=24, V=48))
    with _path(path):
        for align in (1, 8, 16):
            _, gx, gw = torch.ops.anatomy.linear_cross_entropy(x, w, t, align=align)
            assert gx._base is None and gw._base is None and gw.shape == (48, 24)
        _, _, gw = torch.ops.anatomy.linear_cross_entropy(x, w, t, align=32)  # V' = 64: the first 48 rows
        assert gw._base is not None and gw.shape == (48, 24) and gw.is_contiguous()


def test_an_aligned_vocabulary_is_not_copied():
    """align never copies a weight whose vocabulary is already a multiple of it and whose dtype is the
    compute dtype; lce_vocab rounds up, and align < 1 is a one-line error."""
    w = torch.randn(64, 8, dtype=BF16)
    assert lce._weight(w, BF16, 8) is w and lce._weight(w, BF16, 64) is w
    assert lce._weight(w, BF16, 128).shape == (128, 8)
    assert [lce_vocab(v, a) for v, a in ((50, 8), (48, 8), (50257, 64), (7, 1))] == [56, 48, 50304, 7]
    x, w, t = (v.float() if v.is_floating_point() else v for v in case(T=4))
    with pytest.raises(ValueError, match="align must be a positive"):
        linear_cross_entropy(x, w, t, align=0)


def test_opcheck_with_a_padded_vocabulary():
    x, w, t = (v.float() if v.is_floating_point() else v for v in case(T=9, H=8, V=13))
    torch.library.opcheck(torch.ops.anatomy.linear_cross_entropy.default,
                          (x.requires_grad_(), w.clone().requires_grad_(), t, -100, 0.1, "mean", 4, True, 8))
    torch.library.opcheck(torch.ops.anatomy.linear_cross_entropy_rows.default, (x.detach(), w, t, -100, 0.0, 4, 8))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("policy", ["amp", "bf16"])
def test_the_calculator_follows_the_models_padding(monkeypatch, claims, tied, policy):
    """kernel_shapes.LCE_ALIGN is read by the efficient model's loss and by the calculator alike: at 8, on a
    vocabulary of 101, the saved bytes and every phase boundary of a step with AdamW are what the CPU run
    holds, to the byte (an untied lm_head's .grad keeps the padded accumulator's storage; a tied head's is
    the sum with the embedding's gradient, a new (V, H) tensor)."""
    from llm_anatomy import kernel_shapes
    from llm_anatomy.config import ModelConfig, Run
    from validations.test_memory_walk import _check

    monkeypatch.setattr(kernel_shapes, "LCE_ALIGN", 8)
    cfg = ModelConfig(name=f"align8-{'tied' if tied else 'untied'}", hidden=48, layers=2, heads=3, kv_heads=1,
                      intermediate=80, vocab=101, tie_embeddings=tied)
    _check(claims, cfg, Run(2, 8, policy), "efficient", "adamw", f"{cfg.name}/B2S8/{policy}/adamw")


def test_the_timing_model_prices_the_padded_gemms(monkeypatch):
    """At LCE_ALIGN 8 the timing model's CE GEMMs run over V' = 104 for a vocabulary of 97 (off the misaligned
    rates), the row kernel still over 97 columns, and a bf16 run gets the padded weight copy it makes."""
    from llm_anatomy import kernel_shapes
    from llm_anatomy.calculator.timing import kernels
    from llm_anatomy.config import ModelConfig, Run

    cfg = ModelConfig(name="align8-timing", hidden=64, layers=1, heads=4, intermediate=128, vocab=97)
    row_bytes = []
    for align, vg in ((1, 97), (8, 104)):
        monkeypatch.setattr(kernel_shapes, "LCE_ALIGN", align)
        ks = {k.name: k for k in kernels(cfg, Run(2, 64, "bf16"), "efficient", None, None)}
        assert ks["loss.logits"].shape[2] == vg and ks["loss.grad_weight"].shape[1] == vg
        assert ("loss.lm_head.weight_cast" in ks) == (align == 8)
        row_bytes.append(ks["loss.cross_entropy"].bytes)
    assert row_bytes[0] == row_bytes[1] > 0  # the row kernel reads and writes the same 97 columns a row
