"""Validation loss of any model following the `forward(idx, targets) -> (logits, loss)` contract."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Token-weighted mean loss over `batches` (a last, smaller batch counts by its size).

    Runs in eval mode and restores the previous mode, so it can be called mid-training.
    """
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total, count = 0.0, 0
    try:
        for x, y in batches:
            _, loss = model(x.to(device), y.to(device))
            total += float(loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got no batches")
    return total / count
