"""Pure pieces of the DHT API: merging replicas' answers, caller addresses, proofs."""

from __future__ import annotations

import pytest

from swarmd.node.dht.caller import RttEstimator, TimeoutPolicy, check_proof, make_proof
from swarmd.node.dht.records import sign_record
from swarmd.node.dht.service import caller_address
from swarmd.node.dht.values import Value, merge
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import Identity

NOW = 1_800_000_000.0


def test_merge_takes_the_newest_version_of_each_slot() -> None:
    a, b = Identity.generate(), Identity.generate()
    old = sign_record(a, b"k", b"old", NOW + 10)
    new = sign_record(a, b"k", b"new", NOW + 20)
    assert merge([old, new, old], NOW) == Value(b"new", new.expires, a.peer_id)
    assert merge([old], NOW + 10) is None  # expired records are never served
    subs = [
        sign_record(a, b"k", b"a1", NOW + 10, b"x"),
        sign_record(a, b"k", b"a2", NOW + 30, b"x"),
        sign_record(b, b"k", b"b1", NOW + 10, b"y"),
    ]
    merged = merge(subs, NOW)
    assert isinstance(merged, dict)
    assert {k: v.value for k, v in merged.items()} == {"x": b"a2", "y": b"b1"}
    # A key with both kinds answers with whichever expires last.
    assert isinstance(merge([*subs, new], NOW), dict)
    assert merge([*subs, sign_record(b, b"k", b"p", NOW + 60)], NOW) == Value(
        b"p", NOW + 60, b.peer_id
    )
    assert merge([], NOW) is None


def test_caller_address_pairs_the_observed_ip_with_the_claimed_port() -> None:
    assert caller_address("ipv4:10.1.2.3:55555", 7000) == "10.1.2.3:7000"
    assert caller_address("ipv6:[2001:db8::1]:55555", 7000) == "[2001:db8::1]:7000"
    assert caller_address("ipv4:10.1.2.3:55555", 0) is None  # a client-only node
    assert caller_address("unix:/tmp/sock", 7000) is None
    assert caller_address("ipv4:10.1.2.3:1", 70000) is None


def test_identity_proofs() -> None:
    me, other = Identity.generate(), Identity.generate()
    challenge = b"c" * 16
    proof = make_proof(me, challenge)
    assert check_proof(proof, challenge, me.peer_id) == me.peer_id
    assert check_proof(proof, challenge, None) == me.peer_id
    with pytest.raises(ProtocolError, match="not"):
        check_proof(proof, challenge, other.peer_id)
    with pytest.raises(ProtocolError, match="prove"):
        check_proof(proof, b"d" * 16, me.peer_id)  # a replayed proof for another challenge


def test_timeouts_follow_measured_round_trips_within_bounds() -> None:
    rtt = RttEstimator(TimeoutPolicy(min_s=0.2, max_s=2.0, multiplier=4, alpha=0.5))
    for _ in range(20):
        rtt.sample(0.001)
    assert rtt.timeout() == 0.2
    assert rtt.stall() == pytest.approx(0.005, abs=1e-3)
    for _ in range(20):
        rtt.sample(0.2)
    assert rtt.timeout() == pytest.approx(0.8, rel=0.01)
    for _ in range(20):
        rtt.sample(5.0)
    assert rtt.timeout() == 2.0
    # Erratic round trips widen the timeout beyond 4x the mean (the deviation term).
    erratic = RttEstimator(TimeoutPolicy(min_s=0.01, max_s=10.0, multiplier=4, alpha=0.125))
    for i in range(200):
        erratic.sample(0.01 if i % 2 else 0.19)
    assert erratic.timeout() > 4 * erratic.srtt
    assert erratic.timeout() >= 0.19 * 2
    with pytest.raises(ValueError):
        TimeoutPolicy(min_s=3, max_s=2)
