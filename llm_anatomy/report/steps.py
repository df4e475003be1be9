"""The timing model against the committed H200 step and kernel records (bench/step.py, bench/kernel_rates.py,
validations/test_optim.py's benchmarks): `python3 -m llm_anatomy.report.steps [GPU...]` prints the tables."""
from __future__ import annotations

import json

from llm_anatomy import records
from llm_anatomy.calculator import timing
from llm_anatomy.calculator.optimizer import step_bytes_moved
from llm_anatomy.config import ConfigError, ModelConfig, Run


def step_records() -> tuple[tuple[str, str], ...]:
    """(file, variant): our own models' forward + backward, median of 10, CUDA events; recompute read off the
    record."""
    return tuple((records.rel(p), v) for p, v in records.OWN_STEPS)


def compare_committed(gpu: str | dict = "h200-measured") -> list[dict]:
    """Predicted vs measured forward + backward for every committed step record of our models."""
    out = []
    for rel, variant in step_records():
        path = records.ROOT / rel
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        cfg, run = ModelConfig.from_name(rec["preset"]), Run.from_record(rec)
        pred = timing.estimate_time(cfg, run, variant, gpu, optimizer=None, with_kernels=False)
        ms, meas = pred["forward_backward_s"] * 1e3, rec["median_ms"]
        out.append(dict(record=rel, variant=variant, preset=rec["preset"], batch=rec["batch"], seq=rec["seq"],
                        predicted_ms=ms, measured_ms=meas, min_ms=min(rec["times_ms"]), max_ms=max(rec["times_ms"]),
                        error=(ms - meas) / meas, date=rec["date"], gpu=gpu if isinstance(gpu, str) else gpu["name"],
                        mfu_model_predicted=pred["mfu"]["model"], host_bound=any(
                            s["bound"] == "host" for s in pred["segments"] if s["phase"] != "optimizer")))
    return out


