"""Local DHT storage: newest expiry wins, owner locks, sub-key merging, expiry, quotas."""

from __future__ import annotations

import dataclasses

import pytest

from swarmd.node.dht.records import RecordError, sign_record
from swarmd.node.dht.storage import Outcome, Storage, StorageLimits
from swarmd.protocol.identity import Identity


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_newer_expiry_wins_and_old_versions_replayed_later_are_ignored(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    me = Identity.generate()
    v1 = sign_record(me, b"k", b"one", clock.now + 10)
    v2 = sign_record(me, b"k", b"two", clock.now + 20)
    assert store.put(v1) is Outcome.STORED
    assert store.put(v2) is Outcome.STORED
    assert store.put(v1) is Outcome.SUPERSEDED  # replay of the old version
    assert store.put(v2) is Outcome.SUPERSEDED  # same record again
    assert [r.value for r in store.get(b"k")] == [b"two"]
    assert len(store) == 1


def test_a_live_slot_belongs_to_its_owner_until_it_expires(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    alice, mallory = Identity.generate(), Identity.generate()
    store.put(sign_record(alice, b"run/config", b"lr=1", clock.now + 10))
    with pytest.raises(RecordError, match="another owner"):
        store.put(sign_record(mallory, b"run/config", b"lr=999", clock.now + 100))
    clock.now += 11
    assert store.get(b"run/config") == []
    assert store.put(sign_record(mallory, b"run/config", b"lr=2", clock.now + 10))
    assert [r.value for r in store.get(b"run/config")] == [b"lr=2"]


def test_sub_keys_from_many_owners_merge(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    owners = [Identity.generate() for _ in range(5)]
    for i, owner in enumerate(owners):
        sub = str(owner.peer_id).encode()
        store.put(sign_record(owner, b"round/17", b"ready%d" % i, clock.now + 10 + i, sub))
    store.put(sign_record(owners[0], b"round/17", b"plain", clock.now + 5))
    found = store.get(b"round/17")
    assert len(found) == 6
    assert found[0].subkey is None
    assert sorted(r.value for r in found[1:]) == [b"ready%d" % i for i in range(5)]
    # Each entry expires on its own.
    clock.now += 11.5
    assert sorted(r.value for r in store.get(b"round/17")) == [b"ready2", b"ready3", b"ready4"]


def test_expired_records_are_refused_dropped_and_never_served(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    me = Identity.generate()
    with pytest.raises(RecordError, match="expired"):
        store.put(sign_record(me, b"k", b"v", clock.now - 1))
    store.put(sign_record(me, b"k", b"v", clock.now + 1))
    store.put(sign_record(me, b"k", b"s", clock.now + 1, b"sub"))
    assert len(store.get(b"k")) == 2
    clock.now += 1
    assert store.get(b"k") == []
    assert len(store) == 0 and store.nbytes == 0
    assert store.usage(me.public_key) == (0, 0)


def test_per_owner_quotas_in_records_and_bytes(clock: FakeClock) -> None:
    limits = StorageLimits(max_records_per_owner=3, max_bytes_per_owner=2000)
    store = Storage(limits, clock=clock)
    me, other = Identity.generate(), Identity.generate()
    for i in range(3):
        store.put(sign_record(me, b"k%d" % i, b"v", clock.now + 10))
    with pytest.raises(RecordError, match="owner quota"):
        store.put(sign_record(me, b"k3", b"v", clock.now + 10))
    # Updating a record it already has is not a new record.
    assert store.put(sign_record(me, b"k0", b"w", clock.now + 20)) is Outcome.STORED
    with pytest.raises(RecordError, match="owner quota"):
        store.put(sign_record(other, b"big", b"x" * 2000, clock.now + 10))
    store.put(sign_record(other, b"ok", b"x" * 1000, clock.now + 10))
    assert store.usage(me.public_key)[0] == 3
    # Quotas free up when records expire.
    clock.now += 15
    store.put(sign_record(me, b"k3", b"v", clock.now + 10))
    assert store.usage(me.public_key)[0] == 2


def test_global_cap_bounds_floods_from_many_keys(clock: FakeClock) -> None:
    store = Storage(StorageLimits(max_records=4), clock=clock)
    for i in range(4):
        store.put(sign_record(Identity.generate(), b"k%d" % i, b"v", clock.now + 10))
    with pytest.raises(RecordError, match="full"):
        store.put(sign_record(Identity.generate(), b"k4", b"v", clock.now + 10))


def test_forged_records_are_refused_before_anything_is_stored(clock: FakeClock) -> None:
    import dataclasses

    store = Storage(clock=clock)
    record = sign_record(Identity.generate(), b"k", b"v", clock.now + 10)
    with pytest.raises(RecordError, match="signature"):
        store.put(dataclasses.replace(record, value=b"evil"))
    assert len(store) == 0


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_records_per_owner"):
        StorageLimits(max_records_per_owner=0)


def test_next_store_is_set_by_a_new_record_under_its_key_only(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    me = Identity.generate()
    first = sign_record(me, b"mm/1", b"a", clock.now + 10, b"s")
    store.put(first)
    event = store.next_store(b"mm/1")
    assert store.next_store(b"mm/1") is event  # one per key, shared by its waiters
    store.put(sign_record(me, b"mm/2", b"a", clock.now + 10, b"s"))  # another key
    assert store.put(first) is Outcome.SUPERSEDED  # nothing new
    with pytest.raises(RecordError):
        store.put(sign_record(Identity.generate(), b"mm/1", b"x", clock.now + 10, b"s"))
    assert not event.is_set()
    store.put(sign_record(me, b"mm/1", b"b", clock.now + 20, b"s"))
    assert event.is_set()
    assert store.next_store(b"mm/1") is not event  # the next wait needs a new record


def test_a_key_nobody_waits_on_any_more_leaves_no_event_behind(clock: FakeClock) -> None:
    store = Storage(clock=clock)
    for i in range(100):
        store.next_store(b"round/%d" % i)  # taken and dropped, as by a round that ended
    assert len(store._watched) == 0


def test_fresh_keys_from_one_address_stop_at_its_share(clock: FakeClock) -> None:
    limits = StorageLimits(max_records=64, address_share=1 / 16, block_share=1 / 8)
    assert limits.per_address[0] == 4 and limits.per_block[0] == 8
    store = Storage(limits, clock=clock)
    for i in range(4):
        store.put(sign_record(Identity.generate(), b"a%d" % i, b"v", clock.now + 10), "10.0.0.7")
    with pytest.raises(RecordError, match="source address quota"):
        store.put(sign_record(Identity.generate(), b"a4", b"v", clock.now + 10), "10.0.0.7")
    # Its neighbour in the /24 has its own share, until the block's is spent.
    for i in range(4):
        store.put(sign_record(Identity.generate(), b"b%d" % i, b"v", clock.now + 10), "10.0.0.8")
    with pytest.raises(RecordError, match="source network quota"):
        store.put(sign_record(Identity.generate(), b"c", b"v", clock.now + 10), "10.0.0.9")
    # Another network, and the node's own records, are not charged to either.
    store.put(sign_record(Identity.generate(), b"d", b"v", clock.now + 10), "10.0.1.9")
    store.put(sign_record(Identity.generate(), b"e", b"v", clock.now + 10))
    assert store.source_usage("10.0.0.7")[0] == 4
    assert store.source_usage("10.0.0.0/24")[0] == 8
    assert store.source_usage("10.0.1.0/24")[0] == 1
    assert len(store) == 10


def test_byte_share_and_ipv6_networks(clock: FakeClock) -> None:
    limits = StorageLimits(max_bytes=40_000, address_share=1 / 4, block_share=1 / 2)
    store = Storage(limits, clock=clock)
    big = b"x" * 6_000
    store.put(sign_record(Identity.generate(), b"a", big, clock.now + 10), "2001:db8:1:2::1")
    with pytest.raises(RecordError, match="address quota"):
        store.put(sign_record(Identity.generate(), b"b", big, clock.now + 10), "2001:db8:1:2::1")
    store.put(sign_record(Identity.generate(), b"c", big, clock.now + 10), "2001:db8:1:3::1")
    store.put(sign_record(Identity.generate(), b"d", big, clock.now + 10), "2001:db8:1:4::1")
    # Three addresses of one /48 have filled its half of the node.
    with pytest.raises(RecordError, match="network quota"):
        store.put(sign_record(Identity.generate(), b"e", big, clock.now + 10), "2001:db8:1:5::1")
    store.put(sign_record(Identity.generate(), b"f", big, clock.now + 10), "2001:db8:2::1")


def test_a_record_is_charged_to_whoever_delivered_its_current_version(clock: FakeClock) -> None:
    store = Storage(StorageLimits(max_records=32), clock=clock)  # 2 records per address
    me = Identity.generate()
    store.put(sign_record(me, b"k", b"v1", clock.now + 10), "10.0.0.1")
    # A republish from the owner's new address moves the charge; an older replay changes none.
    store.put(sign_record(me, b"k", b"v2", clock.now + 20), "10.0.0.2")
    assert store.source_usage("10.0.0.1") == (0, 0)
    assert store.source_usage("10.0.0.2")[0] == 1
    store.put(sign_record(me, b"k", b"v1", clock.now + 10), "10.0.0.3")
    assert store.source_usage("10.0.0.3") == (0, 0)
    # An address whose share is spent can still replace its own records.
    store.put(sign_record(me, b"j", b"w", clock.now + 20), "10.0.0.2")
    store.put(sign_record(me, b"j", b"w2", clock.now + 30), "10.0.0.2")
    assert store.source_usage("10.0.0.2")[0] == 2
    # Expiry gives the share back.
    clock.now += 25
    assert store.source_usage("10.0.0.2")[0] == 2
    store.get(b"j")
    assert store.source_usage("10.0.0.2")[0] == 1
    assert store.source_usage("10.0.0.0/24")[0] == 1


def test_source_shares_are_validated() -> None:
    for shares in ((0.0, 0.5), (0.5, 0.25), (0.5, 1.5)):
        with pytest.raises(ValueError, match="address_share"):
            StorageLimits(address_share=shares[0], block_share=shares[1])
    assert StorageLimits().per_address == (12_500, 16 << 20)
    assert StorageLimits().per_block == (25_000, 32 << 20)


def test_one_identity_that_filled_its_address_leaves_a_newcomer_there_half(
    clock: FakeClock,
) -> None:
    """Volunteers behind one router share an address: a flood from one identity used to
    lock the next one out (issue 47: 3 of 20 records stored)."""
    store = Storage(StorageLimits(max_records=160), clock=clock)  # 10 records per address
    flooder, honest, third = Identity.generate(), Identity.generate(), Identity.generate()
    for i in range(10):
        store.put(sign_record(flooder, b"f%d" % i, b"v", clock.now + 10 + i), "10.0.0.7")
    with pytest.raises(RecordError, match="address quota"):
        store.put(sign_record(flooder, b"f10", b"v", clock.now + 10), "10.0.0.7")
    stored = 0
    for i in range(20):
        try:
            store.put(sign_record(honest, b"h%d" % i, b"v", clock.now + 60), "10.0.0.7")
            stored += 1
        except RecordError:
            pass
    assert stored == 5  # half the address's share; the flooder keeps the other half
    assert store.source_usage("10.0.0.7")[0] == 10
    # The flooder's records that went first were its soonest to expire.
    assert [store.get(b"f%d" % i) != [] for i in range(10)] == [False] * 5 + [True] * 5
    # The flooder cannot take its room back: it holds as much as the newcomer now.
    with pytest.raises(RecordError, match="address quota"):
        store.put(sign_record(flooder, b"f11", b"v", clock.now + 90), "10.0.0.7")
    # A third identity takes from whichever holds most, down to an even split.
    for i in range(3):
        store.put(sign_record(third, b"t%d" % i, b"v", clock.now + 60), "10.0.0.7")
    with pytest.raises(RecordError, match="address quota"):
        store.put(sign_record(third, b"t3", b"v", clock.now + 60), "10.0.0.7")
    counts = sorted(store.usage(o.public_key)[0] for o in (flooder, honest, third))
    assert counts == [3, 3, 4] and len(store) == 10


def test_a_forged_record_evicts_nothing(clock: FakeClock) -> None:
    store = Storage(StorageLimits(max_records=32), clock=clock)  # 2 records per address
    flooder, honest = Identity.generate(), Identity.generate()
    for i in range(2):
        store.put(sign_record(flooder, b"f%d" % i, b"v", clock.now + 10), "10.0.0.7")
    good = sign_record(honest, b"h", b"v", clock.now + 10)
    forged = dataclasses.replace(good, value=b"w")
    with pytest.raises(RecordError):
        store.put(forged, "10.0.0.7")
    assert all(store.get(b"f%d" % i) for i in range(2)) and len(store) == 2
