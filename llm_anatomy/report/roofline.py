"""The measured roofline: every kernel `anatomy calibrate` timed, at its arithmetic intensity and the
throughput it reached, under the roofs measured in the same run (docs/timing.md, README).

Points (one per calibrate row of a profile JSON; time measured, work counted):
  GEMM        2mnk FLOPs over the minimal bf16 bytes (A, B and C once): the in-step grid, the loop
              grid, and the LM head's GEMMs at an aligned and at misaligned vocabs
  attention   causal SDPA per backend, forward and forward + backward (ANCHORS' causal FLOP
              convention: forward 2·B·h·S²·d, fwd+bwd 3.5x), over q, k, v, o (and their gradients)
  memory      our fused kernels, the residual add, Liger's CE kernel and the eager baseline's S x S
              ops: their minimal bytes
              (registry.OPS: op_bytes.fused_bytes) and elementwise FLOPs counted per element as ELEMENTWISE_FLOPS
              says (exp, rsqrt and division count one each)
Roofs: the best bf16 GEMM of the loop grid (the MFU ceiling) and the copy bandwidth, both measured
by the same calibrate run.
"""
from __future__ import annotations

import json
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.calculator.timing.registry import OPS

# FLOPs per element of the op's width-sized rows (the output's elements for swiglu, the logits for CE)
ELEMENTWISE_FLOPS = {
    "rms_norm.forward": 4,  # x², the row sum, x·rstd, ·w
    "rms_norm.backward": 11,  # x², sum, x̂, g = dy·w, g·x̂, sum, g − x̂·m (2), ·rstd, dw += dy·x̂ (2)
    "add_rms_norm.forward": 5,  # x + branch, then the norm's 4
    "add_rms_norm.backward": 12,  # the norm's 11, then + the residual path's gradient (the bf16 copy moves bytes only)
    "swiglu.forward": 5,  # silu(g) = g / (1 + exp(−g)): neg, exp, add, div; ·up
    "swiglu.backward": 11,  # σ again (3), silu, dh·silu, σ(1 + g(1 − σ)) (4), dh·up·dsilu (2)
    "rope_qkv.forward": 3,  # q and k: x·cos + rot(x)·sin (v is copied: counted 3 anyway, an upper bound)
    "rope_qkv.backward": 3,
    "residual_add": 1,
    "liger_ce": 7,  # max pass, exp and sum, then exp, divide, subtract the target's one-hot, scale
    # the eager baseline's S x S chain (ATen): one multiply, one add, casts, softmax (max, sub, exp, sum,
    # div), its backward (g·y, the row sum, subtract, multiply)
    "sxs.scale": 1, "sxs.mask_add": 1, "sxs.float": 1, "sxs.to_compute": 1, "sxs.softmax": 5,
    "sxs.softmax.backward": 4, "sxs.sink_cat": 1, "sxs.sink_slice_cast": 1, "sxs.sink_slice_backward": 1,  # copies
    # the baseline's eager chains, per element of their (rows, width): the norm as ours; log_softmax (max, sub,
    # exp, sum, log) and its backward (exp, subtract the one-hot, scale); silu and the product, their backward;
    # gpt-oss's clamps (two, and the +1) and their masks, logical_and and where
    "eager_norm.forward": 4, "eager_norm.backward": 11, "eager_ce.forward": 5, "eager_ce.backward": 3,
    "eager_mlp.forward": 5, "eager_mlp.backward": 8, "eager_clamp.forward": 3, "eager_clamp.backward": 6,
    # RoPE on q or k: x·cos, −x2, ·sin, the add (the cat moves bytes only); its backward the same
    "eager_rope.forward": 3, "eager_rope.backward": 3,
    # torch's fused AdamW per parameter element: both moments (7), the denominator (2), the update (3), decay (2)
    "optimizer.adamw": 14,
    # the compiled AdEMAMix step (optim/efficient.py): m1 (3), m2 (3), nu (4), the denominator (3), the update from
    # both moments (4), decay (2), lr (1), the subtraction (1)
    "optimizer.ademamix": 21,
    # ATen's embedding backward: one add per gradient element into its id's row (the zero fill is counted in bytes)
    "embedding.backward": 1,
}


