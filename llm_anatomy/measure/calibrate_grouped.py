"""Calibrate's grouped GEMMs: torch._grouped_mm as the efficient MoE block runs it (llm_anatomy/efficient/moe.py).

A mixture of experts' expert GEMMs are one grouped kernel per projection: the rows sorted by expert, each
expert's (n, k) weight, `offs` the row ends. The kernel schedules every expert's tiles over the SMs at once, so
its time follows the total rows, not how they split (calculator/timing/kernels_moe.py prices it as one dense
GEMM over the tile-rounded rows); its own rate, below the dense GEMM's, is what these rows measure. Each row
times one projection of a real family's expert shape at GROUPED_TOKENS tokens, on the GPU alone behind a sleep
kernel (calibrate_kernels.queued_ms): "forward", the grouped GEMM; "backward", autograd's d(x) and d(W) of it
(its forward run untimed before each repeat). The rows record shapes and milliseconds only;
calculator/timing/fit.py turns them into the grouped kernel's fraction of the dense rate."""
from __future__ import annotations

import time

from llm_anatomy.measure.calibrate_kernels import queued_ms

GROUPED_TOKENS = 8192
# (family, experts, experts per token, hidden, expert intermediate, routing): Qwen3-30B-A3B, Mixtral-8x7B, OLMoE,
# gpt-oss-20b's expert shapes; balanced routing (T·k/E rows each), and Qwen3's skewed (every row on k experts)
GROUPED_FAMILIES = (("qwen3-moe", 128, 8, 2048, 768, "balanced"), ("mixtral", 8, 2, 4096, 14336, "balanced"),
                    ("olmoe", 64, 8, 2048, 1024, "balanced"), ("gpt-oss", 32, 4, 2880, 2880, "balanced"),
                    ("qwen3-moe", 128, 8, 2048, 768, "skewed"))


def grouped_grid(tokens: int = GROUPED_TOKENS) -> list[dict]:
    """Every projection of GROUPED_FAMILIES: {family, routing, rows (per expert), n, k} with x (N, k) and weights
    (E, n, k): gate_up (2I, H) and down (H, I)."""
    out = []
    for family, E, K, H, I, routing in GROUPED_FAMILIES:
        N = tokens * K
        rows = [N // E + (e < N % E) for e in range(E)] if routing == "balanced" else [tokens] * K + [0] * (E - K)
        for proj, n, k in (("gate_up", 2 * I, H), ("down", H, I)):
            out.append(dict(family=family, routing=routing, proj=proj, rows=rows, n=n, k=k))
    return out


def measure_grouped(deadline: float, grid: list[dict] | None = None) -> list[dict]:
    """{family, routing, proj, rows, n, k, role, ms, queued} per projection and role ("forward", "backward")."""
    import torch

    out = []
    for g in grid if grid is not None else grouped_grid():
        if time.monotonic() > deadline:
            break
        E, N, n, k = len(g["rows"]), sum(g["rows"]), g["n"], g["k"]
        bf = dict(device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(g["rows"], device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(N, k, **bf, requires_grad=True)
        w = torch.randn(E, n, k, **bf, requires_grad=True)
        dy = torch.randn(N, n, **bf)
        src = torch.randn(N, k, **bf)
        graph = [None]

        def forward():
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

        def produce():  # the producer kernel that writes x, as the permute's gather does in a step
            with torch.no_grad():
                x.copy_(src)

        def pre_backward():
            produce()
            graph[0] = forward()

        def backward():
            torch.autograd.grad(graph[0], (x, w), dy)

        with torch.no_grad():
            fwd_ms, fwd_q = queued_ms(forward, produce)
        bwd_ms, bwd_q = queued_ms(backward, pre_backward)
        for role, ms, queued in (("forward", fwd_ms, fwd_q), ("backward", bwd_ms, bwd_q)):
            out.append(dict(g, role=role, ms=ms, queued=queued))
        del x, w, dy, src, graph
        torch.cuda.empty_cache()
    return out
