"""Whether a state may be loaded at all: the checks every state passes, whoever sent it.

A downloaded state is hashed chunk by chunk, which proves it is the state its donors
advertised, not that it is one training could produce. Loading a non-finite state once made
every later round NaN and crashed the peers that took it from a donor; so a state with
non-finite values is refused here with a message, never loaded.

A finite state of the right shapes can still be garbage: two fresh keys advertising scrambled
parameters at a newer round were what a joiner, which has met nobody, would take (loss 89
against 3.6). So a peer also measures the offered state's loss and its own state's on the same
few batches and refuses a state clearly worse than what it holds (`worse_than_ours`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

#: How much worse than its own state (relative loss, plus an absolute margin in nats) a peer
#: lets an offered state be before it refuses it. Why these: whatever a peer holds (the seeded
#: init, its saved state, its own last round) is no better than the group's newer state
#: except for noise, and that noise is small: 4 batches of 8 x 128 tokens estimate a loss
#: within ~2%, and peers of one group differ by under 5% at the same round (the demo's
#: survivors: within 1%). 25% is five times that spread, and a scrambled state (16x the init's
#: loss) is far outside it. What the bound cannot stop: a state crafted to sit just under it,
#: which costs a joiner at most a quarter of its loss until the group's rounds pull it back.
LOSS_TOLERANCE = 0.25
LOSS_MARGIN = 0.1


def worse_than_ours(theirs: float, ours: float) -> str | None:
    """Why a state whose loss is ``theirs`` must not replace one whose loss is ``ours`` (both
    measured on the same batches), or None if it may."""
    limit = ours * (1 + LOSS_TOLERANCE) + LOSS_MARGIN
    if math.isfinite(theirs) and theirs <= limit:
        return None
    return (
        f"its loss on this peer's batches is {theirs:.3f}, against {ours:.3f} for the state "
        f"this peer holds (limit {limit:.3f})"
    )


def nonfinite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor holding NaN or infinity (as a reason), or None if all are finite."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel():
            total = float(torch.linalg.vector_norm(tensor.detach().float(), dtype=torch.float64))
            if not math.isfinite(total):
                return f"tensor {name!r} holds NaN or infinity"
    return None
