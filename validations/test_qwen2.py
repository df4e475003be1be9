"""Qwen2 / Qwen2.5: q, k and v with a bias (ModelConfig.qkv_bias), end to end.

Against Hugging Face's Qwen2ForCausalLM on CPU (an outside implementation): parameters, FLOPs under both
conventions and what the biased q/k/v projections save, exactly; and the same per-token losses from the
same weights. Against our own two models: saved bytes and counter FLOPs exact, the efficient model's
error within twice the baseline's, and the parameter lists the memory, sharding and timing models use.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from llm_anatomy.calculator import estimate, param_count
from llm_anatomy.calculator.memory import param_tensors
from llm_anatomy.calculator.sharding import param_shapes
from llm_anatomy.calculator.timing import kernels, param_sizes
from llm_anatomy.config import PRESETS, ModelConfig, Run
from llm_anatomy.measure.saved import SavedTensorTracer
from llm_anatomy.models import autocast_ctx, build_model, make_batch
from validations import test_efficient, test_flops, test_saved
from validations.configs import POLICIES, configs, runs

transformers = pytest.importorskip("transformers")

QWEN = {  # CPU-sized: GQA untied, multi-query tied (odd widths), plain multi-head
    "tiny-qwen2-gqa": ModelConfig(name="tiny-qwen2-gqa", hidden=64, layers=2, heads=8, kv_heads=2, intermediate=160,
                                  vocab=97, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
    "tiny-qwen2-tied": ModelConfig(name="tiny-qwen2-tied", hidden=48, layers=3, heads=3, kv_heads=1, intermediate=80,
                                   vocab=211, tie_embeddings=True, norm_eps=1e-6, qkv_bias=True),
    "tiny-qwen2-mha": ModelConfig(name="tiny-qwen2-mha", hidden=64, layers=1, heads=4, intermediate=96, vocab=128,
                                  qkv_bias=True),
}
QWEN_PRESETS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]


def hf_qwen2(cfg: ModelConfig, device="cpu"):
    """transformers' Qwen2ForCausalLM of the same shape (eager attention: QKᵀ and P@V as two matmuls)."""
    hf = transformers.Qwen2Config(
        hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate, vocab_size=cfg.vocab,
        tie_word_embeddings=cfg.tie_embeddings, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attn_implementation="eager")
    with torch.device(device):
        return transformers.Qwen2ForCausalLM(hf)


