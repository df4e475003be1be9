"""Time one training-step variant (forward + backward) on the GPU, in its own process for a clean peak.

python3 -m bench.step --peer efficient --preset seed --batch 16 --seq 4096 [--repeats 10] [--json OUT]
python3 -m bench.step --peer efficient --recompute mlp ...   # reported as peer "efficient-recompute"
python3 -m bench.step --peer efficient --loss-impl liger ... # Liger's loss: peer "efficient-liger-loss"
python3 -m bench.step --peer efficient --lean ...            # the lean block (Run.lean): peer "efficient-lean"
python3 -m bench.step --peer hf --hf-config validations/data/hf_configs/Qwen3-30B-A3B --layers 6 --optimizer adamw
    # a Hugging Face config (its own model class for the hf peers, experts on transformers' grouped_mm; hf-eager:
    # its per-expert loop), the first --layers layers, and fused AdamW's step inside the timed step

Peers: baseline, baseline-compile, efficient, efficient-compile (ours; the efficient peers' loss is our fused
linear CE unless --loss-impl liger, and each record says which: loss_impl); hf, hf-compile, hf-liger
(transformers' LlamaForCausalLM with SDPA, optionally Liger's instance patch). Autocast bf16 over fp32
weights, as in ANCHORS.md. Median of `repeats` CUDA-event timings after warm-up, each step started on an idle
GPU; host_ms: the median time the host takes to issue a step (forward and backward return before the GPU
finishes), so a step whose host_ms is near its median_ms is host-bound; peak is
torch.cuda.max_memory_allocated over the timed steps. MFU: the calculator's model FLOPs (causal
attention halved) over the bf16 matmul ceiling measured in this process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.io import write_atomic


def matmul_ceiling(n: int = 8192, reps: int = 20) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3)


def hf_from_config(peer: str, path: str, layers: int):
    """transformers' own model of a Hugging Face config.json (AutoModelForCausalLM, SDPA attention), the first
    `layers` layers: experts on its grouped_mm (peer hf) or its per-expert loop (hf-eager). fp32 weights under
    bf16 autocast, as ours (from_config would otherwise build the file's torch_dtype, bf16)."""
    import transformers

    from llm_anatomy.hf_config import load_json_object

    d = load_json_object(Path(path) / "config.json" if Path(path).is_dir() else Path(path), "config")
    d = dict(d, num_hidden_layers=layers)
    d.pop("quantization_config", None)
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    impl = dict(experts_implementation="eager" if peer == "hf-eager" else "grouped_mm") if _is_moe(cfg) else {}
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32,
                                                             **impl)


def _is_moe(hf_cfg) -> bool:
    return any(getattr(hf_cfg, k, None) for k in ("num_experts", "num_local_experts"))


def build(peer: str, cfg: ModelConfig, recompute: str = "none", loss_impl: str = "anatomy", lean: bool = False,
          hf_config: str | None = None):
    if peer.startswith("hf") and hf_config:
        model = hf_from_config(peer, hf_config, cfg.layers)
        step = lambda ids, tgt: model(input_ids=ids, labels=tgt).loss  # noqa: E731  (HF shifts labels itself)
    elif peer.startswith("hf"):
        import transformers

        hf = transformers.LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                                      num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                      intermediate_size=cfg.intermediate, vocab_size=cfg.vocab,
                                      tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=1 << 17,
                                      rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                                      attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(hf).cuda()
        if peer == "hf-liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model)
        step = lambda ids, tgt: model(input_ids=ids, labels=tgt).loss  # noqa: E731  (HF shifts labels itself)
    else:
        from llm_anatomy.models import build_model

        model = build_model(cfg, peer.removesuffix("-compile"), device="cuda", recompute=recompute, lean=lean)
        if hasattr(model.head, "impl"):  # the efficient model's fused linear CE (efficient/loss.py)
            model.head.impl = loss_impl
        step = model
    if peer.endswith("-compile"):
        step = torch.compile(step)
    return model, step


def loop_step(peer: str, cfg: ModelConfig, run: Run):
    """The peer built (seed 0) and one training-loop step on a fixed batch: forward under bf16 autocast,
    backward, zero_grad. For the scripts that run it back to back (profile_step.py, step_power.py)."""
    torch.manual_seed(0)
    model, step = build(peer, cfg, lean=run.lean)
    ids = torch.randint(0, cfg.vocab, (run.batch, run.seq), device="cuda")

    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(ids, ids)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return one


