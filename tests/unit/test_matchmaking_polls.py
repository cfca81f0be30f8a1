"""Matchmaking's DHT polling schedule: backed off, and always ending with a read at the
deadline (a stale last read is how peers came to disagree on who was in a group)."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from swarmd.node.averaging.announcements import Waits
from swarmd.node.averaging.matchmaking import MatchmakingConfig


def test_polls_back_off_to_the_cap() -> None:
    cfg = MatchmakingConfig(poll_s=0.1, poll_growth=2.0, max_poll_s=0.5)
    polls = cfg.polls()
    assert [round(next(polls), 6) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_reads_end_exactly_at_the_deadline() -> None:
    cfg = MatchmakingConfig(gather_s=3.0, poll_s=0.1, poll_growth=1.5, max_poll_s=1.0)
    reads: list[float] = []
    light: list[bool] = []

    async def main() -> None:
        start = trio.current_time()
        waits = Waits(cfg.polls(), cfg.gather_s)
        while True:
            reads.append(round(trio.current_time() - start, 6))
            light.append(waits.light)
            if not await waits.sleep(trio.Event()):  # nothing ever lands here
                break

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert reads[:3] == [0.0, 0.1, 0.25]
    assert reads[-1] == 3.0  # one last read at the deadline, however long the last wait
    # The reads in between only look for an early stop; the first and the deadline read
    # decide who is in the group, so they ask the quorum.
    assert light == [False] + [True] * (len(reads) - 2) + [False]
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert max(gaps) <= cfg.max_poll_s + 1e-9
    assert len(reads) < 3.0 / cfg.poll_s / 2  # far fewer reads than steady 0.1 s polling


def test_a_record_landing_here_ends_the_sleep_and_the_next_read_is_local() -> None:
    cfg = MatchmakingConfig(gather_s=10.0, poll_s=2.0, poll_growth=1.0, max_poll_s=2.0)
    reads: list[tuple[float, bool, bool]] = []

    async def main() -> None:
        start = trio.current_time()
        waits = Waits(cfg.polls(), cfg.gather_s)
        stored = trio.Event()

        async def lands() -> None:
            await trio.sleep(0.3)
            stored.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lands)
            for _ in range(3):
                reads.append((round(trio.current_time() - start, 6), waits.woken, waits.light))
                await waits.sleep(stored)
                stored = trio.Event() if stored.is_set() else stored

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # Woken at 0.3 s (not at the 2 s poll) and that read is local; the next sleep is a poll.
    assert reads == [(0.0, False, False), (0.3, True, True), (2.3, False, True)]


@pytest.mark.parametrize(
    "kwargs",
    [{"poll_growth": 0.5}, {"poll_s": 0.5, "max_poll_s": 0.2}, {"poll_s": 0.0}],
)
def test_bad_poll_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="poll"):
        MatchmakingConfig(**kwargs)  # type: ignore[arg-type]
