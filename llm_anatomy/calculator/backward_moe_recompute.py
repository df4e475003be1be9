"""The efficient MoE block's backward under recompute (llm_anatomy/efficient/moe.py inside efficient/mlp.py's
recomputed_tail, "mlp", or efficient/transformer.py's BlockCheckpoint, "full"): before backward_moe.layer's stages,
the checkpoint re-runs its region, read off op-by-op traces of the live storages on CPU.

The first node of the branch's backward that asks for a saved tensor (the shared experts' down, else the
unpermute) runs the region's forward again: under "full" the attention half first (backward_efficient's
rerun_attention), then the residual sum, the norm and the whole MoE block. By the checkpoint's early stop it halts
when the last tensor the forward saved is saved again, so every tensor the block keeps without recompute is live
again (one layer's, as an activation) with the sum the norm keeps; backward_moe.layer then frees them as without
recompute. At that stop the forward's locals still live: the fp32 router logits (T, E), the sorted slot order
(N,) int64 and, where the shared experts follow, the unpermute's output (T, H) in c.
"""
from __future__ import annotations

from dataclasses import replace

from llm_anatomy.calculator.types import Saved


def rerun(w, tag: str) -> None:
    """The checkpoint's re-run, at the start of the MoE branch's backward (module docstring)."""
    from llm_anatomy.calculator.backward_efficient import rerun_attention
    from llm_anatomy.calculator.moe_efficient import saved_list

    cfg, run = w.cfg, w.run
    if w.recompute == "full":
        rerun_attention(w, tag)

    def remade() -> list[Saved]:
        kept = saved_list(cfg, replace(run, recompute="none", lean=False), w.est.device)
        return [Saved("mlp.x", (run.batch, run.seq, cfg.hidden), w.dt.residual, 1, "the norm keeps the sum"),
                *(s for s in kept if s.name != "moe.balance.f")]  # the loss's, once per model: not re-made
    w.remake("moe", remade)
    w.peak(tag + "recompute moe", *transients(w), kind="activation")


def transients(w) -> tuple[int, ...]:
    """The region's locals live when the re-run stops (module docstring), in bytes."""
    cfg, T = w.cfg, w.T
    out = (T * cfg.experts * 4, T * cfg.experts_per_token * 8)
    return out + ((T * w.H * w.c,) if cfg.shared_experts else ())
