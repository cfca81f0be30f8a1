"""Which state an unsure stage server takes: the one most of its stage's servers hold.

A pure rule over (state hash, round) pairs, so every server of a stage that reads the same
adverts picks the same state, and so it can be tested without a stage.
"""

from __future__ import annotations

from collections.abc import Iterable


def state_to_follow(mine: bytes, my_round: int, others: Iterable[tuple[bytes, int]]) -> bytes:
    """The state hash this server should hold: the one most servers of the stage hold, this
    one included (ties: the later round, then the higher hash, so two servers that drifted
    apart pick the same one and meet again).

    Older rounds count like newer ones. A first rule skipped adverts of a round before this
    server's (a slow server's advert of the round it has not finished publishing): a server
    that got ahead of its stage's majority in round count (the majority's round overran a
    period, the minority's did not) then never saw them and they never took its lone state,
    and the stage stayed split for the rest of the run (seen in CI). A stale advert costs at
    most one round spent on the older state; the next look heals it."""
    holders: dict[bytes, tuple[int, int]] = {mine: (1, my_round)}
    for state_hash, round_ in others:
        n, r = holders.get(state_hash, (0, 0))
        holders[state_hash] = (n + 1, max(r, round_))
    return max(holders, key=lambda h: (*holders[h], h))
