"""The address a peer advertises when it listens on every interface (node.server.advertise)."""

from __future__ import annotations

from swarmd.node.peer.advertise import advertised_address
from swarmd.protocol.address import Address


def test_an_unspecified_host_becomes_the_address_facing_the_bootstrap_peers() -> None:
    got = advertised_address(Address("0.0.0.0", 7000), ["nonsense", "127.0.0.1:9"])
    assert got == Address("127.0.0.1", 7000)


def test_a_specific_address_or_a_name_is_kept() -> None:
    for host in ("127.0.0.3", "10.77.0.2", "peer.example.org"):
        assert advertised_address(Address(host, 7000), ["127.0.0.1:9"]) == Address(host, 7000)


def test_without_a_bootstrap_peer_nothing_better_is_known() -> None:
    assert advertised_address(Address("0.0.0.0", 7000), []) == Address("0.0.0.0", 7000)
