"""The derived H100 profile against an H100's own calibration and its measured steps (pure Python, no GPU):

    python3 -m scripts.compare_h100

The derived profiles (llm_anatomy/calculator/timing/derived.py) carry the H200's measured kernel fractions to
another GPU through its datasheet. An H100 SXM (80 GB HBM3, 700 W) was calibrated by the GPU suite's fixture on
2026-12-05 (llm_anatomy/calculator/profiles/h100.json, `--gpu h100-measured`) and ran the user's loop (fused
AdamW, bf16 autocast, every row a process of its own) on the GPU suite's real-depth draw sized to its memory
(reports/h100/real-depth-live.json: scripts/user_loop.py) and on the MoE live cases (reports/h100/moe-live.json:
scripts/probe_moe.py step_row). All of it came
after the derivation was committed; nothing in it was changed to fit them. Printed: each kernel class's rate
in the two profiles, and each measured step predicted on the measured profile, the derived one (with its
range) and the datasheet. validations/test_derived_gpus.py checks that docs/derived-gpus.md shows these tables.
"""
from __future__ import annotations

import json
import sys

from llm_anatomy import records
from llm_anatomy.calculator import moe
from llm_anatomy.calculator.timing import estimate_time, get

MEASURED, DERIVED = "h100-measured", "h100-sxm-derived"
DENSE, MOE = records.H100_STEPS["dense"], records.H100_STEPS["moe"]
PROFILES = (MEASURED, DERIVED, f"{DERIVED}-low", f"{DERIVED}-high", "h100-sxm-datasheet")
BF = "bfloat16"
# (what, unit, the figure of a profile)
RATES = (("GEMM rate, bf16 (asymptotic)", "TFLOP/s", lambda p: p.matmul_flops[BF] / 1e12),
         ("best GEMM (MFU's denominator)", "TFLOP/s", lambda p: p.mfu_peak_flops / 1e12),
         ("device copy", "TB/s", lambda p: p.hbm_Bps / 1e12),
         ("cuDNN SDPA fwd+bwd, head dim 128", "TFLOP/s", lambda p: p.attention["cudnn"]["128"]["fwd_bwd"] / 1e12),
         ("cuDNN SDPA fwd+bwd, head dim 64", "TFLOP/s", lambda p: p.attention["cudnn"]["64"]["fwd_bwd"] / 1e12),
         ("GEMM rate sustained / burst", "", lambda p: p.sustained_ratio["matmul"]),
         ("SDPA rate sustained / burst", "", lambda p: p.sustained_ratio["attention"]),
         ("host time per eager op", "µs", lambda p: p.host_op_s * 1e6),
         ("GPU time per tiny kernel", "µs", lambda p: p.launch_s * 1e6))


def rates() -> list[dict]:
    m, d = get(MEASURED), get(DERIVED)
    return [dict(what=w, unit=u, measured=f(m), derived=f(d), ratio=f(d) / f(m)) for w, u, f in RATES]


def steps() -> list[dict]:
    """Each measured H100 step (the wall step of the user's loop), predicted now on every profile of PROFILES."""
    from scripts.probe_moe import cases

    from llm_anatomy.real_depth import predicted

    out = []
    for r in json.loads(DENSE.read_text())["rows"]:
        pred = {g: predicted(r, g)["steady"]["step_s"] * 1e3 for g in PROFILES}
        out.append(dict(case=f"{r['id']}", measured_ms=r["wall"]["step_ms"], **pred))
    cs = cases()
    for r in json.loads(MOE.read_text())["rows"]:
        cfg, run, _ = cs[r["id"]]
        hist = (moe.skewed if r["route"] == "skewed" else moe.balanced)(cfg, run)
        pred = {g: estimate_time(cfg, run, r["variant"], g, optimizer="adamw", with_kernels=False,
                                 hist=hist)["steady"]["step_s"] * 1e3 for g in PROFILES}
        out.append(dict(case=f"{r['id']} {r['variant']} {r['route']} (MoE)", measured_ms=r["wall"]["step_ms"], **pred))
    return out


def table(rate_rows: list[dict], step_rows: list[dict]) -> str:
    lines = ["| kernel class | measured H100 | derived H100 | derived / measured |", "|---|---:|---:|---:|"]
    for r in rate_rows:
        u = f" {r['unit']}" if r["unit"] else ""
        lines.append(f"| {r['what']} | {r['measured']:,.2f}{u} | {r['derived']:,.2f}{u} | {r['ratio']:.3f} |")
    lines += ["", "| measured step (H100) | ms | on h100-measured | on the derived (low-high) | on the datasheet |",
              "|---|---:|---:|---:|---:|"]
    for r in step_rows:
        m = r["measured_ms"]
        lo, hi = sorted((r[DERIVED + "-low"] / m, r[DERIVED + "-high"] / m))
        lines.append(f"| {r['case']} | {m:,.1f} | {r[MEASURED] / m:.3f} | {r[DERIVED] / m:.3f} ({lo:.3f}-{hi:.3f}) "
                     f"| {r['h100-sxm-datasheet'] / m:.3f} |")
    return "\n".join(lines)


def main() -> int:
    print(table(rates(), steps()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
