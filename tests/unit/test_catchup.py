"""Which advertised state a peer takes instead of its own (swarmd.node.statesync.catchup)."""

from __future__ import annotations

from swarmd.node.statesync.catchup import state_to_take
from swarmd.node.statesync.donor import StateAdvert
from swarmd.node.statesync.snapshot import HASH_BYTES


def h(name: str) -> bytes:
    return name.encode().ljust(HASH_BYTES, b"\0")


def ad(round_no: int, name: str, port: int = 1, *, shared: bool = False) -> StateAdvert:
    """An advert; ``shared``: its peer averaged that state in a group (or downloaded it)."""
    return StateAdvert(round_no, h(name), f"10.77.0.{port}:7000", 1000, shared=shared)


GROUP = "group"


def test_lone_peer_ahead_in_rounds_takes_the_groups_state() -> None:
    # Cut off after round 4, it made rounds 5..8 alone; the other three averaged up to 7.
    others = [ad(7, GROUP, 1), ad(7, GROUP, 2), ad(7, GROUP, 3)]
    assert state_to_take(others, my_round=8, my_hash=h("lone"), shared_round=4) == h(GROUP)


def test_lone_peer_ignores_adverts_from_before_it_was_cut_off() -> None:
    # While cut off it still sees what it last heard: states it already had or passed.
    stale = [ad(3, "r3", 1), ad(3, "r3", 2), ad(4, "r4", 3)]
    assert state_to_take(stale, my_round=6, my_hash=h("lone"), shared_round=4) is None


def test_shared_peer_ignores_a_lone_peer_one_round_ahead() -> None:
    others = [ad(7, GROUP, 1), ad(7, GROUP, 2), ad(8, "lone", 3)]
    assert state_to_take(others, my_round=7, my_hash=h(GROUP), shared_round=7) is None


def test_late_peer_follows_the_group_to_a_newer_round() -> None:
    others = [ad(8, "new", 1), ad(8, "new", 2), ad(8, "new", 3)]
    assert state_to_take(others, my_round=7, my_hash=h(GROUP), shared_round=7) == h("new")


def test_newer_state_of_one_peer_is_taken_when_nobody_else_holds_ours() -> None:
    # A two-peer run: the partner went on alone while this peer was slow.
    others = [ad(8, "partner", 1)]
    assert state_to_take(others, my_round=7, my_hash=h(GROUP), shared_round=7) == h("partner")


def test_two_groups_of_a_split_pick_the_same_state() -> None:
    a1, a2 = ad(5, "a", 1, shared=True), ad(5, "a", 2, shared=True)
    b3, b4 = ad(5, "b", 3, shared=True), ad(5, "b", 4, shared=True)
    left = [a1, b3, b4]  # seen by a peer holding "a"
    right = [a1, a2, b4]  # seen by a peer holding "b"
    take_left = state_to_take(left, my_round=5, my_hash=h("a"), shared_round=5)
    take_right = state_to_take(right, my_round=5, my_hash=h("b"), shared_round=5)
    # Exactly one side moves, to the other side's state.
    assert {take_left, take_right} in ({None, h("a")}, {None, h("b")})
    assert (take_left or h("a")) == (take_right or h("b"))


def test_two_lone_peers_agree_on_one_of_their_states() -> None:
    a = state_to_take([ad(9, "b", 2)], my_round=8, my_hash=h("a"), shared_round=4)
    b = state_to_take([ad(8, "a", 1)], my_round=9, my_hash=h("b"), shared_round=4)
    assert a == h("b") and b is None  # the newer one wins on both sides


def test_same_state_or_nothing_advertised_keeps_ours() -> None:
    assert state_to_take([], my_round=3, my_hash=h(GROUP), shared_round=3) is None
    assert state_to_take([], my_round=5, my_hash=h("lone"), shared_round=3) is None
    same = [ad(3, GROUP, 1), ad(3, GROUP, 2)]
    assert state_to_take(same, my_round=3, my_hash=h(GROUP), shared_round=3) is None
    older = [ad(2, "old", 1)]
    assert state_to_take(older, my_round=3, my_hash=h(GROUP), shared_round=3) is None


def creator(round_no: int, name: str, *, shared: bool = True) -> StateAdvert:
    return StateAdvert(round_no, h(name), "10.77.0.9:7000", 1000, owner="creator", shared=shared)


