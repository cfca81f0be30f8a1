"""How the peers a gathering saw are cut into groups, and who leads each: a pure function
of the announcements read, so every peer that read the same ones cuts the same groups
(matchmaking.py)."""

from __future__ import annotations

from collections.abc import Sequence

from swarmd.node.averaging.allreduce import Member


def leader_of(members: Sequence[Member]) -> Member | None:
    """A group's leader: its reachable member of lowest peer id (None: nobody in it can be
    dialled)."""
    return min((m for m in members if not m.client), key=lambda m: m.peer_id, default=None)


def partition(ordered: Sequence[Member], target: int) -> list[list[Member]]:
    """The available peers (sorted by id) cut into ⌈n / target⌉ groups of near-equal size,
    each with a reachable member to lead it: the reachable peers split in id order, the
    client-mode ones dealt out in turn. Every peer that read the same announcements cuts the
    same groups, so the groups of a round form at once.

    One group of the lowest ids with everybody else alone (what was done before) left 32 of
    48 simulated peers alone in a round with target 16, and 12 of 16 with target 4, each
    waiting out the gather window; the lowest reachable peer still leads the first group, and
    a group of near-equal sizes leaves no one a group of one (17 peers: 9 and 8, not 16 and 1).
    """
    reachable = [m for m in ordered if not m.client]
    clients = [m for m in ordered if m.client]
    count = min(len(reachable), max(1, -(-len(ordered) // target)))
    if not count:
        return []
    groups: list[list[Member]] = []
    base, extra = divmod(len(reachable), count)
    start = 0
    for k in range(count):
        size = base + (k < extra)
        groups.append(reachable[start : start + size])
        start += size
    for k, client in enumerate(clients):
        groups[k % count].append(client)
    return [sorted(g, key=lambda m: m.peer_id) for g in groups]
