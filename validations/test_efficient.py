"""The efficient model: same function as the baseline (to within the baseline's own error), and the
calculator's saved bytes and FLOPs for it, exact per component."""
from contextlib import nullcontext
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_anatomy.calculator import estimate
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.efficient.transformer import to_baseline_names
from llm_anatomy.measure.run import measure_flops, measure_saved
from llm_anatomy.models import autocast_ctx, build_model, make_batch, param_dtype
from validations.configs import NAMED, POLICIES, accuracy_configs, accuracy_runs, configs, runs
from validations.moe_reference import Routing

EFFICIENT = ["tiny", "tiny-gqa", "tiny-gptoss-tied"]


def _loss_and_grads(model, ids, targets, run, device):
    model.zero_grad(set_to_none=True)
    with autocast_ctx(run, torch.device(device).type):
        loss = model(ids, targets)
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    if model.variant == "efficient":
        grads = to_baseline_names(grads, model.cfg)
    return loss.double(), grads


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _token_losses(model, ids, targets, run, device):
    with torch.no_grad(), autocast_ctx(run, torch.device(device).type):
        return model(ids, targets, reduction="none").double()


def check_matches_baseline(cfg: ModelConfig, run: Run, device="cpu", pooled: tuple[str, ...] = ()):
    """error(efficient) <= 2 × error(baseline, same dtype), both against the baseline in float64.
    (run.recompute: the efficient model's.) pooled: name endings whose gradients are too few elements for the rule
    one layer at a time (gpt-oss's sinks: one per head); every layer's are concatenated and judged as one tensor.

    Outputs are the (B·S,) per-token losses; every parameter gradient is checked too. (The mean loss
    alone is one number: its rounding error is one draw, too noisy for a 2× ratio.) The floor,
    4 × fp32 epsilon, covers the fp32 policy, where the baseline's own error can be zero by accident
    of summation order while the fused kernels sum in another order. MoE configs: every model routes as the
    baseline in the run's dtype (moe_reference.Routing: top-k's near-ties would otherwise compare two
    functions), the rule's float64 reference included."""
    ref = build_model(cfg, "baseline", device=device, dtype=torch.float64)
    base = build_model(cfg, "baseline", device=device, dtype=param_dtype(run))
    eff = build_model(cfg, "efficient", device=device, dtype=param_dtype(run), recompute=run.recompute, lean=run.lean)
    eff.load_state_dict(base.state_dict())
    ids, targets = make_batch(cfg, run, device)
    fp64, run_b = Run(run.batch, run.seq, "fp32"), Run(run.batch, run.seq, run.dtype)
    routing = Routing(ref, base, eff) if cfg.experts else None
    with routing or nullcontext():  # MoE: the baseline routes, float64 and the efficient model follow it
        l_b, (_, g_b) = _token_losses(base, ids, targets, run_b, device), _loss_and_grads(base, ids, targets, run_b,
                                                                                          device)
        if routing:
            routing.imposing = True
        l_ref, (_, g_ref) = _token_losses(ref, ids, targets, fp64, device), _loss_and_grads(ref, ids, targets, fp64,
                                                                                            device)
        l_e, (_, g_e) = _token_losses(eff, ids, targets, run, device), _loss_and_grads(eff, ids, targets, run, device)
    for end in pooled:
        for g in (g_ref, g_b, g_e):
            names = [n for n in g if n.endswith(end)]
            if names:
                g[end] = torch.cat([g.pop(n).flatten() for n in names])
    floor = 4 * torch.finfo(torch.float32).eps
    worst = {}
    for name in ["token losses", *g_ref]:
        r, b, e = (l_ref, l_b, l_e) if name == "token losses" else (g_ref[name], g_b[name], g_e[name])
        err_b, err_e = _rel(b, r), _rel(e, r)
        assert err_e <= 2 * err_b + floor, f"{name}: efficient error {err_e:.3e} > 2 × baseline's {err_b:.3e}"
        worst[name] = (err_e, err_b)
    return worst


LEAN = pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])  # Run.lean: the lean block or not


@LEAN
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", EFFICIENT)
def test_matches_baseline_named(name, policy, lean):
    check_matches_baseline(NAMED[name], Run(2, 24, policy, lean=lean))


