"""The MLP: one gate_up matmul, one fused activation kernel (anatomy.kernels.swiglu), then down.

gate and up come from one (H -> 2I) projection and are read as the two column halves of its
output: one matmul launch instead of two, and one saved storage. The activation op takes the
whole gate_up tensor (so no SplitBackward has to cat the two gradients), saves only it (silu and
the gpt-oss clamp masks are recomputed in backward) and writes d(gate_up) in place into it.
State dict: gate_up.weight = cat(gate.weight, up.weight)."""
import torch
from torch import nn

from anatomy.kernels import swiglu_packed


class MLP(nn.Module):
    component = "mlp"

    def __init__(self, hidden: int, intermediate: int, variant: str = "swiglu"):
        super().__init__()
        self.variant, self.intermediate = variant, intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        gate_up = self.gate_up(x)  # (B, S, 2I): gate and up are its column halves
        return self.down(swiglu_packed(gate_up, self.variant))  # (B, S, I); down keeps it
