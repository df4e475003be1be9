"""Exploration (not a claim): cuDNN SDPA forward + backward at the real configs' attention shapes, GQA inside
the kernel, by the memory layout of q, k, v and of the incoming gradient. The efficient model's (rope_qkv):
q laid out (B, S, h, hd) and seen as (B, h, S, hd), k and v contiguous (B, h, S, hd); Hugging Face's: all
three transposed views of (B, S, h, hd); all contiguous; and k, v repeated to the query heads first (repeat_kv,
its copy and its backward's sum included). The gradient of the output is laid out (B, S, h, hd) as the o
projection's backward makes it. Interleaved rounds in one process.
python3 -m bench.sdpa_gqa [--json OUT]"""
import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from llm_anatomy.efficient.attention import backend_context

from bench.ce_gemm_layouts import timed

SHAPES = {"tinyllama-1.1b B8 S2048": (8, 2048, 32, 4, 64), "llama3.2-1b B4 S4096": (4, 4096, 32, 8, 64)}


def tensors(B, S, h, hd, bshd: bool):
    """A (B, h, S, hd) bf16 tensor, laid out (B, S, h, hd) in memory when bshd."""
    if bshd:
        return torch.randn(B, S, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(B, h, S, hd, device="cuda", dtype=torch.bfloat16)


def step(q, k, v, dout, repeat: bool = False, backward: bool = True):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kk, vv, gqa = k, v, q.shape[1] != k.shape[1]
    if repeat:
        r = q.shape[1] // k.shape[1]
        kk, vv, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
    with backend_context(q.device):
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
    if backward:
        out.backward(dout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (B, S, nh, nkv, hd) in SHAPES.items():
        dout = tensors(B, S, nh, hd, True)
        layouts = {"ours: q (B,S,h,hd), k v contiguous": (True, False, False),
                   "HF: q k v (B,S,h,hd) views": (True, True, True),
                   "all contiguous": (False, False, False),
                   "k v (B,S,h,hd), q contiguous": (False, True, True)}
        qkv = {c: (tensors(B, S, nh, hd, lq), tensors(B, S, nkv, hd, lk), tensors(B, S, nkv, hd, lv))
               for c, (lq, lk, lv) in layouts.items()}
        cases = {}
        for c, t in qkv.items():
            cases[c + " fwd+bwd"] = (lambda t=t: step(*t, dout))
            cases[c + " fwd"] = (lambda t=t: step(*t, dout, backward=False))
        cases["HF views, k v repeated fwd+bwd"] = lambda: step(*qkv["HF: q k v (B,S,h,hd) views"], dout, repeat=True)
        times = {c: [] for c in cases}
        for _ in range(10):  # interleaved rounds: each case once per round (timed warms it up first)
            for c, fn in cases.items():
                times[c].append(timed(fn, reps=3))
        for c, t in times.items():
            med = statistics.median(t)
            rows.append({"shape": name, "case": c, "median_ms": med, "min_ms": min(t)})
            print(f"{name}: {c:48s} median {med:.3f} ms per layer (min {min(t):.3f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "gpu": torch.cuda.get_device_name(),
                                            "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
