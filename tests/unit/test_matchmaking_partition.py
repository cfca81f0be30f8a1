"""`matchmaking.partition`: how the peers a round's matchmaking saw are cut into groups when
they outnumber the target."""

from __future__ import annotations

import random

from swarmd.node.averaging.allreduce import Member
from swarmd.node.averaging.partition import partition
from swarmd.node.sim.dht import seeded_identity


def members(n: int, clients: set[int] = frozenset()) -> list[Member]:  # type: ignore[assignment]
    rng = random.Random(n)
    ids = sorted(seeded_identity(rng).peer_id for _ in range(n))
    return [Member(p, f"10.0.0.{i}:1", client=i in clients) for i, p in enumerate(ids)]


def test_no_more_peers_than_the_target_is_one_group() -> None:
    peers = members(5)
    assert partition(peers, 16) == [peers]


def test_more_peers_make_near_equal_groups_in_id_order() -> None:
    peers = members(48)
    groups = partition(peers, 16)
    assert [len(g) for g in groups] == [16, 16, 16]
    assert [m for g in groups for m in g] == peers  # contiguous runs of ids
    # Near-equal: 17 peers are 9 and 8, never 16 and a lone one.
    assert [len(g) for g in partition(members(17), 16)] == [9, 8]
    assert [len(g) for g in partition(members(10), 4)] == [4, 3, 3]


def test_every_group_has_a_reachable_peer_to_lead_it() -> None:
    peers = members(8, clients={0, 1, 2, 3, 4})
    groups = partition(peers, 2)
    # Four groups wanted, three reachable peers: three groups, clients dealt out in turn.
    assert len(groups) == 3
    assert all(any(not m.client for m in g) for g in groups)
    assert sorted(m.peer_id for g in groups for m in g) == [m.peer_id for m in peers]
    assert all(g == sorted(g, key=lambda m: m.peer_id) for g in groups)
    assert partition(members(3, clients={0, 1, 2}), 2) == []
