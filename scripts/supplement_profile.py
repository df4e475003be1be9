"""Give a packaged profile the rows of the kernel classes it never measured, from a later calibration of the same
GPU and versions (pure Python, no GPU):

    python3 -m scripts.supplement_profile CALIBRATION.json [--into llm_anatomy/calculator/profiles/h200.json]

CALIBRATION.json is `anatomy calibrate --out`'s profile, or the GPU suite's cache file (validations/
profile_cache.py: {"key", "profile"}). Only the classes a dense Llama-family step never reads are taken (ROWS:
the grouped GEMMs of the MoE block, cuDNN's SDPA under an additive mask, the baseline sinks' S x S ops), so every
dense prediction on the packaged profile stays what it was, and only where the packaged profile has none of that
class: a supplement adds, never replaces. The rows keep their own calibration's provenance
(provenance.supplements: GPU, date, host, command, versions and the rows taken); the versions must match the
packaged profile's. What it carries: the two calibrations' machines differ (the grouped GEMM's efficiency is the
later machine's grouped time over the packaged machine's dense rate), by up to the same-generation spread of
derived.SPREAD["same"].
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_anatomy.calculator.timing import get

INTO = Path("llm_anatomy/calculator/profiles/h200.json")
ROWS = ("grouped_mm", "attention_masked")  # measurement lists read only by MoE blocks and masked attention
FUSED_PREFIX = "sxs.sink_"  # the eager baseline's sinks ops, in measurements.fused
VERSIONS = ("gpu", "torch", "cuda", "triton", "cudnn")
FIXTURE = "anatomy calibrate (the GPU suite's gpu_profile fixture: validations/profile_cache.py)"


def supplement(packaged: dict, calibration: dict) -> tuple[dict, list[str]]:
    """(the packaged profile with the calibration's missing rows, what was taken). ValueError on a version
    mismatch or when there is nothing to take."""
    cal = calibration.get("profile", calibration) if isinstance(calibration, dict) else None
    if not (isinstance(cal, dict) and isinstance(cal.get("measurements"), dict) and isinstance(packaged, dict)):
        raise ValueError("not a calibration: a profile object with measurements (or the suite's cache file) is needed")
    prov, cprov = packaged["provenance"], cal["provenance"]
    off = [f"{k} {prov.get(k)!r} vs {cprov.get(k)!r}" for k in VERSIONS if prov.get(k) != cprov.get(k)]
    if off:
        raise ValueError(f"not the packaged profile's GPU and versions: {'; '.join(off)}")
    out, taken = json.loads(json.dumps(packaged)), []
    m, cm = out["measurements"], cal["measurements"]
    for key in ROWS:
        if not m.get(key) and cm.get(key):
            m[key] = cm[key]
            taken.append(f"{key} ({len(cm[key])} rows)")
    have = {r["op"] for r in m.get("fused", ())}
    new = [r for r in cm.get("fused", ()) if r["op"].startswith(FUSED_PREFIX) and r["op"] not in have]
    if new:
        m["fused"] = list(m.get("fused", ())) + new
        taken.append(f"fused {', '.join(sorted({r['op'] for r in new}))} ({len(new)} rows)")
    if not taken:
        raise ValueError("the packaged profile already has every supplementable class, or the calibration has none")
    keep = {k: cprov.get(k) for k in ("gpu", "date", "host", "command", "torch", "cuda", "triton", "cudnn")}
    if "key" in calibration:  # the suite's cache file: its command names a temporary folder of that machine
        keep["command"] = FIXTURE
    out["provenance"]["supplements"] = list(prov.get("supplements", ())) + [dict(keep, rows=taken)]
    return out, taken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.supplement_profile", description=__doc__.splitlines()[0])
    ap.add_argument("calibration", type=Path)
    ap.add_argument("--into", type=Path, default=INTO)
    a = ap.parse_args(argv)
    try:
        packaged, cal = json.loads(a.into.read_text()), json.loads(a.calibration.read_text())
        out, taken = supplement(packaged, cal)
        get(out)  # the merged profile passes the profile check and fits before it is written
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"supplement_profile: error: {e}", file=sys.stderr)
        return 2
    a.into.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{a.into}: took {'; '.join(taken)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
