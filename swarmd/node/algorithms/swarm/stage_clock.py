"""When a SWARM stage round happens, and how long its servers gather for it.

Stage rounds run on the wall clock's `round_s` boundaries, so a stage's servers meet without
talking first (server_role.py)."""

from __future__ import annotations

import math

from swarmd.node.averaging.matchmaking import MatchmakingConfig


def next_boundary(now: float, period: float, last: int, gather_s: float) -> int:
    """The boundary (in periods since the epoch) of a server's next round at wall time
    `now`: the one just passed if it passed less than a third of the gather ago (a round
    that overran its period by a little still meets the others, whose gather waits for it;
    measured: under load, rounds that overran split 2-server stages for a round each), else
    the next one; never a boundary already used (`last`)."""
    r = math.floor(now / period)
    if now - r * period > gather_s / 3:
        r += 1
    return max(r, last + 1)


def stage_matchmaking(round_s: float, target: int) -> MatchmakingConfig:
    """A stage round's gathering: half the period (0.5 to 5 s), for `target` servers."""
    gather = min(5.0, max(0.5, round_s / 2))
    return MatchmakingConfig(
        target_group_size=target,
        min_group_size=1,
        gather_s=gather,
        commit_wait_s=gather + 2.0,
        ttl_s=60.0,
    )
