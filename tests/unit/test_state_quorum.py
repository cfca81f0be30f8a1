"""Which advertised states a joiner may take: the run's `state_quorum` (sharedstate.py)."""

from __future__ import annotations

from swarmd.node.peer.sharedstate import held_by_several
from swarmd.node.statesync.donor import StateAdvert


def _ad(owner: str, h: bytes, round_no: int = 5) -> StateAdvert:
    return StateAdvert(round_no, h * 32, f"127.0.0.1:{len(owner)}", 100, owner=owner)


def test_a_state_needs_the_quorum_of_distinct_keys_or_the_creator() -> None:
    liar = _ad("liar", b"L", round_no=10**6)
    honest = [_ad("a", b"H"), _ad("b", b"H")]
    assert held_by_several([liar, *honest], 1) == [liar, *honest]
    assert held_by_several([liar, *honest], 2) == honest
    assert held_by_several([liar, *honest], 3) == []
    # One key advertising twice is one holder.
    assert held_by_several([liar, _ad("liar", b"L")], 2) == []
    creator = _ad("creator", b"C")
    assert held_by_several([liar, creator], 2, anchor="creator") == [creator]
    assert held_by_several([liar, creator], 2, anchor=None) == []
