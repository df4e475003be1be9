"""Published training throughputs on GPUs this project never measured, against the derived profiles' predictions.

Each row is a real run someone published (a benchmark table, with its source: URL, repository, path and commit),
and the closest run our models express: the same model shape where ours has it (a LLaMA model as itself; an
MPT model as a LLaMA-style model of its width, depth, heads and vocab, its GELU MLP of ratio 4 as a SwiGLU MLP
of the same parameters: intermediate = 2/3 x 4 x hidden, rounded to a multiple of 64), the same micro-batch,
sequence, GPU count and FSDP, and the nearest recompute policy (selective activation checkpointing: mlp; full
checkpointing: full). The prediction is plan.step_time on the named GPU's derived profile (timing/derived.py),
with its low and high bounds, and on the datasheet profile beside it; what differs in the software (their
compile, their attention kernel, fp32 vs bf16 optimizer state, gradient accumulation) is said per row.

The derivation was written before these rows were collected and is not tuned to them. `python3 -m
scripts.compare_published` writes the comparison to records.DERIVED_GPUS (docs/derived-gpus.md reads it);
validations/test_derived_gpus.py recomputes it and checks the committed file is current.
"""
from __future__ import annotations

from llm_anatomy.config import ModelConfig, Run

TORCHTITAN = ("pytorch/torchtitan docs/performance.md at eaea6f6a2fa940f03a10906be1df3489cf30af85 "
              "(https://github.com/pytorch/torchtitan/blob/main/docs/performance.md)")
FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md at 061f2c7ce64e655100286584a7629e2a09f827ba "
           "(https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md); model shapes: "
           "scripts/train/yamls/pretrain/mpt-7b.yaml, mpt-1b.yaml")
FOUNDRY_SW = ("MPT: ALiBi (no RoPE), LayerNorm, GELU MLP, Triton/flash attention, Composer's FSDP with gradient "
              "accumulation (the optimizer steps once per {accum} micro-batches; ours once per micro-batch)")


def mpt(name: str, hidden: int, layers: int, heads: int) -> ModelConfig:
    """An MPT model of expansion ratio 4 and vocab 50,368 as a LLaMA-style model of the same parameters."""
    return ModelConfig(hidden=hidden, layers=layers, heads=heads, intermediate=round(8 * hidden / 3 / 64) * 64,
                       vocab=50368, name=name)


# gpu: our table's name for their part; tps: their tokens/s per GPU; mfu: theirs, as published (None: not given)
ROWS = (
    dict(id="torchtitan-llama3.1-8b-h100", source=TORCHTITAN + ", Table 1 (FSDP, eager)", model="llama3-8b",
         gpu="h100-sxm", world=8, batch=2, seq=8192, recompute="mlp", tps=5762, mfu=None,
         hardware="H100 SXM on Grand Teton: 96 GB HBM2e, 2.4 TB/s, 500 W power limit (our H100 SXM: 80 GB HBM3, "
                  "3.35 TB/s, 700 W)",
         software="torchtitan eager: FSDP2 with bf16 params and fp32 reduce, selective (op) activation checkpointing, "
                  "SDPA flash attention, unfused norms and loss"),
    dict(id="torchtitan-llama3-8b-a100", source=TORCHTITAN + ", Llama 3 on 64 A100 (80GB), selective op AC",
         model="llama3-8b", gpu="a100-80gb-sxm", world=64, batch=1, seq=8192, recompute="mlp", tps=2973, mfu=0.582,
         hardware="A100 80GB, 64 GPUs (8 nodes)",
         software="torchtitan eager (an earlier version): FSDP2, selective op activation checkpointing"),
    dict(id="foundry-mpt-7b-h100", source=FOUNDRY + ", H100 80GB BF16 table, 7b row at 2048", model=("mpt-7b", 4096, 32, 32),
         gpu="h100-sxm", world=8, batch=6, seq=2048, recompute="none", tps=10643, mfu=0.4644, accum=1,
         hardware="H100 80GB", software=FOUNDRY_SW),
    dict(id="foundry-mpt-7b-a100-80gb", source=FOUNDRY + ", A100 80GB table, 7b row at 2048", model=("mpt-7b", 4096, 32, 32),
         gpu="a100-80gb-sxm", world=8, batch=6, seq=2048, recompute="none", tps=4641, mfu=0.6423, accum=2,
         hardware="A100 80GB", software=FOUNDRY_SW),
    dict(id="foundry-mpt-7b-a100-40gb", source=FOUNDRY + ", A100 40GB table, 7b row at 2048 on 8 GPUs",
         model=("mpt-7b", 4096, 32, 32), gpu="a100-40gb-sxm", world=8, batch=12, seq=2048, recompute="full",
         tps=3679, mfu=0.5092, accum=4, hardware="A100 40GB",
         software=FOUNDRY_SW + "; pure bf16 (their mixed precision PURE), full activation checkpointing"),
    dict(id="foundry-mpt-1b-h100", source=FOUNDRY + ", H100 80GB BF16 table, 1b row at 2048 on 8 GPUs",
         model=("mpt-1b", 2048, 24, 16), gpu="h100-sxm", world=8, batch=14, seq=2048, recompute="none", tps=45455,
         mfu=0.4182, accum=1, hardware="H100 80GB", software=FOUNDRY_SW),
)


