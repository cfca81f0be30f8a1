"""What keeps one DeMo member from steering its group's sign step.

Every member steps by the sign of the per-coefficient mean of everyone's coefficients, so a
member whose payloads are finite, well-formed and signed, but x(-1000) its honest ones, chose
every sign (two honest members of three went from loss 3.0 to 15.1). Two rules bound it, each
computed by every member from the same decoded bytes in the same order, so members that heard
the same payloads still take bit-identical steps:

- **Norm clip** (`clipped_to_median`): a member's coefficients for a tensor are scaled down
  to twice the group's (lower) median norm for it (`demo_clip`). Measured through `swarmd
  join` (3 members, the tiny model, 30 steps): x(-1000) took the honest two from 3.54 to 7.59
  unclipped, to 5.53 clipped (4.38 at 1x the median, which cost 3% without a liar): alone it
  only bounds the liar to what two honest members sending the opposite would do.
- **Opposed members left out** (`opposed`): from three members on, a member whose
  coefficients point against most other members' (a negative inner product over the whole
  model with more than half of them) is left out of that step's mean, while such members are
  fewer than half. An honest
  member follows the same loss as the others, so its momentum's top coefficients agree with
  theirs in sign more often than not; a member sending the others' direction reversed is
  against them every step. Neither rule is proof of a lie, so neither bans.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmd.optim.majority import against_most


def clipped_to_median(values: list[torch.Tensor], multiple: float) -> list[torch.Tensor]:
    """``values`` with every tensor whose norm exceeds ``multiple`` times the lower median of
    their norms scaled down to it (``multiple`` 0: as they are; the inputs are never changed).
    The lower median (the k-th of 2k) is an honest member's norm while fewer than half of
    them lie; in a pair it is the smaller one, so a liar weighs no more than its partner."""
    if not multiple or len(values) < 2:
        return values
    norms = [float(torch.linalg.vector_norm(v, dtype=torch.float64)) for v in values]
    bound = multiple * sorted(norms)[(len(norms) - 1) // 2]
    return [v * (bound / n) if n > bound else v for v, n in zip(values, norms, strict=True)]


def opposed(
    indices: Sequence[Sequence[torch.Tensor]],
    values: Sequence[Sequence[torch.Tensor]],
    shapes: Sequence[tuple[int, int]],
) -> list[int]:
    """The members (positions) whose coefficients have a negative inner product, summed over
    every tensor, with more than half of the other members'; none when fewer than three
    members, or when half or more of them would be left out (no majority to trust).

    Pairwise, not against the sum of the others: in a group of three the liar's reversed
    coefficients cancel an honest member's agreement with the other honest one, so against
    the sum the honest members look opposed too (measured: the liar was left out in about a
    quarter of the steps that way). ``indices[i][j]`` and ``values[i][j]``: member j's
    coefficients for tensor i, shaped (blocks, k); ``shapes[i]``: tensor i's (blocks, block
    size). One dense buffer per tensor: member k's coefficients scattered, every other
    member's gathered from it, then those entries zeroed again: one more dense buffer per
    tensor (as `DeMo.apply`'s own sums) and O(n^2) times the payload, not n passes over the
    model."""
    members = len(values[0]) if values else 0
    if members < 3:
        return []
    dots = [[0.0] * members for _ in range(members)]
    for idx, val, shape in zip(indices, values, shapes, strict=True):
        dense = torch.zeros(shape, dtype=torch.float64, device=val[0].device)
        for k in range(1, members):
            dense.scatter_(1, idx[k], val[k].to(torch.float64))
            for j in range(k):
                dot = float((val[j].to(torch.float64) * dense.gather(1, idx[j])).sum())
                dots[j][k] += dot
                dots[k][j] += dot
            dense.scatter_(1, idx[k], 0.0)  # only what was written: O(payload), not O(tensor)
    against = {j: sum(dots[j][k] < 0 for k in range(members) if k != j) for j in range(members)}
    return against_most(against, members)