@settings(max_examples=25)
@given(cfg=accuracy_configs(), run=accuracy_runs(), lean=st.booleans())
def test_matches_baseline_hypothesis(cfg, run, lean):
    check_matches_baseline(cfg, replace(run, lean=lean))


@pytest.mark.gpu
@LEAN
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", EFFICIENT)
def test_matches_baseline_cuda(name, policy, lean):
    check_matches_baseline(NAMED[name], Run(2, 128, policy, lean=lean), device="cuda")


# ---- exact accounting ------------------------------------------------------------------------

def check_saved(claims, cfg, run, name, device="cpu"):
    est = estimate(cfg, run, "efficient", device=device)
    report = measure_saved(cfg, run, "efficient", device=device).report
    measured = report.by_component()
    assert set(measured) <= set(est.components), f"saved outside any component: {measured}"
    claims.check("memory.saved.total", component="model", config=name, variant="efficient",
                 predicted=est.total("saved_bytes"), measured=report.storage_bytes(), device=device, unit="B")
    for comp, c in est.components.items():
        claims.check("memory.saved", component=comp, config=name, variant="efficient",
                     predicted=c.saved_bytes, measured=measured.get(comp, 0), device=device, unit="B")


@LEAN
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", EFFICIENT)
def test_saved_bytes_exact_named(name, policy, lean, claims):
    check_saved(claims, NAMED[name], Run(2, 16, policy, lean=lean), f"{name}/B2S16/{policy}{'/lean' * lean}")


@given(cfg=configs(), run=runs(), lean=st.booleans())
def test_saved_bytes_exact_hypothesis(cfg, run, lean, claims):
    run = replace(run, lean=lean)
    check_saved(claims, cfg, run, f"{cfg}/{run}")


@pytest.mark.gpu
@LEAN
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", EFFICIENT + ["seed-narrow"])
def test_saved_bytes_exact_cuda(name, policy, lean, claims):
    check_saved(claims, NAMED[name], Run(2, 256, policy, lean=lean), f"{name}/B2S256/{policy}{'/lean' * lean}",
                device="cuda")


def check_flops(claims, cfg, run, name, device="cpu"):
    est = estimate(cfg, run, "efficient", device=device)
    meas = measure_flops(cfg, run, "efficient", device=device)
    for d, claim, attr in (("forward", "flops.counter.forward", "flops_counter_fwd"),
                           ("backward", "flops.counter.backward", "flops_counter_bwd")):
        claims.check(claim, component="model", config=name, variant="efficient",
                     predicted=est.total(attr), measured=meas[d]["total"], device=device, unit="FLOP")
        for comp, c in est.components.items():
            claims.check(claim, component=comp, config=name, variant="efficient",
                         predicted=getattr(c, attr), measured=meas[d].get(comp, 0), device=device, unit="FLOP")


@pytest.mark.parametrize("name", EFFICIENT)
def test_flops_exact_cpu(name, claims):
    check_flops(claims, NAMED[name], Run(2, 16, "fp32"), f"{name}/B2S16")


@pytest.mark.gpu
@pytest.mark.parametrize("name", EFFICIENT + ["seed-narrow"])
def test_flops_exact_cuda(name, claims):
    check_flops(claims, NAMED[name], Run(2, 256, "amp"), f"{name}/B2S256/amp", device="cuda")


@pytest.mark.parametrize("policy", POLICIES)
def test_reduction_ratios_match_prediction(policy, claims):
    """Per component: baseline saved bytes / efficient saved bytes, measured vs predicted (exact fractions)."""
    cfg, run = NAMED["tiny-gqa"], Run(2, 16, policy)
    b, e = (measure_saved(cfg, run, v).report.by_component() for v in ("baseline", "efficient"))
    pb, pe = (estimate(cfg, run, v, device="cpu").components for v in ("baseline", "efficient"))
    claims.check("saved-bytes reduction (baseline / efficient)", component="model", config=f"tiny-gqa/{policy}",
                 variant="ratio", predicted=Fraction(sum(c.saved_bytes for c in pb.values()),
                                                     sum(c.saved_bytes for c in pe.values())),
                 measured=Fraction(sum(b.values()), sum(e.values())))
    for comp in pb:
        if pe[comp].saved_bytes == 0:
            continue
        claims.check("saved-bytes reduction (baseline / efficient)", component=comp, config=f"tiny-gqa/{policy}",
                     variant="ratio", predicted=Fraction(pb[comp].saved_bytes, pe[comp].saved_bytes),
                     measured=Fraction(b.get(comp, 0), e.get(comp, 0)))


