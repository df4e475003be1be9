"""The efficient MoE block's backward under recompute (llm_anatomy/efficient/moe.py inside efficient/mlp.py's
recomputed_tail, "mlp", or efficient/transformer.py's BlockCheckpoint, "full"): before backward_moe.layer's stages,
the checkpoint re-runs its region, read off op-by-op traces of the live storages on CPU.

The first node of the branch's backward that asks for a saved tensor (the shared experts' down, else the
unpermute) runs the region's forward again: under "full" the attention half first (backward_efficient's
rerun_attention), then the residual sum, the norm and the whole MoE block. By the checkpoint's early stop it halts
when the last tensor the forward saved is saved again, so every tensor the block keeps without recompute is live
again (one layer's, as an activation) with the sum the norm keeps; backward_moe.layer then frees them as without
recompute. Its largest moment is inside it, before the stop or at it, where the block's locals live beside what is
saved again (the fp32 router logits, the slot order, the unfolded xs and h, the unpermute's output): moe_region.py
replays its allocations, as it does the forward's.
"""
from __future__ import annotations

from dataclasses import replace

from llm_anatomy.calculator.types import Saved


def rerun(w, i: int, tag: str, rerun_attention) -> None:
    """Layer i's checkpoint's re-run, at the start of the MoE branch's backward (module docstring);
    rerun_attention(w, i, tag): the dense block's attention re-run (backward_efficient's), which recompute="full"
    runs first, its bias casts cached until the re-run ends."""
    from llm_anatomy.calculator.attention_region import bias_casts
    from llm_anatomy.calculator.moe_efficient import saved_list
    from llm_anatomy.calculator.moe_region import region_peak

    cfg, run = w.cfg, w.run
    casts = 0
    if w.recompute == "full":
        rerun_attention(w, i, tag)
        casts = bias_casts(cfg, run, w.rnd)

    def remade() -> list[Saved]:
        kept = saved_list(cfg, replace(run, recompute="none", lean=False), w.est.device)
        return [Saved("mlp.x", (run.batch, run.seq, cfg.hidden), w.dt.residual, 1, "the norm keeps the sum"),
                *(s for s in kept if s.name != "moe.balance.f")]  # the loss's, once per model: not re-made
    w.peak(tag + "recompute moe", region_peak(cfg, run, w.rnd, rerun=True), casts, kind="activation")
    w.remake("moe", remade)
