"""The majority rule of both opposed-member checks: DiLoCo's reducers
(node/averaging/reduction.opposed_outliers) and DeMo's members (optim/demo_robust.opposed).
Each counts, for every member, the others its update has a negative inner product with; this
decides whom that leaves out, so both leave out the same members for the same counts."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def against_most(against: Mapping[K, int], members: int) -> list[K]:
    """The members opposed to more than half of the ``members - 1`` others; none when they
    are half of the group or more (no majority left to trust), so a group of two honest
    members that disagree for a round drops neither."""
    out = [k for k, n in against.items() if 2 * n > members - 1]
    return out if 2 * len(out) < members else []
