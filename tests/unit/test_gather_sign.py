"""Sender signatures on all-gather payloads (algorithms/demo/gather_sign.py): what a relay can and
cannot do to a payload it passes on to a client-mode member."""

from __future__ import annotations

from swarmd.node.algorithms.demo.gather_sign import check_signed, signed_info
from swarmd.protocol.identity import Identity


def test_a_signed_payload_checks_and_every_alteration_is_named() -> None:
    sender, relay = Identity.generate(), Identity.generate()
    group, payload, state = b"g" * 32, b"payload bytes", b"h" * 32
    info = signed_info(sender, group, 7, payload, state)
    assert check_signed(info, payload, sender.peer_id) is None
    assert check_signed(info, bytearray(payload), sender.peer_id) is None

    assert check_signed(info, payload + b"!", sender.peer_id) == (
        "the payload's signature does not match it"
    )
    moved = type(info)()
    moved.CopyFrom(info)
    moved.step = 8  # replayed at another step
    assert check_signed(moved, payload, sender.peer_id) is not None
    other_group = type(info)()
    other_group.CopyFrom(info)
    other_group.group_id = b"x" * 32
    assert check_signed(other_group, payload, sender.peer_id) is not None
    other_hash = type(info)()
    other_hash.CopyFrom(info)
    other_hash.state_hash = b"z" * 32  # a relay cannot make a sender look drifted
    assert check_signed(other_hash, payload, sender.peer_id) is not None
    # The relay re-signing with its own key: the key is not the sender's.
    forged = signed_info(relay, group, 7, payload + b"!", state)
    assert check_signed(forged, payload + b"!", sender.peer_id) == (
        "the payload's key is not its sender's"
    )
    unsigned = type(info)(group_id=group, step=7, state_hash=state)
    assert check_signed(unsigned, payload, sender.peer_id) is not None
