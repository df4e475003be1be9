"""Run.recompute="mlp": the efficient model keeps per layer only the block input, the attention
branch and SDPA's tensors, and re-runs both norms, the residual sum, gate_up and the activation in
backward (llm_anatomy/efficient/transformer.py). The claims: the same numbers as without recompute, the
calculator's saved bytes and FLOPs exact per component (the re-run gate_up in backward, and no
other matmul: the checkpoints' early stop), and its memory walk exact on CPU."""
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.measure.liveness import measure_phases_live
from llm_anatomy.measure.run import measure_saved
from llm_anatomy.models import autocast_ctx, build_model, make_batch
from validations.configs import NAMED, POLICIES, configs, runs
from validations.test_efficient import EFFICIENT, check_flops, check_matches_baseline, check_saved

MLP = "mlp"


def _grads(cfg, run, device="cpu"):
    model = build_model(cfg, "efficient", device=device, dtype=torch.bfloat16 if run.dtype == "bf16" else None,
                        recompute=run.recompute, lean=run.lean)
    ids, targets = make_batch(cfg, run, device)
    with autocast_ctx(run, torch.device(device).type):
        loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_identical(cfg, run, device="cpu", recompute=MLP):
    """Recompute changes what is kept, not what is computed: loss and every gradient bit for bit."""
    l0, g0 = _grads(cfg, run, device)
    l1, g1 = _grads(cfg, Run(run.batch, run.seq, run.dtype, recompute), device)
    assert torch.equal(l0, l1), (l0.item(), l1.item())
    for name, g in g0.items():
        assert torch.equal(g, g1[name]), f"{name}: max |diff| {(g - g1[name]).abs().max().item():.3e}"


# the claims' config suffix of each recompute policy (test_recompute_full.py holds what is full's alone)
SUFFIX = {MLP: "recompute", "full": "recompute-full"}


@pytest.mark.parametrize("recompute", list(SUFFIX))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", EFFICIENT)
def test_same_loss_and_gradients_as_without_recompute(name, policy, recompute):
    check_identical(NAMED[name], Run(2, 24, policy), recompute=recompute)


@pytest.mark.parametrize("recompute", list(SUFFIX))
@pytest.mark.parametrize("policy", ["amp", "fp32"])
@pytest.mark.parametrize("name", EFFICIENT)
def test_matches_baseline(name, policy, recompute):
    check_matches_baseline(NAMED[name], Run(2, 24, policy, recompute))


@pytest.mark.parametrize("recompute", list(SUFFIX))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", EFFICIENT)
def test_saved_bytes_exact_named(name, policy, recompute, claims):
    check_saved(claims, NAMED[name], Run(2, 16, policy, recompute), f"{name}/B2S16/{policy}/{SUFFIX[recompute]}")


@pytest.mark.parametrize("recompute", list(SUFFIX))
@settings(max_examples=15, deadline=None)
@given(cfg=configs(), run=runs())
def test_saved_bytes_exact_hypothesis(recompute, cfg, run, claims):
    check_saved(claims, cfg, Run(run.batch, run.seq, run.dtype, recompute), f"{cfg}/{run}/{SUFFIX[recompute]}")


@pytest.mark.parametrize("recompute", list(SUFFIX))
@pytest.mark.parametrize("name", EFFICIENT)
def test_flops_exact(name, recompute, claims):
    """Under mlp, backward counts the gate_up matmul a second time and nothing else; under full, qkv, o and
    gate_up (and SDPA's forward, where the counter sees it), not down. Were anything else re-run, the measured
    backward would exceed the prediction by its 2·T·d_in·d_out."""
    check_flops(claims, NAMED[name], Run(2, 16, "fp32", recompute), f"{name}/B2S16/{SUFFIX[recompute]}")


@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
def test_recompute_saves_what_it_says(lean, claims):
    """Per layer and token, 6H + 6I bytes fewer under amp: out go two fp32 norm inputs (8H), the two bf16
    normed inputs (4H), gate_up (4I) and the activation (2I); in come the fp32 block input, now kept by
    attention's checkpoint (4H), and the bf16 branch (2H); and the three weight casts. Against the lean
    block (Run.lean) 6H + 4I (it keeps no activation: lean.py), and per layer o's (H, H) bf16 weight cast
    comes in: o is nn.Linear under recompute, a lean matmul without, which keeps no cast."""
    cfg, run = NAMED["tiny-gqa"], Run(2, 16, "amp", lean=lean)
    none, mlp = (measure_saved(cfg, r, "efficient").report.storage_bytes() for r in (run, Run(2, 16, "amp", MLP)))
    H, I, L, T, D = cfg.hidden, cfg.intermediate, cfg.layers, run.tokens, cfg.hidden + 2 * cfg.kv_dim
    predicted = (L * T * (6 * H + 4 * I) - L * 2 * H * H if lean else
                 L * T * (6 * H + 6 * I) + L * 2 * (D * H + 2 * I * H + I * H))
    claims.check("memory.saved: recompute's saving", component="model",
                 config=f"tiny-gqa/B2S16/amp{'/lean' if lean else ''}", variant="efficient", predicted=predicted,
                 measured=none - mlp, device="cpu", unit="B",
                 note="the docstring's arithmetic against saved storage measured with and without")


