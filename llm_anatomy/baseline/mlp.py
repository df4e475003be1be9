"""The MLP as separate ops: every elementwise op keeps its inputs for backward."""
import torch
import torch.nn.functional as F
from torch import nn

GPT_OSS_LIMIT = 7.0


class MLP(nn.Module):
    component = "mlp"

    def __init__(self, hidden: int, intermediate: int, variant: str = "swiglu"):
        super().__init__()
        self.variant = variant
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, H)
        gate, up = self.gate(x), self.up(x)  # (B, S, I) each; under autocast each call casts x anew
        if self.variant == "gpt-oss":
            gate = gate.clamp(max=GPT_OSS_LIMIT)  # clamp saves its input (raw gate)
            up = up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT) + 1  # clamp saves raw up; the +1 output is saved by mul
        return self.down(F.silu(gate) * up)  # silu saves gate; mul saves silu(gate) and up; down saves the product
