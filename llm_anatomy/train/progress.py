"""What the training loop shows: loss, tokens/s, MFU, memory; a live rich bar on a terminal, plain
lines otherwise (CI logs, pipes), nothing on ranks other than 0.

MFU = model FLOPs per step (the calculator's *model* convention: causal attention halved,
recompute not counted, forward + backward) / step time / the device's peak FLOP/s. The peaks
are dense (no 2:4 sparsity) datasheet figures for the matmul dtype of the run's policy: bf16
tensor cores for amp and bf16; plain fp32 (CUDA cores, TF32 off, torch's default) for fp32.
They are the marketing ceilings, not the measured ones (DESIGN.md: 781 TFLOP/s measured bf16 on
an H200, against 989 here), so MFU reads low by that ratio compared with a measured ceiling.
"""
from __future__ import annotations

import os
import sys

import torch

def peak_flops(device: torch.device, dtype_policy: str) -> float | None:
    """Peak FLOP/s of this device for the policy's matmul dtype, from the calculator's datasheet table
    (llm_anatomy.calculator.gpus), or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    from llm_anatomy.calculator import gpus

    prof = gpus.for_device_name(torch.cuda.get_device_name(device))
    return None if prof is None else prof["peak_flops"]["float32" if dtype_policy == "fp32" else "bfloat16"]


def memory_str(device: torch.device) -> str:
    """Peak allocated on CUDA; the process's resident set on CPU (GiB = 2**30 B)."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak"
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"{rss / 2**30:.2f} GiB RSS"


def _si(x: float) -> str:
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= f:
            return f"{x / f:.1f}{unit}"
    return f"{x:.0f}"


def stats_line(loss: float, lr: float, tok_s: float, mfu: float | None, mem: str) -> str:
    m = "n/a" if mfu is None else f"{mfu:.1%}"
    return f"loss {loss:.4f}  lr {lr:.2e}  {_si(tok_s)} tok/s  MFU {m}  {mem}"


class Display:
    """mode: 'bar' (rich live bar), 'lines' (a line every log_every steps), 'none'; 'auto' picks
    bar on a terminal and lines otherwise. Only rank 0 shows anything."""

    def __init__(self, mode: str, total: int, start: int, log_every: int, rank: int = 0):
        self.total, self.log_every, self._bar, self._console = total, max(1, log_every), None, None
        if rank != 0:
            mode = "none"
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        if mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._console = Console()
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=self._console)
            self._task = self._bar.add_task("train", total=total, completed=start, stats="")
            self._bar.start()

    def print(self, text: str) -> None:
        if self.mode == "bar":  # above the live bar while it runs
            self._console.print(text, highlight=False, markup=False)
        elif self.mode == "lines":
            print(text, flush=True)

    def step(self, step: int, stats: str) -> None:
        if self.mode == "bar":
            self._bar.update(self._task, completed=step, stats=stats)
        elif self.mode == "lines" and (step % self.log_every == 0 or step == self.total):
            print(f"step {step}/{self.total}  {stats}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
