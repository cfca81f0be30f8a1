"""Which state an unsure stage server takes: the one most of its stage's servers hold.

A pure rule over (state hash, round) pairs, so every server of a stage that reads the same
adverts picks the same state, and so it can be tested without a stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Advert(Protocol):
    """What the rule reads of a state advert (statesync's StateAdvert)."""

    @property
    def owner(self) -> str: ...
    @property
    def state_hash(self) -> bytes: ...
    @property
    def round(self) -> int: ...


A = TypeVar("A", bound=Advert)


def countable(adverts: Iterable[A], known: set[str], mine: bytes) -> list[A]:
    """The adverts an unsure server counts: those of servers it has met (averaged with or
    downloaded from; all of them while it has met nobody), and a stranger's only when it
    holds a state a met server holds, or this server's own.

    Met servers alone was the first rule: a joiner that grouped with one of two servers was
    a stranger to the other, which then saw one holder against its own one and kept its
    state whenever its hash sorted higher (seen: 6 rounds split). A stranger can now add
    weight to a state an honest server holds, never pull the stage to a state of its own."""
    adverts = list(adverts)
    if not known:
        return adverts
    held = {a.state_hash for a in adverts if a.owner in known} | {mine}
    return [a for a in adverts if a.owner in known or a.state_hash in held]


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