# our baseline's names -> Qwen2ForCausalLM's (and Qwen3ForCausalLM's)
_HF_NAMES = [(r"^embed\.", "model.embed_tokens."), (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
             (r"^layers\.(\d+)\.attn\.([qkvo])\.", r"model.layers.\1.self_attn.\2_proj."),
             (r"^layers\.(\d+)\.attn\.([qk]_norm)\.", r"model.layers.\1.self_attn.\2."),  # Qwen3's, same names
             (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
             (r"^layers\.(\d+)\.mlp\.(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
             (r"^norm\.", "model.norm."), (r"^head\.lm_head\.", "lm_head.")]


def _hf_name(name: str) -> str:
    for pat, rep in _HF_NAMES:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(name)


# ---- parameters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*QWEN, *QWEN_PRESETS])
def test_params_equal_huggingface_qwen2(name, claims):
    cfg = QWEN.get(name) or PRESETS[name]
    model = hf_qwen2(cfg, device="meta")
    claims.check("params equal Hugging Face's", component="model", config=name, variant="hf-qwen2",
                 predicted=param_count(cfg), measured=sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("name", QWEN)
def test_parameter_lists_are_the_models(name):
    """memory.param_tensors, sharding.param_shapes and timing.param_sizes list the models' own tensors."""
    check_parameter_lists(QWEN[name])


def check_parameter_lists(cfg: ModelConfig) -> None:
    for variant in ("baseline", "efficient"):
        model = build_model(cfg, variant, device="meta")
        numels = [p.numel() for p in model.parameters()]
        L, t = cfg.layers, param_tensors(cfg, variant)
        head = [] if cfg.tie_embeddings else [t[-1][0]]
        layer = [n for n, k in t[1:len(t) - 1 - len(head)]]
        assert all(k == L for n, k in t[1:len(t) - 1 - len(head)])
        assert numels == [t[0][0], *layer * L, t[len(t) - 1 - len(head)][0], *head], variant
        sizes: dict[int, int] = {}
        for n in numels:
            sizes[n] = sizes.get(n, 0) + 1
        assert param_sizes(cfg, variant) == sizes, variant
    baseline = build_model(cfg, device="meta")
    assert param_shapes(cfg) == [(n, tuple(p.shape)) for n, p in baseline.named_parameters()]


# ---- FLOPs, both conventions, against Hugging Face ---------------------------------------------------
@pytest.mark.parametrize("run", [Run(2, 16, "fp32"), Run(1, 33, "fp32")], ids=["B2S16", "B1S33"])
@pytest.mark.parametrize("name", QWEN)
def test_flops_equal_huggingface_qwen2(name, run, claims):
    """Counter: FlopCounterMode's totals of HF's eager Qwen2, forward, then backward of logits.sum() (the
    baseline's loss adds no matmul). Model: HF's matmuls with the S×S ones (its only bmm: QKᵀ and P@V)
    halved for the causal mask. A bias is an addmm, which FlopCounterMode counts as the mm alone."""
    check_flops_against_hf(claims, QWEN[name], hf_qwen2(QWEN[name]), run, f"{name}/B{run.batch}S{run.seq}", "hf-qwen2")


def check_flops_against_hf(claims, cfg: ModelConfig, model, run: Run, cfg_id: str, variant: str) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    ids, _ = make_batch(cfg, run)
    est = estimate(cfg, run, "baseline", device="cpu")
    measured = {}
    with FlopCounterMode(display=False) as mode:
        logits = model(input_ids=ids).logits
    measured["forward"] = mode
    with FlopCounterMode(display=False) as mode:
        logits.sum().backward()
    measured["backward"] = mode
    for phase, short in (("forward", "fwd"), ("backward", "bwd")):
        mode = measured[phase]
        by_op = {str(op): n for op, n in mode.get_flop_counts()["Global"].items()}
        assert set(by_op) <= {"aten.mm", "aten.addmm", "aten.bmm"}, by_op
        model_flops = by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0) + by_op.get("aten.bmm", 0) // 2
        counter, model = est.total(f"flops_counter_{short}"), est.total(f"flops_model_{short}")
        if phase == "forward":
            claims.check("flops.counter.forward", component="model", config=cfg_id, variant=variant,
                         predicted=counter, measured=mode.get_total_flops(), unit="FLOP")
            claims.check("flops.model.forward", component="model", config=cfg_id, variant=variant,
                         predicted=model, measured=model_flops, unit="FLOP")
        else:
            claims.check("flops.counter.backward", component="model", config=cfg_id, variant=variant,
                         predicted=counter, measured=mode.get_total_flops(), unit="FLOP")
            claims.check("flops.model.backward", component="model", config=cfg_id, variant=variant,
                         predicted=model, measured=model_flops, unit="FLOP")


# ---- what the biased projections save, against Hugging Face ------------------------------------------
LINEAR_SAVED = re.compile(r"^attention\.([qkv]\.(input_cast|weight_cast)|q\+k\+v\.input)$")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", QWEN)
def test_qkv_projections_save_what_huggingface_saves(name, policy, claims):
    """HF's q_proj, k_proj and v_proj (nn.Linear with a bias, after HF's own RMSNorm) against the calculator's
    saved tensors of our q, k, v: under amp each casts the fp32 normed input and its weight (the bias's
    cast is not kept), otherwise the one shared input; parameters are not activations."""
    cfg, run = QWEN[name], Run(2, 16, policy)
    model = hf_qwen2(cfg).to(torch.bfloat16 if policy == "bf16" else torch.float32)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.component = "attention"  # the tracer attributes what these modules save; the rest is "other"
    ids, _ = make_batch(cfg, run)
    with SavedTensorTracer(model) as tracer, autocast_ctx(run, "cpu"):
        logits = model(input_ids=ids).logits
    del logits
    saved = estimate(cfg, run, "baseline", device="cpu").components["attention"].saved
    predicted = sum(s.bytes for s in saved if LINEAR_SAVED.match(s.name))
    claims.check("memory.saved", component="attention.qkv-projections", config=f"{name}/B2S16/{policy}",
                 variant="hf-qwen2", predicted=predicted, measured=tracer.report.storage_bytes("attention"), unit="B")


# ---- the same function as Hugging Face's ------------------------------------------------------------
@pytest.mark.parametrize("name", QWEN)
def test_baseline_computes_huggingface_qwen2(name):
    """Our baseline's weights loaded into Qwen2ForCausalLM, both in float64: the same per-token losses (the
    bias is added before RoPE in both). The logits are float64 evaluations of one formula in different op
    orders; both losses are taken from them cast to float32 (our loss upcasts with .float(), as HF's does),
    so they differ by float32 rounding at most: torch's default float32 tolerances."""
    cfg, run = QWEN[name], Run(2, 24, "fp32")
    ours = build_model(cfg, dtype=torch.float64)
    ids, targets = make_batch(cfg, run)
    mine = check_same_losses(ours, hf_qwen2(cfg).to(torch.float64), ids, targets)
    without = dataclasses.replace(cfg, qkv_bias=False)  # the biases matter: a model without them differs
    plain = build_model(without, dtype=torch.float64)
    plain.load_state_dict({n: t for n, t in ours.state_dict().items() if not n.endswith(".bias")})
    with torch.no_grad():
        assert not torch.allclose(plain(ids, targets, reduction="none"), mine)


def check_same_losses(ours, hf, ids, targets) -> torch.Tensor:
    """Our model's weights loaded into HF's under HF's names; both models' per-token losses equal (torch's float32
    tolerances). Returns ours."""
    cfg = ours.cfg
    missing, unexpected = hf.load_state_dict({_hf_name(n): t for n, t in ours.state_dict().items()}, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set()), (missing,
                                                                                                       unexpected)
    with torch.no_grad():
        mine = ours(ids, targets, reduction="none")
        logits = hf(input_ids=ids).logits
        theirs = F.cross_entropy(logits.float().view(-1, cfg.vocab), targets.view(-1), reduction="none")
    torch.testing.assert_close(mine, theirs)
    return mine


# ---- our two models with biases: exact accounting, same function --------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", QWEN)
def test_saved_and_flops_exact(name, policy, claims):
    cfg, run, cid = QWEN[name], Run(2, 16, policy), f"{name}/B2S16/{policy}"
    test_saved._check(claims, cfg, run, cid)
    test_efficient.check_saved(claims, cfg, run, cid)
    test_efficient.check_saved(claims, cfg, Run(2, 16, policy, recompute="mlp"), cid + "/recompute-mlp")
    test_efficient.check_flops(claims, cfg, run, cid)
    test_flops._check(claims, cfg, run, cid, device="cpu" if policy == "amp" else "meta")


# For the error-ratio claim every tensor has at least 128 elements (validations/configs.py accuracy_configs):
# q's bias is H wide, k's and v's kv_heads x head_dim. k's bias needs the room most: its gradient is a sum
# over keys of dk, whose terms cancel (without RoPE, exactly: each softmax-gradient row sums to zero), so
# the value is small beside the rounding of its terms, and over a few elements its error is one noisy draw.
ACCURACY = {
    "qwen2-gqa-h256": ModelConfig(name="qwen2-gqa-h256", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=192,
                                  vocab=160, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True),
    "qwen2-mqa-tied-h256": ModelConfig(name="qwen2-mqa-tied-h256", hidden=256, layers=2, heads=2, kv_heads=1,
                                       intermediate=160, vocab=211, tie_embeddings=True, qkv_bias=True),
}


@pytest.mark.parametrize("policy, recompute", [(p, "none") for p in POLICIES] + [("amp", "mlp")])
@pytest.mark.parametrize("name", ACCURACY)
def test_efficient_matches_baseline(name, policy, recompute):
    """Loss and every gradient (the biases' included): error(efficient) <= 2 × error(baseline)."""
    worst = test_efficient.check_matches_baseline(ACCURACY[name], Run(2, 24, policy, recompute=recompute))
    assert any(n.endswith("attn.q.bias") for n in worst)  # the fused qkv bias's gradient is split and checked


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", QWEN)
def test_saved_exact_cuda(name, policy, claims):
    """On CUDA: the baseline's matmuls, the efficient model's cuDNN SDPA and Triton rope_qkv, with biases."""
    cfg, run, cid = QWEN[name], Run(2, 256, policy), f"{name}/B2S256/{policy}"
    test_saved._check(claims, cfg, run, cid, device="cuda")
    test_efficient.check_saved(claims, cfg, run, cid, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["amp", "bf16"])
@pytest.mark.parametrize("name", ACCURACY)
def test_efficient_matches_baseline_cuda(name, policy):
    test_efficient.check_matches_baseline(ACCURACY[name], Run(2, 128, policy), device="cuda")


@settings(max_examples=15)
@given(cfg=configs().map(lambda c: dataclasses.replace(c, qkv_bias=True)), run=runs())
def test_saved_and_flops_exact_hypothesis(cfg, run, claims):
    test_saved._check(claims, cfg, run, f"{cfg}/{run}")
    test_efficient.check_saved(claims, cfg, run, f"{cfg}/{run}")
    test_efficient.check_flops(claims, cfg, run, f"{cfg}/{run}")


def test_bias_free_path_unchanged():
    """qkv_bias=False builds what it always built: no bias parameter, and no bias in any calculator list."""
    cfg = dataclasses.replace(QWEN["tiny-qwen2-gqa"], qkv_bias=False)
    for variant in ("baseline", "efficient"):
        assert not [n for n, _ in build_model(cfg, variant, device="meta").named_parameters() if "bias" in n]
        assert not [k for k in kernels(cfg, Run(2, 16), variant) if "bias" in k.name]
    assert not [n for n, _ in param_shapes(cfg) if "bias" in n]
    assert "qkv_bias" not in cfg.to_dict() and QWEN["tiny-qwen2-gqa"].to_dict()["qkv_bias"] is True


# ---- the command line ------------------------------------------------------------------------------
def test_estimate_reads_a_qwen25_config(tmp_path):
    from validations.test_config import QWEN25_7B
    from validations.test_fuzz import run_cli

    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN25_7B))
    rc, out, err = run_cli(["estimate", "--hf-config", str(p), "--batch", "1", "--seq", "32768", "--variant",
                            "efficient", "--gpu", "H200", "--json"], "qwen2")
    assert rc == 0, err
    d = json.loads(out)
    assert d["params"] == 7_615_616_512 and d["config"]["qkv_bias"] is True
    # with its sliding window switched on for layers 20 and up, a sequence longer than the window is refused
    p.write_text(json.dumps({**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}))
    rc, out, err = run_cli(["estimate", "--hf-config", str(p), "--batch", "1", "--seq", "8192"], "qwen2")
    assert rc == 2 and "sliding_window=4096 is shorter than --seq 8192" in err and err.count("\n") == 1


# ---- data parallel: the bias tensors sharded and reduced like any other --------------------------------
@pytest.mark.parametrize("name, strategy, world", [("tiny-qwen2-tied", "ddp", 4), ("tiny-qwen2-gqa", "fsdp", 3),
                                                   ("tiny-qwen2-tied", "fsdp", 4)],
                         ids=["tiny-tied-ddp-W4", "tiny-gqa-fsdp-W3", "tiny-tied-fsdp-W4"])
def test_fake_pg_collectives_and_per_rank_bytes(name, strategy, world, claims):
    """FSDP2 / DDP's real code on a fake process group (llm_anatomy.distributed.simulate), rank 0. FSDP pads
    each bias's shard like a weight's (64 / 3 ranks: chunks of 22, the last short)."""
    cfg = QWEN.get(name) or PRESETS[name]
    check_fake_pg(claims, cfg, name, strategy, world, steps=3 if strategy == "ddp" else 1)


def check_fake_pg(claims, cfg: ModelConfig, name: str, strategy: str, world: int, steps: int) -> None:
    """Rank 0 of FSDP2 / DDP on a fake process group: collectives and per-rank bytes against the calculator."""
    from llm_anatomy.calculator.comm import collective_counts, estimate_distributed
    from llm_anatomy.distributed.simulate import simulate
    from validations.test_distributed import (
        _check_collectives,
        _check_memory,
        _measured_counts,
    )

    run = Run(batch=1, seq=16, dtype="amp")
    for rec in simulate(cfg, run, world, strategy, steps=steps):
        e = estimate_distributed(cfg, run, world, strategy, step=rec["step"] if strategy == "ddp" else None)
        note = f"{strategy} amp, fake PG, W={world}, step {rec['step']}"
        _check_collectives(claims, pred=collective_counts(e["collectives"]), meas=_measured_counts(rec),
                           config=name, variant=strategy, device="cpu-fake-pg", note=note)
        _check_memory(claims, pred=e["memory"], meas=rec["memory"], config=name, variant=strategy,
                      device="cpu-fake-pg", note=note)


# ---- memory phases: the bias tensors and their gradients in the live storage ---------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant", ["baseline", "efficient"])
@pytest.mark.parametrize("name", QWEN)
def test_phases_against_live_storage(name, variant, policy, claims):
    """memory.phases on CPU against live storage (test_memory_walk's claims): the phase ends exact, with
    the biases among the parameters, gradients and AdamW state; the peak in backward within ±3%."""
    from validations.test_memory_walk import _check

    _check(claims, QWEN[name], Run(2, 16, policy), variant, "adamw", f"{name}/B2S16/{policy}/adamw")


def test_fuzz_qwen2_config(tmp_path_factory):
    """Mutated Qwen2.5-7B config.json files (test_fuzz's mutations): one line and exit 2, or an estimate."""
    from hypothesis import given as given_

    from validations.test_config import QWEN25_7B
    from validations.test_fuzz import _examples, mutated, run_cli

    keys = [*QWEN25_7B, "layer_types", "attention_bias", "mlp_bias"]

    @_examples(60)
    @given_(raw=mutated(QWEN25_7B, keys))
    def one(raw):
        p = tmp_path_factory.mktemp("qwen2") / "config.json"
        p.write_bytes(raw)
        rc, out, _ = run_cli(["estimate", "--hf-config", str(p), "--batch", "1", "--seq", "1024", "--json"],
                             "config.json")
        if rc == 0:
            assert isinstance(json.loads(out)["config"].get("qkv_bias", False), bool)

    one()
