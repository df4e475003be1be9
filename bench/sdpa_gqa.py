"""Exploration (not a claim): cuDNN SDPA forward + backward at the real configs' attention shapes, GQA inside
the kernel (the efficient model: enable_gqa on (B, h, S, hd) contiguous q, k, v) against k and v repeated to
the query heads first (Hugging Face's repeat_kv, its copy and its backward's sum included), and against q, k,
v as transposed views of (B, S, h, hd). Interleaved rounds in one process.
PYTHONPATH=. python3 bench/sdpa_gqa.py"""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from anatomy.efficient.attention import backend_context

sys.path.insert(0, str(Path(__file__).parent))
from ce_gemm_layouts import timed  # noqa: E402

SHAPES = {"tinyllama-1.1b B8 S2048": (8, 2048, 32, 4, 64), "llama3.2-1b B4 S4096": (4, 4096, 32, 8, 64)}


def step(q, k, v, dout, how):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kk, vv, gqa = k, v, q.shape[1] != k.shape[1]
    if how == "repeat":
        r = q.shape[1] // k.shape[1]
        kk, vv, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
    with backend_context(q.device):
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
    out.backward(dout)


def main():
    torch.manual_seed(0)
    for name, (B, S, nh, nkv, hd) in SHAPES.items():
        mk = lambda h: torch.randn(B, h, S, hd, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = mk(nh), mk(nkv), mk(nkv), mk(nh)
        views = [torch.randn(B, S, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (nh, nkv, nkv)]
        cases = {"gqa in the kernel (ours)": lambda: step(q, k, v, dout, "gqa"),
                 "k, v repeated (HF's repeat_kv)": lambda: step(q, k, v, dout, "repeat"),
                 "gqa, q k v transposed views": lambda: step(*views, dout, "gqa")}
        times = {c: [] for c in cases}
        for _ in range(10):  # interleaved rounds: each case once per round (timed warms it up first)
            for c, fn in cases.items():
                times[c].append(timed(fn, reps=1))
        for c, t in times.items():
            print(f"{name}: {c:34s} median {statistics.median(t):.3f} ms per layer (min {min(t):.3f})", flush=True)


if __name__ == "__main__":
    main()
