"""Exploration (not a claim): the lean MLP backward's SwiGLU work, the forward kernel again then the in-place
backward (two passes over gate_up) against the one pass that writes h over d(h) (llm_anatomy/kernels/lean.py),
at the real configs' shapes. python3 -m bench.remake_pass"""

import torch

from llm_anatomy.kernels.swiglu import swiglu_backward_triton, swiglu_triton

from bench.ce_gemm_layouts import timed


for T, I in ((16384, 8192), (16384, 5632), (65536, 1408)):
    gu = torch.randn(T, 2 * I, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)
    two = timed(lambda: (swiglu_triton(g, u), swiglu_backward_triton(dh, g, u, inplace=True)))
    one = timed(lambda: swiglu_backward_triton(dh, g, u, inplace=True, h_out=dh))
    bwd = timed(lambda: swiglu_backward_triton(dh, g, u, inplace=True))
    gb = lambda n: n * T * I * 2 / 1e9  # noqa: E731  (GB of n (T, I) bf16 tensors)
    print(f"T {T} I {I}: two passes {two:.3f} ms ({gb(8) / two:.0f} GB/s), one pass {one:.3f} ms "
          f"({gb(6) / one:.0f} GB/s), backward alone {bwd:.3f} ms ({gb(5) / bwd:.0f} GB/s)", flush=True)
