"""CUDA memory of a training step, phase by phase, as torch.cuda.memory_allocated reports it.

Pure Python. The caching allocator hands out blocks rounded up to 512 bytes, so every tensor is
rounded before it is summed. Modelled so far (checked against the H200 probe in
reports/h200/session1/probe_memory.json by validations/test_memory_model.py):
  - init: parameters + the (B, S) int64 ids and targets;
  - forward end: + every saved tensor (the saved-tensor list of the calculator) + the loss scalar;
  - forward peak, baseline: + what lives only while the loss is computed: the final norm's output
    (held by the caller), the bf16 logits and their fp32 copy, and the (S, S) causal bias.
  - optimizer state (AdamW / AdEMAMix), added to every phase after the first step.
Not modelled yet: the efficient variant's forward peak (Liger's chunk buffers and the weight cast
inside the fused loss) and the backward peak of either variant (it needs an op-by-op walk of the
backward's gradient buffers); they are reported as None rather than guessed.
"""
from __future__ import annotations

from math import prod

from anatomy.calculator import estimate
from anatomy.calculator.dtypes import dtypes
from anatomy.calculator.optimizer import state_breakdown
from anatomy.calculator.types import BYTES
from anatomy.config import ModelConfig, Run

BLOCK = 512  # the CUDA caching allocator's rounding (kMinBlockSize)


def rounded(nbytes: int) -> int:
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK) if nbytes else 0


def param_tensors(cfg: ModelConfig, variant: str = "baseline") -> list[int]:
    """Element count of every parameter tensor, in module order (a tied head counted once)."""
    H, I, kv, L = cfg.hidden, cfg.intermediate, cfg.kv_dim, cfg.layers
    if variant == "efficient":
        layer = [H, (H + 2 * kv) * H, H * H, H, 2 * I * H, H * I]
    else:
        layer = [H, H * H, kv * H, kv * H, H * H, H, I * H, I * H, H * I]
    return [cfg.vocab * H] + layer * L + [H] + ([] if cfg.tie_embeddings else [cfg.vocab * H])


def phases(cfg: ModelConfig, run: Run, variant: str = "baseline", optimizer: str | None = None,
           device: str = "cuda") -> dict:
    dt = dtypes(run)
    tensors = param_tensors(cfg, variant)
    params = sum(rounded(n * BYTES[dt.param]) for n in tensors)
    inputs = 2 * rounded(8 * run.tokens)
    opt = 0
    if optimizer:
        per = state_breakdown(optimizer)
        opt = sum(rounded(n * b) for n in tensors for b in per.values())
        opt += len(tensors) * BLOCK if optimizer == "adamw" else 0  # torch's 0-dim fp32 `step` per tensor
    est = estimate(cfg, run, variant, device=device)
    saved = sum(rounded(prod(s.shape) * BYTES[s.dtype]) * s.count for c in est.components.values() for s in c.saved)
    fwd_end = params + inputs + opt + saved + BLOCK  # + the loss scalar
    fwd_peak = None
    if variant == "baseline":
        T, V, S, c = run.tokens, cfg.vocab, run.seq, dt.compute
        logits = rounded(T * V * BYTES[c]) + (rounded(T * V * 4) if c != "float32" else 0)
        fwd_peak = (fwd_end - BLOCK + rounded(T * cfg.hidden * BYTES[dt.residual]) + logits
                    + rounded(S * S * BYTES[c]))
    return dict(params=params, inputs=inputs, optimizer=opt, saved=saved, init=params + inputs,
                forward_end=fwd_end, forward_peak=fwd_peak, backward_peak=None)
