"""When a SWARM stage server's round happens and how long it gathers (stage_clock.py)."""

from __future__ import annotations

import pytest

from swarmd.node.algorithms.swarm.stage_clock import next_boundary, stage_matchmaking


def test_a_round_slightly_late_keeps_its_boundary_and_a_later_one_takes_the_next() -> None:
    # Period 3 s, gather 1.5 s: a boundary passed less than 0.5 s ago is still this round's.
    assert next_boundary(9.3, 3.0, last=2, gather_s=1.5) == 3
    assert next_boundary(9.6, 3.0, last=2, gather_s=1.5) == 4
    assert next_boundary(8.9, 3.0, last=1, gather_s=1.5) == 3  # waits for the one ahead


def test_a_boundary_is_never_used_twice() -> None:
    # A round that ended within a third of the gather of the boundary it used goes on to the
    # next, not back to the same one (its key would hold its own group of the last round).
    assert next_boundary(9.1, 3.0, last=3, gather_s=1.5) == 4


@pytest.mark.parametrize("round_s, gather", [(0.2, 0.5), (3.0, 1.5), (60.0, 5.0)])
def test_a_stage_round_gathers_half_its_period_within_bounds(round_s: float, gather: float) -> None:
    mm = stage_matchmaking(round_s, target=3)
    assert (mm.gather_s, mm.target_group_size, mm.min_group_size) == (gather, 3, 1)
