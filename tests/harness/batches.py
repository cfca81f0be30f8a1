"""Training data for optimiser tests that need no corpus: seeded random byte tokens."""

from __future__ import annotations

import torch


def random_batches(
    n: int, seed: int, batch: int, block: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded random byte-token (input, next-token target) batches for optimiser tests."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (batch, block + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out