def _versions(peer: str) -> dict:
    if not peer.startswith("hf"):
        return {}
    import transformers

    return dict(transformers=transformers.__version__)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True)
    p.add_argument("--preset", default="seed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recompute", default="none", help="none | mlp (the efficient peer only: Run.recompute)")
    p.add_argument("--loss-impl", default="anatomy", help="anatomy | liger (the efficient peers' loss: Run.loss_impl)")
    p.add_argument("--lean", action="store_true", help="the efficient peers' lean block (Run.lean)")
    p.add_argument("--hf-config", help="a Hugging Face config.json (or its folder) in place of --preset")
    p.add_argument("--layers", type=int, help="the first LAYERS layers of the model")
    p.add_argument("--optimizer", choices=["none", "adamw"], default="none",
                   help="adamw: torch's fused AdamW step inside each timed step (default: forward + backward)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.recompute != "none" and a.peer != "efficient":
        p.error(f"--recompute applies to --peer efficient, not {a.peer}")
    if a.loss_impl != "anatomy" and not a.peer.startswith("efficient"):
        p.error(f"--loss-impl applies to the efficient peers, not {a.peer}")
    if a.lean and not a.peer.startswith("efficient"):
        p.error(f"--lean applies to the efficient peers, not {a.peer}")
    if a.lean and a.recompute != "none":
        p.error("--lean is the block without recompute: drop --recompute or --lean")
    try:
        if a.hf_config:
            from llm_anatomy.hf_config import from_hf_config

            cfg = from_hf_config(a.hf_config)
        else:
            cfg = ModelConfig.from_name(a.preset)
        if a.layers is not None:
            cfg = replace(cfg, layers=a.layers)
        run = Run(a.batch, a.seq, "amp", loss_impl=a.loss_impl, lean=a.lean)
    except ConfigError as e:
        p.error(str(e))  # one line, exit 2
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    torch.manual_seed(0)
    ceiling = matmul_ceiling()
    model, step = build(a.peer, cfg, a.recompute, a.loss_impl, run.lean, a.hf_config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if a.optimizer == "adamw" else None
    ids = [torch.randint(0, cfg.vocab, (run.batch, run.seq), device="cuda") for _ in range(2)]
    times, host = [], []  # host: the step's issue time on the host (the call returns before the GPU finishes)
    t_compile = time.perf_counter()
    for i in range(a.warmup + a.repeats):
        if i == a.warmup:
            torch.cuda.synchronize()
            t_compile = time.perf_counter() - t_compile
            torch.cuda.reset_peak_memory_stats()
        x = ids[i % 2]  # rotate inputs: never time the same batch twice in a row
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(x, x)
        loss.backward()
        if opt is not None:
            opt.step()
        end.record()
        t1 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i >= a.warmup:
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            host.append((t1 - t0) * 1e3)
    from llm_anatomy.calculator import estimate

    est = estimate(cfg, run).to_dict()["flops"]["model"]  # model FLOPs: a recompute's are not counted
    model_flops = est["forward"] + est["backward"]
    ms = statistics.median(times)
    peer = (a.peer + ("-recompute" if a.recompute != "none" else "") + ("-liger-loss" if a.loss_impl == "liger" else "")
            + ("-lean" if run.lean else ""))
    # a row without loss_impl ran Liger's; one without lean, the plain block (Run.from_record)
    own = dict(loss_impl=a.loss_impl, **(dict(lean=True) if run.lean else {})) if a.peer.startswith("efficient") else {}
    res = dict(peer=peer, recompute=a.recompute, **own, preset=a.hf_config or a.preset, layers=cfg.layers,
               optimizer=a.optimizer, batch=run.batch, seq=run.seq, median_ms=ms, times_ms=times,
               host_ms=statistics.median(host),
               tokens_per_s=run.tokens / (ms / 1e3), peak_mib=torch.cuda.max_memory_allocated() / 2**20,
               reserved_mib=torch.cuda.max_memory_reserved() / 2**20, mfu=model_flops / (ms / 1e3) / ceiling,
               model_flops=model_flops, matmul_ceiling_tflops=ceiling / 1e12, warmup_s=t_compile,
               loss=float(loss), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
               cuda=torch.version.cuda, **_versions(a.peer), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               command="python3 -m bench.step " + " ".join(argv if argv is not None else sys.argv[1:]))
    if a.json:
        write_atomic(a.json, json.dumps(res, indent=1))
    print(f"{peer:20s} {ms:8.2f} ms  {res['tokens_per_s'] / 1e6:6.3f} Mtok/s  peak {res['peak_mib']:9,.0f} MiB  "
          f"MFU {res['mfu']:.1%}  (ceiling {ceiling / 1e12:.0f} TFLOP/s)")
    return res


if __name__ == "__main__":
    main()