def test_groups_that_never_met_converge_on_the_creators_state() -> None:
    # The run's first round formed two pairs: {creator, p1} hold "a", {p2, p3} hold "b". Each
    # pair follows only peers it met, so each sees its own side plus the creator.
    p1 = state_to_take(
        [creator(5, "a")], my_round=5, my_hash=h("a"), shared_round=5, anchor=creator(5, "a")
    )
    p2 = [creator(5, "a"), ad(5, "b", 4)]  # p2 sees p3 and the creator
    take_p2 = state_to_take(p2, my_round=5, my_hash=h("b"), shared_round=5, anchor=p2[0])
    assert p1 is None and take_p2 == h("a")
    # Without the anchor the pair holding "b" counts two holders against one and stays apart.
    assert state_to_take(p2, my_round=5, my_hash=h("b"), shared_round=5) is None


def test_the_creators_side_keeps_its_state_however_many_hold_another() -> None:
    # Four peers that all met split 2 / 3: counting alone would move the creator's pair to the
    # three's state while the three move to the creator's (the sides would swap).
    seen = [creator(5, "a"), ad(5, "b", 2), ad(5, "b", 3), ad(5, "b", 4)]
    assert state_to_take(seen, my_round=5, my_hash=h("a"), shared_round=5, anchor=seen[0]) is None


def test_the_creators_line_is_followed_whatever_its_round() -> None:
    # The creator's pair is a round ahead of this pair, or two behind (seen: two pairs running
    # two rounds apart at the same pace).
    for theirs in (6, 3):
        seen = [creator(theirs, "a"), ad(5, "b", 4)]
        assert state_to_take(seen, 5, h("b"), 5, anchor=seen[0], past=[h("b4")]) == h("a")


def test_a_creator_late_on_this_peers_own_line_is_not_followed() -> None:
    # The creator has not published this round yet: its advert is a state this peer held.
    seen = [creator(4, "g4"), ad(5, GROUP, 2)]
    past = [h("g3"), h("g4"), h(GROUP)]
    assert state_to_take(seen, 5, h(GROUP), 5, anchor=seen[0], past=past) is None


def test_a_lone_creator_anchors_nothing() -> None:
    # The creator's last round was its own: the others must not follow a state only it holds.
    seen = [creator(5, "lone", shared=False), ad(5, GROUP, 2), ad(5, GROUP, 3)]
    assert state_to_take(seen, 5, h(GROUP), 5, anchor=seen[0]) is None


def test_a_peer_that_made_lone_rounds_counts_the_creator_as_one_vote() -> None:
    seen = [creator(7, "c"), ad(7, GROUP, 2), ad(7, GROUP, 3)]
    assert state_to_take(seen, 8, h("lone"), 4, anchor=seen[0]) == h(GROUP)


def test_shared_flag_travels_in_the_advert() -> None:
    for shared in (False, True):
        advert = StateAdvert(5, h("a"), "10.77.0.9:7000", 1000, shared=shared)
        assert StateAdvert.from_bytes(advert.to_bytes()).shared is shared


def test_the_creator_keeps_its_shared_state_against_another_of_its_round() -> None:
    # Two honest members ended a round with different states (one fell back alone on a part):
    # the other takes the creator's; the creator must not take the other's on the tie-break.
    other = [ad(5, "zzz", 2, shared=True)]  # a hash that wins the tie-break
    assert state_to_take(other, 5, h("a"), 5) == h("zzz")
    assert state_to_take(other, 5, h("a"), 5, i_anchor=True) is None
    # A newer state the group holds is still followed, and a lone creator follows the group.
    newer = [ad(6, "g", 2), ad(6, "g", 3)]
    assert state_to_take(newer, 5, h("a"), 5, i_anchor=True) == h("g")
    group = [ad(5, "g", 2), ad(5, "g", 3)]
    assert state_to_take(group, 6, h("lone"), 4, i_anchor=True) == h("g")


def test_a_state_made_alone_loses_a_tie_to_a_shared_one_on_both_sides() -> None:
    """Three peers; the third, paused through round 5's all-reduce, stepped round 5 alone
    ("zzz", a hash that wins a tie-break). The member that averaged round 5 sees the lone
    state and its partner's advert still at round 4: one holder against one. It took the
    lone state on its hash, its partner kept the round's, and the run ended on two states
    (CI: test_chaos). Now it keeps its own, and the lone peer takes the round's."""
    seen_by_member = [ad(4, "r4", 1, shared=True), ad(5, "zzz", 3)]
    assert state_to_take(seen_by_member, 5, h("r5"), 5, past=[h("r4")]) is None
    seen_by_lone = [ad(4, "r4", 1, shared=True), ad(5, "r5", 2, shared=True)]
    assert state_to_take(seen_by_lone, 5, h("zzz"), 4) == h("r5")
    # Two lone states still settle on the newer one, and more holders still win.
    assert state_to_take([ad(6, "b", 2)], 5, h("zzz"), 4) == h("b")
    assert state_to_take([ad(5, "g", 1), ad(5, "g", 2)], 5, h("zzz"), 5) == h("g")
