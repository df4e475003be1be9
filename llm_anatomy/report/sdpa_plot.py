"""cuDNN's main SDPA kernel, predicted against measured, for the README and docs/timing.md: the CTA schedule
(calculator/timing/sdpa_schedule.py) on calibrate's own grids, at the GPU suite's unseen shapes, and at every
efficient row the probes profiled in the same run, beside the full-wave rate it replaced."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.calculator.timing import lookup, roofline, sdpa_schedule

PHASE_OF = {"fprop": "forward", "bprop": "backward"}


def in_step() -> list[dict]:
    """{B, heads, S, hd, phase, us}: the main cuDNN kernel per layer (its profiled time in the row's
    attention component over the layers), for every efficient row of the timing probe (llm_anatomy.records)."""
    out = []
    for f in records.TIMING_PROBE.values():
        for r in json.loads(f.read_text())["rows"]:
            if r.get("variant") != "efficient" or "kernels" not in r:
                continue
            c = r["cfg"]
            for ph in ("forward", "backward"):
                top = r["kernels"]["components"][ph].get("attention", {}).get("top", {})
                for name, ms in top.items():
                    kind = next((k for k in PHASE_OF if "sdpa" in name and k in name), None)
                    if kind and PHASE_OF[kind] == ph:
                        out.append(dict(B=r["batch"], heads=c["heads"], S=r["seq"], hd=c["hidden"] // c["heads"],
                                        phase=ph, us=ms * 1e3 / c["layers"]))
    return out


def predict_us(prof: dict, p: dict, schedule: bool = True) -> float:
    """The schedule's time of one launch, or (schedule=False) the full-wave rate's compute term, the model for
    a profile without a schedule (its rate folds in the small kernels around the main one)."""
    B, h, S, hd, ph = p["B"], p["heads"], p["S"], p["hd"], p["phase"]
    if schedule:
        sched, _ = sdpa_schedule.lookup(prof, "cudnn", hd)
        return sdpa_schedule.kernel_s(sched[ph], B, h, S, prof["sms"], ph) * 1e6
    rate, _ = roofline.sdpa_rate(prof, "cudnn", hd, ph, S)
    flops = roofline.causal_attention_flops(B, h, S, hd) * (1 if ph == "forward" else 2.5)
    return flops / (rate * roofline.attention_wave_efficiency(B, h, S, prof["sms"])) * 1e6


def sets() -> dict[str, list[tuple[float, float]]]:
    """{label: [(measured us, predicted us)]}."""
    raw = json.loads(records.TIMING_PROBE_PROFILE.read_text())
    prof = lookup.get(raw)
    cal = [(r[f"{k}_kernel_ms"] * 1e3, predict_us(prof, dict(r, phase=ph)))
           for r in raw["measurements"].get("attention_kernels", []) for k, ph in (("fwd", "forward"), ("bwd", "backward"))]
    claims = records.GPU_CLAIMS
    unseen = [(r["measured"] * 1e3, r["predicted"] * 1e3) for r in json.loads(claims.read_text())["rows"]
              if r["claim"].startswith("time.sdpa_kernel")] if claims.exists() else []
    steps = in_step()
    return {"calibrate's grids (fitted)": cal, "GPU suite, shapes calibrate never ran": unseen,
            "in the probes' steps, CTA schedule": [(p["us"], predict_us(prof, p)) for p in steps],
            "in the probes' steps, full-wave rate (no schedule)": [(p["us"], predict_us(prof, p, False)) for p in steps]}


def summary() -> str:
    rows = []
    for label, pts in sets().items():
        if pts:
            e = [abs(p / m - 1) for m, p in pts]
            rows.append(f"| {label} | {len(pts)} | {sum(x <= 0.15 for x in e)} | {statistics.mean(e):.1%} | {max(e):.1%} |")
    pv = json.loads(records.TIMING_PROBE_PROFILE.read_text())["provenance"]
    return "\n".join(["| cuDNN main SDPA kernel | n | within ±15% | MAPE | worst |", "|---|---:|---:|---:|---:|", *rows, "",
                      f"Source: {pv['gpu']}, torch {pv['torch']}, CUDA {pv['cuda']}, cuDNN {pv.get('cudnn')}, "
                      f"{pv['date']}: `{records.command(pv['command'])}` and the timing probes of the same run "
                      "(`reports/h200/timing-probe/`); the GPU suite's shapes from its own run (`reports/h200/claims-gpu.json`, dated in the claims table above)."])


def plot(png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llm_anatomy.report.plots import _save

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, pts), (m, col) in zip(sets().items(), (("s", "k"), ("D", "#d62728"), ("o", "#1f77b4"),
                                                              ("x", "#bbbbbb"))):
        if pts:
            ax.scatter([x for x, _ in pts], [p / x for x, p in pts], s=14, marker=m, color=col, alpha=0.8,
                       label=f"{label} ({len(pts)})")
    ax.axhspan(0.85, 1.15, color="#2ca02c", alpha=0.12, label="±15%")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured kernel time (µs, profiler)")
    ax.set_ylabel("predicted / measured")
    ax.set_title("cuDNN SDPA main kernel, forward and backward", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _save(fig, png)
    plt.close(fig)
