"""Who averages together, and which span of the vector each member reduces.

Every member derives the same parts from the same group (same member order everywhere), so
nobody has to agree on them over the wire.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class Member:
    peer_id: PeerId
    address: str
    #: Announced bandwidth in bytes/s; parts are sized in proportion.
    bandwidth: float = 1e8
    #: Cannot be dialled (behind NAT): it pushes its parts to the others and pulls the
    #: reduced ones back, reduces no part, and nobody calls it (issue 27).
    client: bool = False

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"member bandwidth must be finite and > 0, got {self.bandwidth}")


@dataclass(frozen=True)
class Group:
    """Who averages together in one round. Members must be in the same order on every peer."""

    round_id: bytes
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a group needs at least one member")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate member in group")
        if not 1 <= len(self.round_id) <= 64:
            raise ValueError("round_id must be 1..64 bytes")
        if all(m.client for m in self.members):
            raise ValueError("a group of only unreachable (client-mode) peers cannot average")

    @property
    def servers(self) -> tuple[int, ...]:
        """The members others can dial, in member order: they reduce the parts."""
        return tuple(i for i, m in enumerate(self.members) if not m.client)

    def reachable(self, index: int) -> bool:
        return not self.members[index].client

    def bandwidths(self) -> list[float]:
        """What `part_bounds` splits by: a client-mode member reduces nothing."""
        return [0.0 if m.client else m.bandwidth for m in self.members]

    def index_of(self, peer_id: PeerId) -> int | None:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        return None


def part_bounds(numel: int, bandwidths: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous spans proportional to bandwidth, covering [0, numel) exactly (a bandwidth
    of 0 gets an empty span)."""
    total = sum(bandwidths)
    if not total > 0:
        raise ValueError("part_bounds needs a positive total bandwidth")
    bounds, start, acc = [], 0, 0.0
    for i, b in enumerate(bandwidths):
        acc += b
        end = numel if i == len(bandwidths) - 1 else round(numel * acc / total)
        bounds.append((start, end))
        start = end
    return bounds


def sub_group(group: Group, bucket: str) -> Group:
    """The same members under a round id of their own, one per codec bucket."""
    rid = hashlib.sha256(group.round_id + b"/" + bucket.encode()).digest()
    return Group(rid, group.members)
