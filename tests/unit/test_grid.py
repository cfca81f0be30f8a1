"""The round's grid (averaging/grid.py): its shape, who serves which slot, the groups of each
level, and, averaged level by level as the peers do (weighted group means, takeovers), every
slot ending with the same exact mean."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from swarmd.node.averaging.grid import Grid, shape_for, takeover
from swarmd.protocol.identity import PeerId


def peers(n: int) -> list[PeerId]:
    return [PeerId(hashlib.sha256(f"peer{i}".encode()).digest()) for i in range(n)]


@pytest.mark.parametrize(
    ("n", "target", "shape"),
    [(1, 16, (1,)), (16, 16, (16,)), (17, 16, (5, 4)), (1000, 16, (10, 10, 10)),
     (20, 4, (3, 3, 3)), (256, 16, (16, 16)), (10, 3, (3, 2, 2))],
)  # fmt: skip
def test_the_shape_has_the_fewest_levels_and_axes_within_the_target(
    n: int, target: int, shape: tuple[int, ...]
) -> None:
    assert shape_for(n, target) == shape
    assert math.prod(shape) >= n and max(shape) <= target


def test_every_peer_plans_the_same_grid_and_each_round_another_order() -> None:
    live = peers(20)
    a = Grid.plan(live, 4, b"run/7")
    assert Grid.plan(reversed(live), 4, b"run/7") == a  # the order heartbeats were read in
    assert Grid.plan(live, 4, b"run/8").roster != a.roster
    with pytest.raises(ValueError):
        Grid(tuple(live[:3]) * 2, (6,))


def test_slots_cover_the_roster_and_every_peer_counts_once() -> None:
    grid = Grid.plan(peers(20), 4, b"r")
    assert grid.slots == 27
    assert sorted(k for p in grid.roster for k in grid.slots_of(p)) == list(range(27))
    assert math.isclose(sum(grid.share(grid.server(k)) for k in range(27)), 20)
    for level in range(grid.levels):
        for k in range(grid.slots):
            g = grid.group(k, level)
            assert k in g and len(g) == grid.shape[level]
            # Members differ in this level's coordinate only.
            others = [c[:level] + c[level + 1 :] for c in map(grid.coords, g)]
            assert len(set(others)) == 1
            assert grid.label(k, level) == grid.label(g[-1], level)


def average(grid: Grid, values: dict[PeerId, float], absent: set[PeerId]) -> dict[int, float]:
    """The levels as the peers run them, on scalars: each group's members contribute the
    weighted mean of the slots they hold in it; a lost slot is served by a survivor."""
    held: dict[PeerId, dict[int, tuple[float, float]]] = {
        p: {k: (values[p], grid.share(p)) for k in grid.slots_of(p)}
        for p in grid.roster
        if p not in absent
    }
    for level in range(grid.levels):
        nxt: dict[PeerId, dict[int, tuple[float, float]]] = {p: {} for p in held}
        groups = {grid.group(k, level) for slots in held.values() for k in slots}
        for g in groups:
            parts = [(p, [k for k in g if k in slots]) for p, slots in held.items()]
            parts = [(p, ks) for p, ks in parts if ks]
            weight = sum(held[p][k][1] for p, ks in parts for k in ks)
            mean = sum(held[p][k][0] * held[p][k][1] for p, ks in parts for k in ks) / weight
            came = {k for _, ks in parts for k in ks}
            lost = takeover(g, set(g) - came)
            for p, ks in parts:
                for k in [*ks, *(k for k, to in lost.items() if to in ks)]:
                    nxt[p][k] = (mean, weight)
        held = nxt
    return {k: v for slots in held.values() for k, (v, _) in slots.items()}


@pytest.mark.parametrize(("n", "target"), [(16, 4), (20, 4), (17, 16), (10, 3), (100, 8)])
def test_after_the_levels_every_slot_holds_the_exact_mean(n: int, target: int) -> None:
    rng = random.Random(n)
    roster = peers(n)
    values = {p: rng.gauss(0, 1) for p in roster}
    grid = Grid.plan(roster, target, b"round")
    final = average(grid, values, set())
    assert sorted(final) == list(range(grid.slots))  # every slot served to the end
    exact = sum(values.values()) / n
    assert all(math.isclose(v, exact, rel_tol=1e-12, abs_tol=1e-12) for v in final.values())


def test_slots_of_peers_that_never_came_are_served_and_the_rest_still_agree() -> None:
    rng = random.Random(3)
    roster = peers(30)
    values = {p: rng.gauss(0, 1) for p in roster}
    grid = Grid.plan(roster, 4, b"round")
    absent = set(rng.sample(roster, 4))
    final = average(grid, values, absent)
    assert sorted(final) == list(range(grid.slots))
    came = [v for p, v in values.items() if p not in absent]
    exact = sum(came) / len(came)
    assert all(math.isclose(v, exact, rel_tol=1e-12) for v in final.values()), final


def test_takeover_deals_lost_slots_to_survivors_in_turn() -> None:
    assert takeover((0, 1, 2, 3), {1, 3}) == {1: 0, 3: 2}
    assert takeover((0, 1, 2), {0, 1}) == {0: 2, 1: 2}
    assert takeover((0, 1), {0, 1}) == {}
    # A survivor that would clash is passed over for the next; if all clash, the turn's own.
    assert takeover((0, 1, 2, 3), {1}, lambda k, s: s == 0) == {1: 2}
    assert takeover((0, 1, 2), {1}, lambda k, s: True) == {1: 0}


def test_a_takeover_avoids_a_peer_that_would_hold_two_slots_of_one_upper_group() -> None:
    """20 peers in 27 slots: peer k mod 20 serves slots k and k + 20. A lost slot goes to the
    next survivor whose peer's other slot would not share a group with it above this level
    (the weighted mean of two blocks, rounded by a lossy codec, is not what the other groups
    round)."""
    grid = Grid.plan(peers(20), 4, b"r")
    assert grid.shape == (3, 3, 3)
    row = grid.group(0, 0)  # slots 0, 1, 2: their peers also serve 20, 21, 22
    clash = [s for s in row if s != 1 and grid.clashes(1, s, 0)]
    for survivor in row:
        if survivor == 1:
            continue
        other = grid.slots_of(grid.server(survivor))
        shared = any(
            t != survivor and t in grid.group(1, level)
            for t in other
            for level in range(1, grid.levels)
        )
        assert grid.clashes(1, survivor, 0) == shared
    chosen = takeover(row, {1}, lambda k, s: grid.clashes(k, s, 0))[1]
    assert chosen not in clash or len(clash) == 2