# where the backward peak sits: the MLP of the last layer, the loss, attention (see test_memory_walk)
WALK = [("tiny-gqa", Run(4, 96)), ("tiny-gqa", Run(2, 256)), ("tiny-gptoss-tied", Run(4, 128)),
        ("seed-narrow", Run(2, 64))]


@pytest.mark.parametrize("policy, optimizer", [("amp", "adamw"), ("bf16", None), ("fp32", "ademamix")])
@pytest.mark.parametrize("name, r", WALK, ids=[f"{n}-B{r.batch}S{r.seq}" for n, r in WALK])
def test_memory_walk_exact_on_cpu(name, r, policy, optimizer, claims):
    """The backward walk re-makes each layer's recomputed tensors when its down (MLP) or qkv (attention)
    matmul's backward asks for them: live storage on CPU, to the byte."""
    cfg, run = NAMED[name], Run(r.batch, r.seq, policy, MLP)
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer=optimizer)}
    pred = phases(cfg, run, "efficient", optimizer=optimizer, device="cpu")
    kw = dict(component="model", config=f"{name}/B{r.batch}S{r.seq}/{policy}/recompute", variant="efficient",
              device="cpu", unit="B")
    claims.check("memory.live after forward", predicted=pred["forward_end"], measured=meas["forward"]["allocated"], **kw)
    claims.check("memory.peak in backward", predicted=pred["backward_peak"], measured=meas["backward"]["peak"],
                 note=f"predicted at {pred['backward_peak_at']}; measured after {meas['backward']['peak_op']}", **kw)
    claims.check("memory.live after backward", predicted=pred["backward_end"], measured=meas["backward"]["allocated"],
                 **kw)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(cfg=configs(), run=runs())
def test_memory_walk_hypothesis(cfg, run, claims):
    """test_memory_walk's claim and bound (±3%: at the tiniest configs the walk's gradient-bound stages
    are close, not exact, with or without recompute), on drawn configs under recompute."""
    run = Run(run.batch * 4, run.seq * 4, run.dtype, MLP)  # enough tokens for activations to matter
    meas = {p["name"]: p for p in measure_phases_live(cfg, run, "efficient", optimizer="adamw")}
    pred = phases(cfg, run, "efficient", optimizer="adamw", device="cpu")
    claims.check("memory.peak in backward", component="model", config=f"{cfg}/{run}", variant="efficient",
                 predicted=pred["backward_peak"], measured=meas["backward"]["peak"], tolerance=0.03, device="cpu",
                 unit="B")


def test_recompute_is_an_efficient_option():
    with pytest.raises(ConfigError, match="recompute must be one of"):
        Run(2, 16, "amp", "all")
    with pytest.raises(ConfigError, match="option of the efficient variant"):
        build_model(NAMED["tiny"], "baseline", device="meta", recompute=MLP)
    from llm_anatomy.calculator import estimate

    with pytest.raises(ConfigError, match="option of the efficient variant"):
        estimate(NAMED["tiny"], Run(2, 16, "amp", MLP), "baseline")
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--preset", "seed", "--variant", "baseline",
                          "--recompute", MLP], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--variant efficient" in out.stderr, out.stderr


def test_estimate_reports_it():
    out = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "estimate", "--preset", "seed", "--variant",
                          "efficient", "--recompute", MLP, "--json"], capture_output=True, text=True, check=True)
    import json

    d = json.loads(out.stdout)
    assert d["run"]["recompute"] == MLP
    none = phases(ModelConfig.from_name("seed"), Run(16, 4096), "efficient")
    assert d["memory"]["saved"]["total"] < none["saved"] / 2  # seed B16 S4096: 2.9 of 6.4 GiB


@pytest.mark.gpu
@pytest.mark.parametrize("name", EFFICIENT + ["seed-narrow"])
def test_on_cuda(name, claims):
    """On the GPU: the same numbers as without recompute (the Triton kernels, cuDNN, Liger), and the
    saved bytes and FLOPs exact."""
    check_identical(NAMED[name], Run(2, 256, "amp"), device="cuda")
    check_saved(claims, NAMED[name], Run(2, 256, "amp", MLP), f"{name}/B2S256/amp/recompute", device="cuda")
    check_flops(claims, NAMED[name], Run(2, 256, "amp", MLP), f"{name}/B2S256/amp/recompute", device="cuda")
