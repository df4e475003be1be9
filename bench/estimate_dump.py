"""Every figure the calculator's estimate paths give, over a broad grid, as one JSON document: a change meant to
make the calculator faster must leave this output byte-for-byte the same (compare two dumps with cmp).

Covered: every preset and every committed Hugging Face config (validations/data/hf_configs), a few custom
shapes (1 to 5 layers, gpt-oss's MLP, odd widths); both variants, recompute none/mlp/full, the loss kernels;
amp, bf16 and fp32; several micro-batches and sequences; adamw and ademamix; cuda and cpu. Per case:
cli_estimate.estimate_all with a GPU (measured and datasheet profiles), memory.phases with every backward
stage, timing.estimate_time with every kernel row and segment, per-rank figures on several ranks, and
`anatomy plan`'s candidates. An error is recorded as its message (the same input must fail the same way).

python3 -m bench.estimate_dump OUT.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from llm_anatomy.config import PRESETS, ConfigError, ModelConfig, Run

ROOT = Path(__file__).resolve().parents[1]
CASES = (("efficient", "none"), ("efficient", "mlp"), ("efficient", "full"), ("baseline", "none"))


def configs() -> dict[str, ModelConfig]:
    from llm_anatomy.hf_config import from_hf_config

    out = dict(PRESETS)
    for p in sorted((ROOT / "validations" / "data" / "hf_configs").glob("*/config.json")):
        try:
            out[f"hf:{p.parent.name}"] = from_hf_config(p)
        except ConfigError:
            continue
    seed = PRESETS["seed"]
    for L in (1, 2, 3, 4, 5, 33):
        out[f"seed-L{L}"] = replace(seed, layers=L)
    out["gpt-oss-like"] = ModelConfig(hidden=640, layers=3, heads=10, kv_heads=2, intermediate=1280, vocab=30001,
                                      mlp="gpt-oss", name="gpt-oss-like")
    out["odd-tied-bias"] = ModelConfig(hidden=384, layers=7, heads=6, kv_heads=3, intermediate=1000, vocab=50257,
                                       tie_embeddings=True, qkv_bias=True, name="odd-tied-bias")
    return out


def guard(fn):
    try:
        return fn()
    except (ConfigError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def dump(quick: bool = False) -> dict:
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.calculator.timing import estimate_time
    from llm_anatomy.cli_estimate import estimate_all
    from llm_anatomy.plan import plan

    out: dict = {}
    cfgs = configs()
    shapes = ((1, 4096), (2, 1024), (3, 777), (5, 128)) if not quick else ((1, 4096), (3, 777))
    for cname, cfg in cfgs.items():
        for variant, rc in CASES:
            for b, s in shapes:
                for opt in ("adamw", "ademamix"):
                    run = Run(b, s, recompute=rc)
                    key = f"{cname}|{variant}|{rc}|B{b}|S{s}|{opt}"
                    out[f"all|{key}"] = guard(lambda: estimate_all(cfg, run, variant, optimizer=opt,
                                                                   gpu="h200-measured"))
                out[f"phases-cpu|{cname}|{variant}|{rc}|B{b}|S{s}"] = guard(
                    lambda: phases(cfg, Run(b, s, recompute=rc), variant, "adamw", device="cpu"))
            run = Run(2, 1024, recompute=rc)
            out[f"phases|{cname}|{variant}|{rc}"] = guard(lambda: phases(cfg, run, variant, "ademamix"))
            out[f"time|{cname}|{variant}|{rc}"] = guard(lambda: estimate_time(cfg, run, variant, gpu="h200-measured"))
            out[f"all-h100|{cname}|{variant}|{rc}"] = guard(lambda: estimate_all(cfg, run, variant, gpu="h100-sxm"))
    # dtypes, loss kernels, SDPA backends and datasheet profiles on a few shapes
    for cname in ("seed", "llama3-8b", "qwen2.5-0.5b", "gpt-oss-like", "odd-tied-bias", "seed-L3"):
        cfg = cfgs[cname]
        for variant, rc in CASES:
            for dtype in ("amp", "bf16", "fp32"):
                for loss in ("anatomy", "liger"):
                    for b, s in ((1, 2048), (4, 512), (2, 8192)):
                        run = Run(b, s, dtype, recompute=rc, loss_impl=loss)
                        key = f"{cname}|{variant}|{rc}|{dtype}|{loss}|B{b}|S{s}"
                        out[f"all|{key}"] = guard(lambda: estimate_all(cfg, run, variant, gpu="h200-measured"))
                        out[f"all-cpu|{key}"] = guard(lambda: estimate_all(cfg, run, variant, device="cpu",
                                                                           gpu="h200-measured"))
                        out[f"phases-cpu|{key}"] = guard(lambda: phases(cfg, run, variant, "adamw", device="cpu"))
                run = Run(2, 2048, dtype, recompute=rc)
                for gpu in ("h200-measured", "a100-40gb-sxm", "l4"):
                    for sdpa in (None, "flash", "memory-efficient"):
                        out[f"time|{cname}|{variant}|{rc}|{dtype}|{gpu}|{sdpa}"] = guard(
                            lambda: estimate_time(cfg, run, variant, gpu=gpu, sdpa_backend=sdpa,
                                                  optimizer="ademamix"))
                    out[f"time-noopt|{cname}|{variant}|{rc}|{dtype}|{gpu}"] = guard(
                        lambda: estimate_time(cfg, run, variant, gpu=gpu, optimizer=None))
    # per-rank figures and plans
    for cname in ("llama3-8b", "qwen2.5-0.5b", "seed-L3") + (() if quick else ("llama3.2-1b", "hf:Llama-3.1-8B")):
        cfg = cfgs.get(cname)
        if cfg is None:
            continue
        for variant, rc in CASES:
            for world, strategy in ((2, "ddp"), (8, "fsdp"), (16, "fsdp"), (8, "ddp")):
                run = Run(2, 2048, recompute=rc)
                out[f"dist|{cname}|{variant}|{rc}|{world}|{strategy}"] = guard(
                    lambda: estimate_all(cfg, run, variant, gpu="h200-measured", world_size=world, strategy=strategy))
        for gpus_n in (1, 8):
            for variant in ("efficient", "baseline"):
                out[f"plan|{cname}|{variant}|{gpus_n}"] = guard(
                    lambda: plan(cfg, gpu="h200-measured", seq=4096, gpus_n=gpus_n, variant=variant))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and plans")
    a = ap.parse_args(argv)
    d = dump(a.quick)
    Path(a.out).write_text(json.dumps(d, default=repr) + "\n")
    print(f"{len(d)} outputs written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
