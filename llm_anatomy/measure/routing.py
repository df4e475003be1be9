"""A forced mixture-of-experts routing, for measurements whose bytes or time depend on the rows per expert.

force(route) returns a prepare hook (measure.memory.measure_phases, measure.liveness.measure_phases_live, the
probes' loops) that fixes every router's choice:
  "balanced"  slot j of token t goes to expert (t·k + j) mod E: the calculator's default histogram
              (calculator/moe.py balanced) in every layer;
  "skewed"    every token goes to experts 0..k-1 (calculator/moe.py skewed): k experts get every row.
Each router's logits get +1e4 at the chosen experts: an add that saves nothing for backward."""
from __future__ import annotations

import torch

ROUTES = ("balanced", "skewed")


def force(route: str):
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, not {route!r}")

    def prepare(model) -> None:
        for m in model.modules():
            if m.__class__.__name__ == "MoE":
                E, k = m.cfg.experts, m.cfg.experts_per_token

                def hook(_mod, _inp, out, E=E, k=k):
                    T = out.shape[0]  # out (T, E): the router's logits
                    slots = torch.arange(T * k, device=out.device).view(T, k)
                    chosen = slots % E if route == "balanced" else slots % k
                    bump = torch.zeros(T, E, dtype=out.dtype, device=out.device)
                    return out + bump.scatter_(1, chosen, 1e4)
                m.router.register_forward_hook(hook)
    return prepare
