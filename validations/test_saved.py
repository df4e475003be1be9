"""Saved-for-backward storage bytes: the calculator's list equals what autograd actually keeps."""
import pytest
import torch
from hypothesis import given

from llm_anatomy.calculator import estimate
from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.measure.run import measure_saved
from validations.configs import NAMED, POLICIES, RUNS, configs, runs


def _check(claims, cfg, run, name, device="cpu"):
    est = estimate(cfg, run, device=device)
    report = measure_saved(cfg, run, device=device).report
    claims.check("memory.saved.total", component="model", config=name, variant="baseline",
                 predicted=est.total("saved_bytes"), measured=report.storage_bytes(), device=device, unit="B")
    measured = report.by_component()
    assert set(measured) <= set(est.components), f"saved outside any component: {measured}"
    for comp, c in est.components.items():
        claims.check("memory.saved", component=comp, config=name, variant="baseline",
                     predicted=c.saved_bytes, measured=measured.get(comp, 0), device=device, unit="B")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("run_id", RUNS)
@pytest.mark.parametrize("name", NAMED)
def test_saved_bytes_exact_named(name, run_id, policy, claims):
    r = RUNS[run_id]
    _check(claims, NAMED[name], Run(r.batch, r.seq, policy), f"{name}/{run_id}/{policy}")


@pytest.mark.parametrize("name, run", [("llama3-8b", Run(1, 4096, "bf16")), ("mistral-7b", Run(2, 2048, "fp32")),
                                       ("seed", Run(16, 4096, "bf16"))],
                         ids=["llama3-8b-B1S4096-bf16", "mistral-7b-B2S2048-fp32", "seed-B16S4096-bf16"])
def test_saved_bytes_exact_full_size_on_meta(name, run, claims):
    """Full-size presets on meta tensors: storage sizes without memory (tens to hundreds of GB here).
    Autocast has no meta kernel, so the amp policy is checked on real CPU and CUDA tensors instead."""
    from llm_anatomy.config import PRESETS

    _check(claims, PRESETS[name], run, f"{name}/B{run.batch}S{run.seq}/{run.dtype}", device="meta")


@given(cfg=configs(), run=runs())
def test_saved_bytes_exact_hypothesis(cfg, run, claims):
    _check(claims, cfg, run, f"{cfg}/{run}")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-gptoss-tied", "seed-narrow"])
def test_saved_bytes_exact_cuda(name, policy, claims):
    _check(claims, NAMED[name], Run(2, 256, policy), f"{name}/B2S256/{policy}", device="cuda")


@pytest.mark.gpu
def test_saved_bytes_exact_cuda_seed_full(claims):
    """The whole seed config at B=2, S=4096 on the GPU (about 11 GiB of saved activations)."""
    from llm_anatomy.config import PRESETS

    _check(claims, PRESETS["seed"], Run(2, 4096), "seed/B2S4096/amp", device="cuda")


# ---- seed insights, as executable claims -----------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_gpt_oss_mlp_saves_extra_intermediates(policy, claims):
    """The +1 and the two clamps make the unfused MLP keep extra (B, S, I) tensors: count them."""
    base = NAMED["tiny"]
    run = Run(2, 16, policy)
    I_shape = (run.batch, run.seq, base.intermediate)
    counts = {}
    for mlp in ("swiglu", "gpt-oss"):
        cfg = ModelConfig(**{**base.to_dict(), "mlp": mlp})
        counts[mlp] = measure_saved(cfg, run).report.count("mlp", I_shape) / cfg.layers
    predicted = {mlp: sum(1 for s in estimate(ModelConfig(**{**base.to_dict(), "mlp": mlp}), run)
                          .components["mlp"].saved if s.shape == I_shape) for mlp in counts}
    claims.check("gpt-oss MLP: extra saved (B,S,I) tensors per layer", component="mlp", config=f"tiny/{policy}",
                 variant="baseline", predicted=predicted["gpt-oss"] - predicted["swiglu"],
                 measured=int(counts["gpt-oss"] - counts["swiglu"]))
    assert counts["gpt-oss"] - counts["swiglu"] == 2  # raw gate and raw up, kept by the clamps


class _ChunkedV(torch.nn.Module):
    """A fused QKV projection chunked into views; abs(v) keeps v itself for backward."""

    component = "attention"

    def __init__(self, hidden: int, contiguous: bool):
        super().__init__()
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.contiguous = contiguous

    def forward(self, x):  # x: (B, S, H)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # three views of one (B, S, 3H) tensor
        if self.contiguous:
            v = v.contiguous()  # its own (B, S, H) storage: the fused tensor can be freed
        return v.abs().sum()


@pytest.mark.parametrize("contiguous", [False, True], ids=["view", "contiguous"])
def test_chunked_qkv_view_keeps_fused_tensor_alive(contiguous, claims):
    from llm_anatomy.measure.saved import SavedTensorTracer

    B, S, H = 2, 8, 32
    mod = _ChunkedV(H, contiguous)
    with SavedTensorTracer(mod) as tr:
        mod(torch.randn(B, S, H))
    (v,) = [r for r in tr.report.records if r.shape == (B, S, H)]
    claims.check("saved v: storage bytes / tensor bytes", component="attention",
                 config=f"chunked-qkv/{'contiguous' if contiguous else 'view'}", variant="insight",
                 predicted=1 if contiguous else 3, measured=v.storage_bytes // v.tensor_bytes)