# ---- seed insights, as executable claims -----------------------------------------------------

def test_fused_ce_computes_gradients_in_forward(claims):
    """The gradients exist when forward returns; backward only scales them by the incoming gradient."""
    from llm_anatomy.efficient.loss import linear_ce
    from llm_anatomy.measure.flops import flop_counter

    g = torch.Generator().manual_seed(0)
    T, H, V = 64, 32, 300
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    with flop_counter() as fwd:
        loss = linear_ce(x, w, t)
    # what forward left for backward: the two gradients (copied: backward scales them in place)
    grad_x, grad_w = (s.clone() for s in loss.grad_fn.saved_tensors)
    with flop_counter() as bwd:
        (loss * 3.0).backward()
    ref_x, ref_w = torch.autograd.grad(torch.nn.functional.cross_entropy(x @ w.t(), t), (x, w))
    torch.testing.assert_close(grad_x, ref_x)  # already the full gradient before backward ran
    torch.testing.assert_close(grad_w, ref_w)
    torch.testing.assert_close(x.grad, 3.0 * ref_x)  # backward distributed it, scaled
    claims.check("fused CE: matmul FLOPs in forward (logits, grad_input, grad_weight)", component="loss",
                 config=f"T{T}H{H}V{V}", variant="efficient", predicted=3 * 2 * T * H * V,
                 measured=fwd.get_total_flops(), unit="FLOP")
    claims.check("fused CE: matmul FLOPs in backward", component="loss", config=f"T{T}H{H}V{V}",
                 variant="efficient", predicted=0, measured=bwd.get_total_flops(), unit="FLOP")


class _BareKernel(torch.autograd.Function):
    """Stands for a Triton kernel behind Function.apply: it computes in whatever dtype its inputs have.
    Autocast does not intercept .apply(), so under autocast the fp32 inputs arrive as fp32."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0  # a kernel writing its output in its input's dtype

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class _OptedInKernel(_BareKernel):
    forward = staticmethod(torch.amp.custom_fwd(_BareKernel.forward, device_type="cpu", cast_inputs=torch.bfloat16))
    backward = staticmethod(torch.amp.custom_bwd(_BareKernel.backward, device_type="cpu"))


def test_autocast_does_not_see_a_bare_function_but_sees_our_ops():
    from llm_anatomy.kernels import rms_norm, swiglu

    x, w = torch.randn(4, 16, requires_grad=True), torch.ones(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _BareKernel.apply(x).dtype == torch.float32  # silently fp32 under autocast
        assert _OptedInKernel.apply(x).dtype == torch.bfloat16  # custom_fwd opts the Function in
        assert rms_norm(x, w).dtype == torch.bfloat16  # ours: registered autocast rules
        assert swiglu(x, x).dtype == torch.bfloat16


def test_efficient_attention_keeps_no_view_of_the_fused_qkv(claims):
    """Views that aren't free: nothing saved in the efficient attention is a view of the fused QKV
    output (rope_qkv writes fresh q, k, v), while the baseline chunk-free path needs no such care."""
    from llm_anatomy.measure.saved import SavedTensorTracer

    cfg, run = NAMED["tiny-gqa"], Run(2, 16, "fp32")
    model = build_model(cfg, "efficient")
    ids, targets = make_batch(cfg, run)
    qkv_outs = []  # kept alive, so no later storage can reuse a freed StorageImpl's address
    hook = model.layers[0].attn.qkv.register_forward_hook(lambda m, a, out: qkv_outs.append(out))
    with SavedTensorTracer(model) as tr:
        loss = model(ids, targets)
    hook.remove()
    qkv_keys = {t.untyped_storage()._cdata for t in qkv_outs}
    attn = [r for r in tr.report.records if r.component == "attention"]
    claims.check("saved storages aliasing the fused QKV output", component="attention", config="tiny-gqa/B2S16",
                 variant="efficient", predicted=0, measured=sum(r.storage_key in qkv_keys for r in attn))
    # and each saved q/k/v storage is exactly its own size (no hidden larger base)
    assert all(r.storage_bytes in (0, r.tensor_bytes) for r in attn), [r for r in attn if r.storage_bytes]
    del loss
