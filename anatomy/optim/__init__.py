"""AdEMAMix optimizers: `AdEMAMix` (baseline, per-parameter loop) and `FusedAdEMAMix` (foreach +
torch.compile). Same math, same state layout; the state's size is predicted by
anatomy.calculator.optimizer.state_bytes."""
from anatomy.optim.baseline import AdEMAMix
from anatomy.optim.efficient import FusedAdEMAMix
from anatomy.optim.schedules import alpha_at, beta3_at

__all__ = ["AdEMAMix", "FusedAdEMAMix", "alpha_at", "beta3_at"]
