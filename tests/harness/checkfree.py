"""What a race for a lost SWARM stage must end in, read from the two racers' events: the
same check for racers that are processes (tests/integration) and simulated peers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def one_rebuild(before: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """The index of the racer that rebuilt the stage by CheckFree from its neighbours 0 and 2.

    `before` holds each racer's events up to and including its `stage` event. Exactly one
    racer rebuilds (the lease's holder, weighting its neighbours by their gradient norms);
    the other downloads the rebuilt state from the group and recovers nothing itself."""
    origins = sorted(seen[-1]["origin"] for seen in before)
    assert origins == ["checkfree", "group"], before  # one rebuild, one download of it
    k = [seen[-1]["origin"] for seen in before].index("checkfree")
    (rec,) = [e for e in before[k] if e["event"] == "stage_recovered"]
    assert rec["method"] == "checkfree" and rec["neighbours"] == [0, 2], rec
    assert abs(sum(rec["weights"]) - 1) < 1e-3 and min(rec["norms"]) > 0, rec
    assert not [e for e in before[1 - k] if e["event"] == "stage_recovered"]
    return k
