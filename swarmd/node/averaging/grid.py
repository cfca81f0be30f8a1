"""Where each peer averages in a round when the run's peers outnumber one group: a grid whose
cells are fixed before anyone arrives, so that every contribution reaches every peer in the
same round (issue 46).

Today's rounds cut groups from whoever each peer saw announcing. With more peers than a group
holds, each group averaged its own pseudo-gradients and applied its own outer step, and the
matchmaking key carries the state hash, so the groups became lines that never met again.
Moshpit SGD (Ryabinin et al. 2021) puts peers on a d-dimensional grid and averages along one
axis at a time: with a full grid, d averagings give every peer the exact mean. The simulator
measured the first version here, with grid cells taken from the order peers arrived in: exact
in a round whose peers all arrived together, but the spread came back (0 -> 0.15 -> 0.28 ->
0.46 over four rounds) as soon as arrivals staggered, because two peers that saw different
arrivals cut different groups.

So the cells come from the roster (the run's live peers, in an order drawn from the round's
key) and nothing else:

- The roster fills ``S = s_0 * ... * s_{d-1} >= n`` *slots*, each axis at most the target
  group size; slot k is served by peer ``k mod n``. The few peers that serve two slots split
  their weight between them, so every peer counts once.
- Level l groups the slots that differ only in coordinate l (level 0: a row of consecutive
  slots). Each peer knows, before the round, the groups it belongs to and whom each expects:
  there is no race to cut them.
- After level l every slot of a group holds the weighted mean of the block of slots its
  members covered, and the block's weight; level l+1 combines one slot of each block. After
  d levels every slot holds the exact weighted mean of every contribution.
- A peer in two slots of one group contributes their weighted mean once with their summed
  weight: the group's weighted mean is the same.
- A slot whose peer never came or was dropped is served at the next levels by a member of its
  group that holds the group's result (``takeover``): its block still reaches every column.

What it costs: d all-reduces a round instead of one (d = 3 for 1,000 peers with groups of 16),
and a round waits for its slowest roster peer, as one group of everybody would. What breaks
it: peers whose rosters differ (a heartbeat seen by some and not others) plan different grids;
their rounds fork and catch-up merges them, as it merges any fork.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from swarmd.protocol.identity import PeerId


def shape_for(n: int, target: int) -> tuple[int, ...]:
    """Axis sizes for ``n`` peers with groups of at most ``target``: as few levels as fit
    (``ceil(log_target n)``), axes as even as possible, and the fewest slots >= n."""
    if n < 1 or target < 2:
        raise ValueError("a grid needs 1+ peers and a target group size of 2+")
    depth = 1
    while target**depth < n:
        depth += 1
    axes: list[int] = []
    left = n
    for level in range(depth):
        size = math.ceil(left ** (1 / (depth - level)) - 1e-9)
        size = min(target, max(1, size))
        axes.append(size)
        left = math.ceil(left / size)
    return tuple(axes)


@dataclass(frozen=True)
class Grid:
    """One round's grid over ``roster`` (see the module docstring)."""

    roster: tuple[PeerId, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.roster or not self.shape or math.prod(self.shape) < len(self.roster):
            raise ValueError("a grid's slots must cover its roster")
        if len(set(self.roster)) != len(self.roster):
            raise ValueError("a roster names each peer once")

    @classmethod
    def plan(cls, live: Iterable[PeerId], target: int, salt: bytes) -> Grid:
        """The grid every peer holding the same ``live`` set computes for the round whose
        key is ``salt``: the order is drawn from the salt so no peer is always in the same
        row (a slow peer would slow the same partners every round)."""
        peers = sorted(set(live), key=lambda p: hashlib.sha256(salt + p.raw).digest())
        return cls(tuple(peers), shape_for(len(peers), target))

    @property
    def slots(self) -> int:
        return math.prod(self.shape)

    @property
    def levels(self) -> int:
        return len(self.shape)

    def server(self, slot: int) -> PeerId:
        return self.roster[slot % len(self.roster)]

    def slots_of(self, peer: PeerId) -> list[int]:
        i = self.roster.index(peer)
        return list(range(i, self.slots, len(self.roster)))

    def share(self, peer: PeerId) -> float:
        """The part of the peer's weight each of its slots carries."""
        return 1.0 / len(self.slots_of(peer))

    def coords(self, slot: int) -> tuple[int, ...]:
        out = []
        for size in self.shape:
            out.append(slot % size)
            slot //= size
        return tuple(out)

    def slot_at(self, coords: Sequence[int]) -> int:
        slot, stride = 0, 1
        for c, size in zip(coords, self.shape, strict=True):
            slot += c * stride
            stride *= size
        return slot

    def group(self, slot: int, level: int) -> tuple[int, ...]:
        """The slots of ``slot``'s group at ``level``: those differing only in coordinate
        ``level``, in coordinate order."""
        c = list(self.coords(slot))
        out = []
        for x in range(self.shape[level]):
            c[level] = x
            out.append(self.slot_at(c))
        return tuple(out)

    def label(self, slot: int, level: int) -> str:
        """The group's name in a matchmaking key: its level and its fixed coordinates."""
        c = self.coords(slot)
        return f"L{level}/" + ".".join("*" if i == level else str(x) for i, x in enumerate(c))

    def expected(self, slots: Collection[int]) -> set[PeerId]:
        return {self.server(k) for k in slots}

    def clashes(self, lost: int, survivor: int, level: int) -> bool:
        """Whether the peer serving ``survivor`` would hold two slots of one group above
        ``level`` if it took ``lost`` over. It would contribute them as one (their weighted
        mean): exact, but a lossy codec rounds that input differently from the separate
        blocks every other group gets, and the groups' means drift apart (seen: 2e-3 spread
        with int8 and stallers in the roster, none with fp32)."""
        others = [t for t in self.slots_of(self.server(survivor)) if t != survivor]
        c = self.coords(lost)
        for t in others:
            d = self.coords(t)
            differ = [m for m in range(self.levels) if c[m] != d[m]]
            if len(differ) == 1 and differ[0] > level:
                return True
        return False


def takeover(
    group: Sequence[int],
    lost: Collection[int],
    clashes: Callable[[int, int], bool] | None = None,
) -> dict[int, int]:
    """Which surviving slot of ``group`` serves each lost one at the next levels: the i-th
    lost slot (in group order) goes to the (i mod survivors)-th survivor, or the next one
    after it that ``clashes(lost, survivor)`` does not rule out (`Grid.clashes`). Every
    member computes it from the same group and the same losses. Empty when nobody
    survived."""
    survivors = [k for k in group if k not in lost]
    if not survivors:
        return {}
    out = {}
    for i, k in enumerate(k for k in group if k in lost):
        turn = survivors[i % len(survivors) :] + survivors[: i % len(survivors)]
        out[k] = next((s for s in turn if clashes is None or not clashes(k, s)), turn[0])
    return out


def covering(group: Sequence[int], held: Collection[int]) -> list[int]:
    """The slots of ``group`` among ``held`` (a peer's slots, its takeovers included)."""
    return [k for k in group if k in held]


__all__ = ["Grid", "covering", "shape_for", "takeover"]
