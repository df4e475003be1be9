"""Claims reports -> two pictures for the README: predicted against measured, and the error
distribution of every bounded (non-exact) claim over the configs it was checked on."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from llm_anatomy.io import write_atomic

FAMILY_COLOURS = {"memory": "#1f77b4", "flops": "#2ca02c", "params / state": "#9467bd", "time": "#d62728",
                  "comm": "#ff7f0e", "training": "#8c564b"}


def family(claim: str) -> str:
    c = claim.lower()
    if c.startswith(("memory", "saved")) or "saved" in c:
        return "memory"
    if "flops" in c:
        return "flops"
    if c.startswith(("params", "optimizer state", "per-rank")):
        return "params / state"
    if "time" in c:
        return "time"
    if "collective" in c:
        return "comm"
    return "training"


def _rows(reports: list[dict], label) -> list[dict]:
    return [dict(r, source=label(rep)) for rep in reports for r in rep["rows"]]


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes, rendered in memory: flat colours, so a 256-colour palette (a tenth of the bytes)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    buf.seek(0)
    out = io.BytesIO()
    with Image.open(buf) as im:
        im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(out, format="png", optimize=True)
    return out.getvalue()


def _save(fig, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(png, png_bytes(fig))
    return png


def predicted_vs_measured(reports: list[dict], png: Path, label=lambda rep: "") -> Path:
    """Log-log scatter of every claim row with positive figures: exact claims small, bounded ones
    large, failed ones as a red x. The diagonal is a perfect prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(reports, label) if r["measured"] and r["predicted"] and r["measured"] > 0
            and r["predicted"] > 0]
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    for fam, colour in FAMILY_COLOURS.items():
        for exact in (True, False):
            pts = [r for r in rows if family(r["claim"]) == fam and (r["tolerance"] == 0) == exact and r["passed"]]
            if pts:
                ax.scatter([r["measured"] for r in pts], [r["predicted"] for r in pts], s=6 if exact else 22,
                           c=colour, alpha=0.5 if exact else 0.85, linewidths=0,
                           label=f"{fam} ({'exact' if exact else 'bounded'}, {len(pts)})")
    bad = [r for r in rows if not r["passed"]]
    if bad:
        ax.scatter([r["measured"] for r in bad], [r["predicted"] for r in bad], marker="x", s=40, c="red",
                   label=f"outside its tolerance ({len(bad)})")
    lo = min(min(r["measured"], r["predicted"]) for r in rows)
    hi = max(max(r["measured"], r["predicted"]) for r in rows)
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (bytes, FLOPs, counts, ms, ...)")
    ax.set_ylabel("predicted by the calculator")
    ax.set_title(f"{len(rows):,} claim checks: predicted against measured", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    fig.tight_layout()
    out = _save(fig, png)
    plt.close(fig)
    return out


def error_distribution(reports: list[dict], png: Path, label=lambda rep: "") -> Path:
    """Signed relative error of every bounded claim, one row per (claim, device), each check a dot
    (jittered), with its tolerance band shaded."""
    import random

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list] = defaultdict(list)
    for r in _rows(reports, label):
        if r["tolerance"] > 0 and r["error"] is not None:  # None: no relative figure (a zero measurement, an OOM)
            groups[(r["claim"], r["device"], r["tolerance"])].append(r)
    keys = sorted(groups, key=lambda k: (family(k[0]), k[0], k[1]))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(keys) + 1.4))
    rnd = random.Random(0)  # jitter only: the same picture every time
    for i, key in enumerate(keys):
        tol = key[2]
        ax.fill_between([-100 * tol, 100 * tol], i - 0.4, i + 0.4, color="#e8e8e8", lw=0)
        rows = groups[key]
        ys = [i + rnd.uniform(-0.25, 0.25) for _ in rows]
        ax.scatter([100 * r["error"] for r in rows], ys, s=10, linewidths=0,
                   c=["#d62728" if not r["passed"] else FAMILY_COLOURS.get(family(r["claim"]), "#7f7f7f")
                      for r in rows])
    ax.axvline(0, color="black", lw=0.6)
    short = lambda t: t if len(t) <= 58 else t[:55] + "..."  # noqa: E731
    ax.set_yticks(range(len(keys)), [f"{short(k[0])} [{k[1]}] (n={len(groups[k])})" for k in keys], fontsize=7)
    ax.set_xscale("symlog", linthresh=1)
    worst = max([abs(100 * r["error"]) for k in keys for r in groups[k]] + [100 * k[2] for k in keys] + [1])
    ticks = [t for t in (1, 3, 10, 30, 100, 300) if t <= worst * 1.5]
    ax.set_xticks([-t for t in reversed(ticks)] + [0] + ticks,
                  [f"−{t}" for t in reversed(ticks)] + ["0"] + [f"+{t}" for t in ticks])
    ax.set_xlim(-worst * 1.3, worst * 1.3)
    ax.set_xlabel("error = (predicted − measured) / measured, %  (symlog; grey band: the claim's tolerance; "
                  "red: outside it)", fontsize=8)
    ax.set_title("bounded claims: error over every config checked", fontsize=10)
    fig.tight_layout()
    out = _save(fig, png)
    plt.close(fig)
    return out
