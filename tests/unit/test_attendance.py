"""Whom a round waits for: a live peer waited for that did not come is not waited for in the
next rounds, for 1, 2, 4 and at most MAX_SKIP rounds after misses in a row (attendance.py)."""

from __future__ import annotations

import hashlib

from swarmd.node.averaging.attendance import MAX_SKIP, Attendance, Gathered
from swarmd.protocol.identity import PeerId


def pid(name: str) -> PeerId:
    return PeerId(hashlib.sha256(name.encode()).digest())


ME, HONEST, STALLER, LATE = pid("me"), pid("honest"), pid("staller"), pid("late")


def test_a_staller_is_waited_for_in_rounds_further_and_further_apart() -> None:
    att = Attendance()
    live = [ME, HONEST, STALLER]
    waited = []
    for r in range(1, 41):
        expected = att.expected(live)
        waited.append(expected == 3)
        # The round's gathering: a wait for three runs to its deadline; a wait for two ends
        # as soon as the two honest peers are there.
        att.record(live, Gathered(announced={ME, HONEST}, short=expected == 3))
        assert att.expected(live) in (2, 3), r
    assert [r for r, w in enumerate(waited, 1) if w] == [1, 3, 6, 11, 20, 29, 38]
    assert MAX_SKIP == 8  # the spacing at the end of that list


def test_a_round_that_reached_its_target_early_marks_nobody() -> None:
    """Those who had not announced yet were not waited for: they may be merely slower."""
    att = Attendance()
    live = [ME, HONEST, LATE]
    assert att.record(live, Gathered(announced={ME, HONEST}, short=False)) == set()
    assert att.expected(live) == 3


def test_a_peer_seen_announcing_is_waited_for_again_at_once() -> None:
    att = Attendance()
    live = [ME, HONEST, LATE]
    for _ in range(3):  # missed, skipped, missed again: not waited for in two rounds
        att.record(live, Gathered(announced={ME, HONEST}, short=att.expected(live) == 3))
    assert att.absent == {LATE}
    att.record(live, Gathered(announced={ME, HONEST, LATE}, short=False))  # it came anyway
    assert att.absent == set() and att.expected(live) == 3
    # And its misses start again from one.
    assert att.record(live, Gathered(announced={ME, HONEST}, short=True)) == {LATE}
    att.record(live, Gathered(announced={ME, HONEST}, short=False))
    assert att.expected(live) == 3


def test_a_peer_whose_heartbeat_lapsed_is_forgotten() -> None:
    att = Attendance()
    att.record([ME, STALLER], Gathered(announced={ME}, short=True))
    assert att.absent == {STALLER}
    att.record([ME, HONEST], Gathered(announced={ME, HONEST}, short=False))
    assert att.absent == set()  # the record never outgrows the live peers
    # Back, it is a newcomer again (it must take the state and train a round first): not
    # waited for in its first round, then waited for with its old misses forgotten.
    assert att.expected([ME, STALLER]) == 1
    att.record([ME, STALLER], Gathered(announced={ME}, short=False))
    assert att.expected([ME, STALLER]) == 2


def test_each_excused_peer_that_comes_raises_the_wait_up_to_the_largest_group() -> None:
    att = Attendance()
    live = [ME, HONEST, STALLER, LATE]
    att.record(live, Gathered(announced={ME, HONEST}, short=True))  # two missed
    assert att.target(live, 2, 3) == 2
    gathering = att.gathering(live, most=3)
    assert gathering.excused == {STALLER, LATE}
    assert gathering.wanted(2, [ME, HONEST]) == 2
    assert gathering.wanted(2, [ME, STALLER]) == 3  # the excused one came: HONEST too
    assert gathering.wanted(2, [ME, STALLER, LATE]) == 3  # never past the largest group
    # A peer whose heartbeat lapsed is not excused any more (nor waited for).
    assert att.gathering([ME, HONEST, LATE], most=3).excused == {LATE}


