"""The MLP: one gate_up matmul, one fused activation kernel (llm_anatomy.kernels.swiglu), then down.

gate and up come from one (H -> 2I) projection and are read as the two column halves of its
output: one matmul launch instead of two, and one saved storage. The activation op takes the
whole gate_up tensor (so no SplitBackward has to cat the two gradients), saves only it (silu and
the gpt-oss clamp masks are recomputed in backward) and writes d(gate_up) in place into it.
State dict: gate_up.weight = cat(gate.weight, up.weight).

In the lean block (Run.lean, without recompute), gate_up runs llm_anatomy.kernels.lean.linear (under autocast its node keeps the
fp32 weight, not a bf16 cast), and the activation and down run as one node, lean.swiglu_down, which keeps
gate_up and down's fp32 weight: not the activation h (T, I), which backward makes again from gate_up with
the forward's kernel (the same bits), nor down's weight cast.

Recompute (Run.recompute == "mlp"): called with the block's norm and the attention branch's output,
the MLP forms the residual sum itself and runs sum -> norm -> gate_up -> activation -> down -> + sum
under a non-reentrant torch.utils.checkpoint, which keeps only its inputs: the block input x (kept
anyway by attention's checkpoint) and the branch (compute dtype, half the fp32 sum's bytes under amp).
In backward the checkpoint re-runs the region and, by its early stop, halts as soon as the last tensor
backward needs (down's input) has been saved again: the down matmul is not run twice."""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llm_anatomy.kernels import swiglu_packed
from llm_anatomy.kernels.lean import linear, swiglu_down


class MLP(nn.Module):
    component = "mlp"

    def __init__(self, hidden: int, intermediate: int, variant: str = "swiglu", lean: bool = False):
        super().__init__()
        self.variant, self.intermediate, self.lean = variant, intermediate, lean  # lean: False inside a checkpoint
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, branch: torch.Tensor | None = None):
        """x (B, S, H), normed -> the MLP's output. With norm and branch (recompute): x is the block's
        input and the result is the block's output, x + branch + mlp(norm(x + branch))."""
        return self._mlp(x) if norm is None else recomputed_tail(self._mlp, x, norm, branch)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H), normed
        if self.lean:
            gate_up = linear(x, self.gate_up.weight)  # (B, S, 2I): gate and up are its column halves
            return swiglu_down(gate_up, self.down.weight, self.variant)  # keeps gate_up; h is made again in backward
        gate_up = self.gate_up(x)
        return self.down(swiglu_packed(gate_up, self.variant))  # (B, S, I); down keeps it


def recomputed_tail(mlp, x: torch.Tensor, norm: nn.Module, branch: torch.Tensor) -> torch.Tensor:
    """x + branch + mlp(norm(x + branch)) under a non-reentrant checkpoint (Run.recompute == "mlp"): the dense
    MLP's and the MoE block's (llm_anatomy/efficient/moe.py) recompute region."""
    def tail(x, branch):  # no dropout: no RNG state to replay
        x = x + branch  # (B, S, H), the residual dtype
        return x + mlp(norm(x))
    return checkpoint(tail, x, branch, use_reentrant=False, preserve_rng_state=False)
