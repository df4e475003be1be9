"""AdEMAMix optimizers: `AdEMAMix` (baseline, per-parameter loop) and `FusedAdEMAMix` (foreach +
torch.compile). Same math, same state layout; the state's size is predicted by
anatomy.calculator.optimizer.state_bytes, each form's step time by calculator/timing/kernels.py:
optimizer_kernels. `anatomy train --optimizer ademamix` runs the loop for the baseline variant and the
compiled form for the efficient one; its default optimizer is torch's fused AdamW."""
from anatomy.optim.baseline import AdEMAMix
from anatomy.optim.efficient import FusedAdEMAMix
from anatomy.optim.schedules import alpha_at, beta3_at

__all__ = ["AdEMAMix", "FusedAdEMAMix", "alpha_at", "beta3_at"]
