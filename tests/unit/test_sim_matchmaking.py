"""DiLoCo's matchmaking (the real `form_group`) among simulated peers, in virtual time."""

from __future__ import annotations

import dataclasses

import trio

from swarmd.node.averaging.allreduce import Group, Member
from swarmd.node.averaging.attendance import Gathered
from swarmd.node.averaging.matchmaking import form_group
from swarmd.node.dht.config import DHTConfig
from swarmd.node.sim.dht import DhtSwarm
from swarmd.node.sim.matchmaking import MatchScenario, run_matchmaking, with_target
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.virtual import run_virtual


def test_peers_that_fit_one_group_all_meet_every_round() -> None:
    report = run_matchmaking(with_target(MatchScenario(peers=12, rounds=2, seed=1), 16))
    for figures in report.rounds:
        assert (figures.groups, figures.sizes, figures.alone) == (1, (12,), 0)
        assert figures.inconsistent == 0 and figures.missing == 0
        # Everyone was there within the 2 s arrival spread: nobody waits out the 5 s gather.
        assert figures.max_form_s < 5.0


def test_groups_never_exceed_the_target_and_holders_agree_on_their_members() -> None:
    report = run_matchmaking(with_target(MatchScenario(peers=20, rounds=2, seed=2), 4))
    for figures in report.rounds:
        assert figures.inconsistent == 0
        assert all(2 <= size <= 4 for size in figures.sizes)
        assert sum(figures.sizes) - figures.missing + figures.alone == 20


async def _excused_came(lead_excuses: bool) -> set[tuple[int, ...]]:
    """Three simulated peers under one round key. The one with the lowest id (it leads)
    counts only two of them, the other two count all three; ``lead_excuses``: it also tells
    its gathering which of the others it excused. The excused peer announces at once with
    the leader, the expected one a second later (inside the gather window)."""
    swarm = DhtSwarm(3, NetworkConfig(), DHTConfig(), seed=7)
    order = sorted(range(3), key=lambda i: swarm.nodes[i].peer_id)
    lead, excused, late = order
    members = [Member(n.peer_id, h.address) for n, h in zip(swarm.nodes, swarm.hosts, strict=True)]
    mm = with_target(MatchScenario(peers=3), 3).matchmaking
    groups: dict[int, Group | None] = {}

    async def one(i: int, delay: float, target: int, gathered: Gathered) -> None:
        await trio.sleep(delay)
        cfg = dataclasses.replace(mm, target_group_size=target)
        groups[i] = await form_group(swarm.nodes[i], "sim/excused", members[i], cfg, gathered)

    async with trio.open_nursery() as nursery:
        await swarm.join(nursery, 5.0)
        excuses = frozenset({members[excused].peer_id}) if lead_excuses else frozenset()
        async with trio.open_nursery() as rnd:
            rnd.start_soon(one, lead, 0.0, 2, Gathered(excused=excuses, most=3))
            rnd.start_soon(one, excused, 0.0, 3, Gathered())
            rnd.start_soon(one, late, 1.0, 3, Gathered())
        nursery.cancel_scope.cancel()
    return {
        tuple(sorted(members.index(m) for m in g.members)) if g else (i,) for i, g in groups.items()
    }


def test_an_excused_peer_that_comes_is_waited_for_with_the_expected_ones() -> None:
    """A peer not waiting for another (attendance.py) that announces anyway waits for the
    peer it did expect too: the three form one group. Counting the excused peer toward the
    smaller target instead formed a pair at once and left the expected peer alone, under a
    state key the pair then left (the split `swarmd chaos` ended a CI run in)."""
    assert run_virtual(_excused_came, True, seed=7) == {(0, 1, 2)}
    # Without the excuse told, the leader's smaller target splits the three: the scenario
    # is the one that breaks.
    assert run_virtual(_excused_came, False, seed=7) != {(0, 1, 2)}
