"""The note a mesh claim carries: everything needed to rebuild the hypothesis draw it was read on (the mesh and
schedule settings present in the scenario, the model config, the run) and where on the mesh it was read.

    draw_note(sc)                              "tp=2 dp=1 optimizer=adamw; L2 H32 ...; B2S8 fp32 recompute=none"
    draw_note(sc, rec)                         ... + "; pp rank 0, dp rank 1, tp rank 0, step 2" (the keys rec has)
    draw_note(sc, rank=3)                      ... + "; rank 3"
"""
from __future__ import annotations

# scenario keys that describe the mesh, the schedule and the step, in the order they are written
SETTINGS = ("variant", "schedule", "virtual", "pp", "dp", "tp", "microbatches", "split", "optimizer", "param_dtype",
            "reduce_dtype", "reshard_after_forward")
WHERE = ("pp_rank", "dp_rank", "tp_rank", "step")  # the keys of a step record that place it on the mesh


def draw_note(sc: dict, rec: dict | None = None, **where) -> str:
    """One line: sc's settings, config and run; then rec's place on the mesh and the keyword arguments'."""
    c, r = sc["cfg"], sc["run"]
    settings = " ".join(f"{k}={sc[k]}" for k in SETTINGS if k in sc)
    model = (f"L{c.layers} H{c.hidden} I{c.intermediate} V{c.vocab} heads {c.heads}/{c.kv_heads}x{c.head_dim} "
             f"{c.mlp} bias={c.qkv_bias} tied={c.tie_embeddings} qk_norm={c.qk_norm}")
    place = {k: rec[k] for k in WHERE if rec is not None and k in rec} | where
    at = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in place.items())
    return f"{settings}; {model}; B{r.batch}S{r.seq} {r.dtype} recompute={r.recompute}" + (f"; {at}" if at else "")
