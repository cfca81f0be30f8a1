"""Validation loss of any model following the `forward(idx, targets) -> (logits, loss)` contract."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    params: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """Token-weighted mean loss over `batches` (a last, smaller batch counts by its size).

    Runs in eval mode and restores the previous mode, so it can be called mid-training.
    ``params`` (by parameter name) stand in for the model's own for this call only, without
    touching them: how a peer judges a state someone offers before adopting it.
    """
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total, count = 0.0, 0
    try:
        for x, y in batches:
            args = (x.to(device), y.to(device))
            if params is None:
                _, loss = model(*args)
            else:
                _, loss = torch.func.functional_call(model, dict(params), args)
            total += float(loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got no batches")
    return total / count
