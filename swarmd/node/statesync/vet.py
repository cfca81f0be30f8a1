"""Whether a state may be loaded at all: the checks every state passes, whoever sent it.

A downloaded state is hashed chunk by chunk, which proves it is the state its donors
advertised, not that it is one training could produce. Loading a non-finite state once made
every later round NaN and crashed the peers that took it from a donor; so a state with
non-finite values is refused here with a message, never loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def nonfinite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor holding NaN or infinity (as a reason), or None if all are finite."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel():
            total = float(torch.linalg.vector_norm(tensor.detach().float(), dtype=torch.float64))
            if not math.isfinite(total):
                return f"tensor {name!r} holds NaN or infinity"
    return None
