"""Routing table: XOR buckets, k limit, replacement cache, subnet limits, failure back-off."""

from __future__ import annotations

import pytest

from swarmd.node.dht.ids import bucket_index, key_id, node_id, random_id_in_bucket
from swarmd.node.dht.routing import RoutingConfig, RoutingTable
from swarmd.protocol.identity import Identity, PeerId


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peers(n: int) -> list[PeerId]:
    return [Identity.generate().peer_id for _ in range(n)]


def peer_in_bucket(own: PeerId, index: int) -> PeerId:
    return PeerId(random_id_in_bucket(node_id(own), index).to_bytes(32, "big"))


def test_ids_and_buckets() -> None:
    own = Identity.generate().peer_id
    for index in (0, 1, 100, 255):
        other = peer_in_bucket(own, index)
        assert bucket_index(node_id(own), node_id(other)) == index
    with pytest.raises(ValueError):
        bucket_index(5, 5)
    assert key_id(b"a") != key_id(b"b") and 0 <= key_id(b"a") < 1 << 256


def test_closest_orders_by_xor_distance_and_excludes() -> None:
    own = Identity.generate().peer_id
    table = RoutingTable(own)
    ids = peers(50)
    for i, p in enumerate(ids):
        table.seen(p, f"127.0.0.1:{1000 + i}")
    assert own not in table and len(table) <= 50
    target = key_id(b"x")
    got = table.closest(target, 10, exclude=[ids[0]])
    expected = sorted(
        (p for p in ids if p in table and p != ids[0]), key=lambda p: node_id(p) ^ target
    )
    assert [c.peer_id for c in got] == expected[:10]


def test_full_bucket_keeps_old_contacts_and_promotes_replacements() -> None:
    own = Identity.generate().peer_id
    table = RoutingTable(own, RoutingConfig(k=3, replacement_cache=2))
    members = [peer_in_bucket(own, 200) for _ in range(5)]
    for i, p in enumerate(members):
        kept = table.seen(p, f"127.0.0.1:{2000 + i}")
        assert kept is (i < 3)
    assert [c.peer_id for c in table.contacts()] == members[:3]
    table.failed(members[0])
    assert members[0] not in table
    # The most recently seen replacement takes the free slot.
    assert members[4] in table and members[3] not in table


def test_one_subnet_cannot_fill_buckets_or_the_table() -> None:
    own = Identity.generate().peer_id
    table = RoutingTable(own, RoutingConfig(max_per_subnet_bucket=2, max_per_subnet_table=3))
    same_bucket = [peer_in_bucket(own, 255) for _ in range(4)]
    accepted = [table.seen(p, f"203.0.113.{10 + i}:7000") for i, p in enumerate(same_bucket)]
    assert accepted == [True, True, False, False]
    # Another /24 is welcome in the same bucket.
    assert table.seen(peer_in_bucket(own, 255), "198.51.100.1:7000")
    # Table-wide: a third entry of 203.0.113.0/24 in another bucket is fine, a fourth is not.
    assert table.seen(peer_in_bucket(own, 254), "203.0.113.50:7000")
    assert not table.seen(peer_in_bucket(own, 253), "203.0.113.51:7000")
    # IPv6 is grouped by /48.
    v6 = [table.seen(peer_in_bucket(own, 250), f"[2001:db8:1:{i}::1]:7000") for i in range(3)]
    assert v6 == [True, True, False]
    assert table.seen(peer_in_bucket(own, 250), "[2001:db8:2::1]:7000")
    # Loopback is exempt (peers all on one machine, and tests).
    loop = [table.seen(peer_in_bucket(own, 240), f"127.0.0.1:{9000 + i}") for i in range(10)]
    assert all(loop)


def test_failed_contacts_are_evicted_with_growing_back_off_not_forever() -> None:
    clock = FakeClock()
    own = Identity.generate().peer_id
    table = RoutingTable(own, RoutingConfig(backoff_base_s=2, backoff_max_s=5), clock=clock)
    p = peer_in_bucket(own, 100)
    assert table.seen(p, "127.0.0.1:5000")
    table.failed(p)
    assert p not in table and table.in_backoff(p)
    assert not table.seen(p, "127.0.0.1:5000")  # barred during back-off
    clock.now += 2.01
    assert not table.in_backoff(p)
    table.failed(p)  # second consecutive failure: 4 s
    clock.now += 3
    assert table.in_backoff(p)
    clock.now += 1.01
    assert not table.in_backoff(p)
    table.failed(p)  # third: 8 s, capped at 5 s
    clock.now += 5.01
    assert not table.in_backoff(p)
    assert table.seen(p, "127.0.0.1:5000")  # back, and the count starts over
    table.failed(p)
    clock.now += 2.01
    assert not table.in_backoff(p)


def test_moved_peer_takes_its_new_address() -> None:
    own = Identity.generate().peer_id
    table = RoutingTable(own)
    p = peer_in_bucket(own, 10)
    table.seen(p, "127.0.0.1:1")
    table.seen(p, "127.0.0.1:2")
    contact = table.get(p)
    assert contact is not None and contact.address == "127.0.0.1:2"
    assert len(table) == 1


def test_refresh_targets_start_at_the_nearest_neighbour() -> None:
    clock = FakeClock()
    own = Identity.generate().peer_id
    table = RoutingTable(own, clock=clock)
    assert table.refresh_targets(clock.now) == []
    table.seen(peer_in_bucket(own, 250), "127.0.0.1:1")
    assert table.refresh_targets(clock.now) == list(range(250, 256))
    table.touch(random_id_in_bucket(node_id(own), 252))
    assert 252 not in table.refresh_targets(clock.now)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="k must"):
        RoutingConfig(k=0)
    with pytest.raises(ValueError, match="not a network"):
        RoutingConfig(subnet_exempt=("nonsense",))
    with pytest.raises(ValueError, match="backoff"):
        RoutingConfig(backoff_base_s=10, backoff_max_s=1)


def test_failures_during_one_back_off_count_once() -> None:
    """Parallel calls failing together (a partition) must not escalate the back-off: after a
    short outage the peer is barred for the base delay, not for minutes."""
    clock = FakeClock()
    own = Identity.generate().peer_id
    table = RoutingTable(own, RoutingConfig(backoff_base_s=2, backoff_max_s=300), clock=clock)
    p = peer_in_bucket(own, 100)
    table.seen(p, "127.0.0.1:5000")
    for _ in range(10):
        table.failed(p)
    clock.now += 2.01
    assert not table.in_backoff(p)
    assert table.seen(p, "127.0.0.1:5000")


def test_a_full_fresh_bucket_admits_no_newcomer_until_its_oldest_is_stale() -> None:
    own = Identity.generate().peer_id
    clock = FakeClock()
    table = RoutingTable(own, RoutingConfig(k=2, recheck_after_s=60.0), clock=clock)
    first, second, newcomer = (peer_in_bucket(own, 200) for _ in range(3))
    assert table.would_admit(newcomer)  # room
    table.seen(first, "127.0.0.1:2000")
    table.seen(second, "127.0.0.1:2001")
    assert table.would_admit(first)  # already there
    assert not table.would_admit(newcomer)  # full, everybody heard from lately
    assert table.would_admit(peer_in_bucket(own, 100))  # another bucket has room
    clock.now += 61.0
    assert table.would_admit(newcomer)  # the oldest may be challenged
    assert table.oldest_rival(newcomer) is not None
    assert table.oldest_rival(newcomer).peer_id == first  # type: ignore[union-attr]