def points(profile: dict) -> list[dict]:
    """{kind, label, flops, bytes, seconds} for every kernel a calibrate profile JSON measured."""
    m, out = profile["measurements"], []

    def gemm(kind, r, ms):
        M, N, K = r["m"], r["n"], r["k"]
        out.append(dict(kind=kind, label=f"{M}x{N}x{K}", flops=2 * M * N * K, bytes=2 * (M * K + K * N + M * N),
                        seconds=ms * 1e-3))

    for r in m.get("matmul_bf16_in_step", []):
        gemm("GEMM, in step", r, r["ms"])
    for r in m.get("matmul_bf16", []):
        gemm("GEMM, loop", r, r["ms"])
    for r in m.get("matmul_vocab", []):
        T, H, V = r["rows"], r["hidden"], r["vocab"]
        aligned = V % 8 == 0
        out.append(dict(kind=f"LM head GEMM, vocab {'aligned' if aligned else 'not a multiple of 8'}",
                        label=f"{r['op']} {T}x{H}x{V}", flops=2 * T * H * V,
                        # addmm into the fp32 accumulator reads and writes it (8 B per element), no bf16 output
                        bytes=2 * (T * H + T * V) + (8 if r["op"] == "grad_weight_acc" else 2) * V * H,
                        seconds=r["ms"] * 1e-3))
    for r in m.get("attention", []):
        B, h, S, d = r["B"], r["heads"], r["S"], r["hd"]
        f, io = 2 * B * h * S * S * d, B * h * S * d * 2
        out.append(dict(kind=f"attention ({r['backend']})", label=f"fwd B{B} h{h} S{S} d{d}", flops=f,
                        bytes=4 * io + 4 * B * h * S, seconds=r["fwd_ms"] * 1e-3))
        out.append(dict(kind=f"attention ({r['backend']})", label=f"fwd+bwd B{B} h{h} S{S} d{d}", flops=3.5 * f,
                        bytes=12 * io + 8 * B * h * S, seconds=r["fwd_bwd_ms"] * 1e-3))
    for r in m.get("fused", []):
        op, T, W = r["op"], r["tokens"], r["width"]
        reg = next((o for o in OPS.values() if o.rows == op), None)
        if reg is None:  # a row of an op the timing model does not read
            continue
        nbytes = reg.call_bytes(W, T)
        nbytes += r["vocab"] * W * 4 if op == "embedding.backward" else 0  # its (V, W) fp32 zero fill
        out.append(dict(kind="Liger CE kernel" if op == "liger_ce" else
                        "residual add (ATen)" if op == "residual_add" else
                        "baseline S x S chain (ATen)" if op.startswith("sxs.") else
                        "baseline eager chains (ATen)" if op.startswith("eager_") else
                        "fused AdamW (torch)" if op.startswith("optimizer.") else
                        "embedding backward (ATen)" if op == "embedding.backward" else "our fused kernels",
                        label=f"{op} {T}x{W}", flops=ELEMENTWISE_FLOPS[op] * T * W, bytes=nbytes,
                        seconds=r["ms"] * 1e-3))
    return out


def roofs(profile: dict) -> tuple[float, float]:
    """(peak FLOP/s, bandwidth B/s): the loop grid's best GEMM and the copy, from the same run."""
    m = profile["measurements"]
    return max(r["tflops"] for r in m["matmul_bf16"]) * 1e12, m["copy_tbps"] * 1e12


def of_roof(p: dict, peak: float, bw: float) -> float:
    """Achieved FLOP/s over the roof at the point's intensity, min(peak, bw · FLOP/B)."""
    return p["flops"] / p["seconds"] / min(peak, bw * p["flops"] / p["bytes"])


def summary(profile_path: Path) -> str:
    prof = json.loads(Path(profile_path).read_text())
    pts, (peak, bw) = points(prof), roofs(prof)
    kinds: dict[str, list[float]] = {}
    for p in pts:
        kinds.setdefault(p["kind"], []).append(of_roof(p, peak, bw))
    pv = prof["provenance"]
    rows = [f"| {k} | {len(v)} | {min(v):.0%} | {sorted(v)[len(v) // 2]:.0%} | {max(v):.0%} |" for k, v in kinds.items()]
    return "\n".join(["| kernels | n | worst of roof | median | best |", "|---|---:|---:|---:|---:|", *rows, "",
                      f"Roofs measured in the same run: bf16 GEMM {peak / 1e12:.0f} TFLOP/s (the loop grid's best), "
                      f"copy {bw / 1e12:.2f} TB/s. Source: {pv['gpu']}, torch {pv['torch']}, CUDA {pv['cuda']}, "
                      f"{pv['date']}: `{records.command(pv['command'])}` (`{records.rel(profile_path)}`)."])


def plot(profile_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prof = json.loads(Path(profile_path).read_text())
    pts, (peak, bw) = points(prof), roofs(prof)
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p["flops"] / p["bytes"] for p in pts]
    lo, hi = min(xs) / 2, max(xs) * 2
    ridge = peak / bw
    ax.plot([lo, ridge, hi], [bw * lo / 1e12, peak / 1e12, peak / 1e12], "k-", lw=1.2,
            label=f"roof: copy {bw / 1e12:.2f} TB/s, GEMM {peak / 1e12:.0f} TFLOP/s")
    markers = iter("o^sDv<>phx*+PXd8H1")
    for kind in dict.fromkeys(p["kind"] for p in pts):
        mine = [p for p in pts if p["kind"] == kind]
        ax.scatter([p["flops"] / p["bytes"] for p in mine], [p["flops"] / p["seconds"] / 1e12 for p in mine],
                   s=14, marker=next(markers), label=f"{kind} ({len(mine)})", alpha=0.75)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of minimal HBM traffic)")
    ax.set_ylabel("achieved TFLOP/s")
    pv = prof["provenance"]
    ax.set_title(f"{pv['gpu']}: every kernel `anatomy calibrate` timed ({pv['date'][:10]})", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)