def compare_kernel_records(gpu: str | dict = "h200-measured") -> list[dict]:
    """Predicted vs measured fused-kernel (fwd + bwd) and optimizer-step times in the committed records."""
    prof, out = timing.get(gpu), []
    path = records.KERNELS_BACK_TO_BACK
    if path.exists():
        rec = json.loads(path.read_text())
        cfg = ModelConfig.from_name(rec["preset"])
        for row in rec["rows"]:
            if (row["kernel"], row["impl"]) in (("rms_norm", "ours"), ("swiglu", "ours"), ("rope_qkv", "ours"),
                                                ("linear_ce", "liger")):
                rows, segs, _ = timing.predict(timing.standalone_kernels(row["kernel"], cfg, rec["batch"], rec["seq"]), prof)
                t = max(sum(s["gpu_s"] for s in segs), sum(s["host_s"] for s in segs))  # no sync between calls
                out.append(dict(record=records.rel(path), what=f"{row['kernel']} ({row['impl']})",
                                predicted_ms=t * 1e3, gpu_ms=sum(s["gpu_s"] for s in segs) * 1e3,
                                host_ms=sum(s["host_s"] for s in segs) * 1e3, measured_ms=row["ms"],
                                error=(t * 1e3 - row["ms"]) / row["ms"]))
    path = records.OPTIMIZER_STEPS
    if path.exists():
        for b in json.loads(path.read_text())["benchmarks"]:
            e = b["extra_info"]
            name = "ademamix" if e["impl"].startswith("ademamix") else "adamw"
            k = timing.Kernel(f"optimizer.{name}", "optimizer", "optimizer", "memory", 6, 0,
                       step_bytes_moved(e["n_params"], name) // 6)  # validations/test_optim.py: 6 x 4096² fp32
            t = timing.time_kernel(k, prof)["time_s"]
            out.append(dict(record=records.rel(path), what=f"{e['impl']} step, {e['n_params']:,} fp32 params",
                            predicted_ms=t * 1e3, gpu_ms=t * 1e3, host_ms=None, measured_ms=e["median_s"] * 1e3,
                            error=(t - e["median_s"]) / e["median_s"]))
    return out


def _table(rows: list[dict]) -> str:
    lines = ["| record | config | predicted ms | measured ms (min–max) | error |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['record']} | {r['preset']} {r['variant']} B={r['batch']} S={r['seq']} | "
                     f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} ({r['min_ms']:.1f}–{r['max_ms']:.1f}) | "
                     f"{r['error']:+.1%} |")
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    """python3 -m llm_anatomy.report.steps [GPU...]: predictions against the committed H200 records."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python3 -m llm_anatomy.report.steps", description=main.__doc__)
    ap.add_argument("gpus", nargs="*", default=["h200-measured", "h200-sxm"],
                    help=f"profiles ({', '.join(timing.names())}) or profile .json paths")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        for gpu in a.gpus:
            timing.get(gpu)
    except ConfigError as e:
        print(f"timing: error: {e}", file=sys.stderr)
        return 2
    for gpu in a.gpus:
        print(f"\n### gpu profile: {gpu}\n\nTraining step, forward + backward (bench/step.py):\n")
        print(_table(compare_committed(gpu)))
        print("\nFused kernels (fwd + bwd, bench/kernel_rates.py) and optimizer steps (validations/test_optim.py):\n")
        print("| record | what | predicted ms (GPU / host) | measured ms | error |\n|---|---|---:|---:|---:|")
        for r in compare_kernel_records(gpu):
            host = f"{r['host_ms']:.3f}" if r["host_ms"] is not None else "–"
            print(f"| {r['record']} | {r['what']} | {r['predicted_ms']:.3f} ({r['gpu_ms']:.3f} / {host}) | "
                  f"{r['measured_ms']:.3f} | {r['error']:+.1%} |")
        for preset, batch, variant in (("seed", 16, "efficient"), ("anchor-1b", 4, "efficient"),
                                       ("seed", 16, "baseline")):
            print(f"\n{preset} {variant} B={batch} S=4096 amp, AdEMAMix step included:\n")
            print(timing.breakdown_table(timing.estimate_time(ModelConfig.from_name(preset), Run(batch, 4096), variant, gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# the efficient MoE step against transformers' own model of the config in the same loop (issue 48): at least this
# many times its fastest experts implementation's speed (grouped_mm), at no more of its peak memory
MOE_SPEEDUP, MOE_MEMORY = 2.5, 1.0


def moe_peers_table(paths: list) -> str:
    """bench/step.py --hf-config ... --optimizer adamw records of one run: a row per peer (a training step: forward,
    backward and fused AdamW), each peer's speed as a multiple of transformers' grouped_mm (hf), and the verdict."""
    rows = sorted((json.loads(p.read_text()) for p in paths), key=lambda d: d["median_ms"])
    if not rows:
        return ""
    hf = next((d for d in rows if d["peer"] == "hf"), None)
    out = ["| config | peer | step ms | tokens/s | peak MiB | speed vs transformers grouped_mm |",
           "|---|---|---:|---:|---:|---:|"]
    for d in rows:
        vs = f"{hf['median_ms'] / d['median_ms']:.2f}×" if hf else "-"
        out.append(f"| {d['preset'].rstrip('/').split('/')[-1]} L={d['layers']} B={d['batch']} S={d['seq']} | "
                   f"{d['peer']} | {d['median_ms']:.1f} | {d['tokens_per_s'] / 1e3:,.1f} k | {d['peak_mib']:,.0f} | {vs} |")
    ours = [d for d in rows if d["peer"].startswith("efficient")]
    if hf and ours:
        best = min(ours, key=lambda d: d["median_ms"])
        speed, mem = hf["median_ms"] / best["median_ms"], best["peak_mib"] / hf["peak_mib"]
        ok = speed >= MOE_SPEEDUP and mem <= MOE_MEMORY
        out += ["", f"{best['peer']}: {speed:.2f}× transformers' grouped_mm step at {mem:.0%} of its peak (target: "
                f"≥ {MOE_SPEEDUP}× at ≤ {MOE_MEMORY:.0%}): {'met' if ok else 'not met'}."]
    d = rows[0]
    versions = f"torch {d['torch']}, transformers {hf.get('transformers', '?')}" if hf else f"torch {d['torch']}"
    out += ["", f"Each peer in its own process (`python3 -m bench.step --peer PEER --hf-config ... --optimizer adamw`); "
            f"median of {len(d['times_ms'])} steps after warm-up; fp32 weights under bf16 autocast for every peer; "
            f"{d['gpu']}, {versions}, {d['date']}."]
    return "\n".join(out)
