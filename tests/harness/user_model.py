"""A user's own model for `model = "tests.harness.user_model:bigram"` in a run file."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.table(idx)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


def bigram() -> nn.Module:
    return Bigram()
