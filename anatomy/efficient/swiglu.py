"""The MLP: one gate_up matmul, one fused activation kernel (anatomy.kernels.swiglu), then down.

gate and up come from one (H -> 2I) projection and are read as the two column halves of its
output: one matmul launch instead of two, and one saved storage. The activation kernel saves
only gate and up (silu and the gpt-oss clamp masks are recomputed in backward) and writes
dgate/dup in place into that storage. State dict: gate_up.weight = cat(gate.weight, up.weight)."""
import torch
from torch import nn

from anatomy.kernels import swiglu


class MLP(nn.Module):
    component = "mlp"

    def __init__(self, hidden: int, intermediate: int, variant: str = "swiglu"):
        super().__init__()
        self.variant, self.intermediate = variant, intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)  # views of one (B, S, 2I) tensor
        return self.down(swiglu(gate, up, self.variant))  # down keeps the (B, S, I) activation
