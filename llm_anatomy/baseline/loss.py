"""lm_head then F.cross_entropy over the full (B, S, V) logits: the largest activation of small models."""
import torch
import torch.nn.functional as F
from torch import nn


class LMHeadLoss(nn.Module):
    component = "loss"

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = self.lm_head(x)  # x: (B, S, H) -> (B, S, V), bf16 under autocast
        # upcast as HF does: log_softmax saves its fp32 (B*S, V) output, nll_loss saves targets
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), reduction=reduction)