def test_stallers_first_seen_in_different_rounds_come_due_together() -> None:
    """Two stallers' heartbeats are read in round 1, the third's only in round 2. Each on its
    own schedule, the first two came due in round 3 and the third in round 4: every round
    waited (CI). On one schedule they come due together: the third is new in round 2 (not
    waited for in its first round), all three are waited for in round 3, then not in rounds
    4 and 5, then in round 6."""
    a, b, c = pid("a"), pid("b"), pid("c")
    att = Attendance()
    waited = []
    for r in range(1, 8):
        live = [ME, HONEST, a, b] + ([c] if r > 1 else [])
        waits = att.expected(live) > 2
        waited.append(waits)
        att.record(live, Gathered(announced={ME, HONEST}, short=waits))
    assert waited == [True, False, True, False, False, True, False]


def test_a_peer_new_after_the_first_round_is_not_waited_for_in_its_first() -> None:
    """A joiner heartbeats once it holds the run's state, then trains a round before it can
    announce: the round its heartbeat appears in is not held for it. At this peer's own
    first round every peer is new and all are waited for (a run's start)."""
    att = Attendance()
    assert att.expected([ME, HONEST]) == 2
    att.record([ME, HONEST], Gathered(announced={ME, HONEST}, short=False))
    assert att.expected([ME, HONEST, LATE]) == 2
    gathering = att.gathering([ME, HONEST, LATE], most=3)
    assert gathering.excused == {LATE}
    assert gathering.wanted(2, [ME, HONEST, LATE]) == 3  # it came anyway: one more waited for
    att.record([ME, HONEST, LATE], Gathered(announced={ME, HONEST}, short=False))
    assert att.expected([ME, HONEST, LATE]) == 3  # its second round: waited for


def test_a_short_round_with_nobody_new_missing_does_not_put_the_absent_off_again() -> None:
    """A lone honest peer is held at min_group_size: its rounds fall short with no one new
    missing. The staller still comes due on its own schedule (after 1 round, here)."""
    att = Attendance()
    live = [ME, STALLER]
    att.record(live, Gathered(announced={ME}, short=True))  # the staller's first miss
    assert att.absent == {STALLER}
    att.record(live, Gathered(announced={ME}, short=True))  # alone again, nobody new
    assert att.absent == set()


def test_an_excused_peer_that_comes_raises_the_wait_no_further_than_the_live_peers() -> None:
    """Two peers of a min_group_size-2 run, the joiner new in its first round: it is excused
    (one waited for), yet min_group_size already raises the target to 2. When it comes the
    wait is for the 2 there are, not 3 (all waited out the whole gather window: a 1 s round
    took 10.5 s)."""
    att = Attendance()
    att.record([ME], Gathered(announced={ME}, short=False))
    live = [ME, LATE]
    assert att.target(live, 2, 16) == 2 and att.expected(live) == 1
    gathering = att.gathering(live, most=16)
    assert gathering.excused == {LATE}
    assert gathering.wanted(2, [ME, LATE]) == 2
    # The same with min_group_size 3 and three live, one of them new.
    att = Attendance()
    att.record([ME, HONEST], Gathered(announced={ME, HONEST}, short=False))
    live = [ME, HONEST, LATE]
    assert att.target(live, 3, 16) == 3
    assert att.gathering(live, most=16).wanted(3, [ME, HONEST, LATE]) == 3


def test_the_first_of_two_excused_peers_to_come_keeps_the_wait_for_the_second() -> None:
    """Three live peers, two of them excused, min_group_size 2: when one excused peer comes
    the round still waits for the other (3), else this peer and the first form a pair and
    the second, a moment later, is left alone on a line of its own."""
    att = Attendance()
    att.record([ME], Gathered(announced={ME}, short=False))
    live = [ME, HONEST, LATE]
    assert att.target(live, 2, 16) == 2
    gathering = att.gathering(live, most=16)
    assert gathering.excused == {HONEST, LATE}
    assert gathering.wanted(2, [ME, HONEST]) == 3
    assert gathering.wanted(2, [ME, HONEST, LATE]) == 3
