"""AdEMAMix optimizers: `AdEMAMix` (baseline, per-parameter loop) and `FusedAdEMAMix` (foreach +
torch.compile). Same math, same state layout; the state's size is predicted by
llm_anatomy.calculator.optimizer.state_bytes, each form's step time by calculator/timing/kernels.py:
optimizer_kernels. `anatomy train --optimizer ademamix` runs the loop for the baseline variant and the
compiled form for the efficient one; its default optimizer is torch's fused AdamW."""
from llm_anatomy.optim.baseline import AdEMAMix
from llm_anatomy.optim.efficient import FusedAdEMAMix
from llm_anatomy.optim.schedules import alpha_at, beta3_at

__all__ = ["AdEMAMix", "FusedAdEMAMix", "alpha_at", "beta3_at"]