def config(row: dict) -> ModelConfig:
    m = row["model"]
    return ModelConfig.from_name(m) if isinstance(m, str) else mpt(*m)


def predict(row: dict) -> dict:
    """The row's run on its GPU's derived profile (point, low, high) and on its datasheet: tokens/s per GPU."""
    from llm_anatomy.plan import step_time

    cfg = config(row)
    run = Run(batch=row["batch"], seq=row["seq"], dtype="bf16" if "pure bf16" in row["software"] else "amp",
              recompute=row["recompute"], lean=row["recompute"] == "none")
    out = {}
    for key, gpu in (("derived", f"{row['gpu']}-derived"), ("low", f"{row['gpu']}-derived-low"),
                     ("high", f"{row['gpu']}-derived-high"), ("datasheet", f"{row['gpu']}-datasheet")):
        t = step_time(cfg, run, "efficient", gpu, row["world"], "fsdp", "adamw", 8)
        out[key] = dict(tokens_per_s=row["batch"] * row["seq"] / t["step_s"], mfu=t["mfu"])
    return out


def comparison() -> dict:
    """Every row with its prediction and predicted / published ratio (JSON-able)."""
    rows = []
    for r in ROWS:
        p = predict(r)
        rows.append(dict(r, model=config(r).name, config=config(r).to_dict(), predicted=p,
                         ratio={k: v["tokens_per_s"] / r["tps"] for k, v in p.items()}))
    return dict(doc="docs/derived-gpus.md", rule="predicted / published tokens per second per GPU; the derived "
                "profile was not tuned to these rows", rows=rows)


def table(cmp: dict) -> str:
    """The comparison as the markdown table docs/derived-gpus.md carries."""
    lines = ["| run | GPU | published tokens/s/GPU | derived (low-high) | ratio | datasheet ratio |",
             "|---|---|---:|---:|---:|---:|"]
    for r in cmp["rows"]:
        p = r["predicted"]
        lines.append(f"| {r['id']} | {r['gpu']} | {r['tps']:,} | {p['derived']['tokens_per_s']:,.0f} "
                     f"({p['low']['tokens_per_s']:,.0f}-{p['high']['tokens_per_s']:,.0f}) | "
                     f"{r['ratio']['derived']:.2f} | {r['ratio']['datasheet']:.2f} |")
    return "\n".join(lines)


def profiles_table() -> str:
    """Each table GPU's derived figures, as the markdown table docs/derived-gpus.md carries."""
    from llm_anatomy.calculator import gpus
    from llm_anatomy.calculator.timing import derived, lookup

    base = lookup.get(derived.BASE)
    lines = ["| GPU | generation | GEMM TFLOP/s of peak | copy GB/s of datasheet | sustained GEMM ratio (low-high) "
             "| fraction spread |", "|---|---|---:|---:|---:|---:|"]
    for k in gpus.GPUS:
        d, low, ds = lookup.get(f"{k}-derived"), lookup.get(f"{k}-derived-low"), lookup.datasheet(k)
        lines.append(f"| {k} | {derived.GENERATION[k]} | {d.matmul_flops['bfloat16'] / 1e12:,.0f} of "
                     f"{d.peak_flops['bfloat16'] / 1e12:,.0f} | {d.hbm_Bps / 1e9:,.0f} of {ds.hbm_Bps / 1e9:,.0f} | "
                     f"{d.sustained_ratio['matmul']:.3f} ({low.sustained_ratio['matmul']:.3f}-1) | "
                     f"±{derived.spread(k, base)[0]:.0%} |")
    return "\n".join(lines)
