"""Group formation at scale in virtual time: N peers, each a real DHTNode on the simulated
network, run the real `form_group` round after round under one key per round, as DiLoCo
peers holding one state do. What it measures is what issue 46 asks about: how many groups
form, how many peers are left alone, how long forming takes, and whether the members of a
group all agree on who is in it."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from swarmd.node.averaging.allreduce import Group, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht.config import DHTConfig
from swarmd.node.sim.dht import DhtSwarm
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.virtual import run_virtual


@dataclass(frozen=True)
class MatchScenario:
    peers: int = 100
    rounds: int = 3
    #: Peers become ready for a round at uniform random times over this many virtual seconds
    #: (their inner steps end at different times).
    arrival_spread_s: float = 2.0
    #: Virtual seconds between one round's end and the next round's first arrival.
    compute_s: float = 10.0
    join_window_s: float = 60.0
    seed: int = 0
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)

    def __post_init__(self) -> None:
        if self.peers < 2 or self.rounds < 1:
            raise ValueError("a matchmaking scenario needs 2+ peers and 1+ rounds")
        if self.arrival_spread_s < 0 or self.compute_s < 0 or self.join_window_s < 0:
            raise ValueError("arrival_spread_s, compute_s and join_window_s must be >= 0")


@dataclass(frozen=True)
class RoundFigures:
    groups: int
    #: Sizes of the groups formed, largest first.
    sizes: tuple[int, ...]
    #: Peers that got no group (they would average alone).
    alone: int
    #: Members named in a group that did not join it (they followed another leader, or went
    #: on alone): the design lets the all-reduce drop them at its deadline, which costs the
    #: group that deadline.
    missing: int
    #: Peers holding a round id whose member list differs from another holder's, or does not
    #: name them: must be 0 (the round id covers the list).
    inconsistent: int
    median_form_s: float
    max_form_s: float


@dataclass(frozen=True)
class MatchReport:
    peers: int
    rounds: tuple[RoundFigures, ...]
    log_hash: str
    calls: int
    virtual_s: float
    wall_s: float

    @property
    def mean_alone(self) -> float:
        return statistics.fmean(r.alone for r in self.rounds)

    @property
    def mean_groups(self) -> float:
        return statistics.fmean(r.groups for r in self.rounds)


def _figures(results: dict[int, tuple[Group | None, float]], members: list[Member]) -> RoundFigures:
    by_round: dict[bytes, list[Group]] = {}
    alone = unnamed = 0
    for i, (group, _) in results.items():
        if group is None or len(group.members) < 2:
            alone += 1
            continue
        by_round.setdefault(group.round_id, []).append(group)
        unnamed += group.index_of(members[i].peer_id) is None
    # A round id covers its member list, so members that agree hold equal groups; a member
    # that holds a round id must also be named in it, and all named should hold it.
    missing = inconsistent = 0
    sizes = []
    for groups in by_round.values():
        named = len(groups[0].members)
        sizes.append(named)
        inconsistent += sum(g.members != groups[0].members for g in groups)
        missing += max(0, named - len(groups))
    times = sorted(t for _, t in results.values())
    return RoundFigures(
        groups=len(by_round),
        sizes=tuple(sorted(sizes, reverse=True)),
        alone=alone,
        missing=missing,
        inconsistent=inconsistent + unnamed,
        median_form_s=statistics.median(times),
        max_form_s=times[-1],
    )


async def _scenario(scenario: MatchScenario, progress: Callable[[str], None]) -> MatchReport:
    wall0 = time.monotonic()
    swarm = DhtSwarm(scenario.peers, scenario.network, scenario.dht, scenario.seed)
    rng = random.Random(scenario.seed + 2)
    members = [
        Member(node.peer_id, host.address)
        for node, host in zip(swarm.nodes, swarm.hosts, strict=True)
    ]
    figures: list[RoundFigures] = []
    t0 = trio.current_time()
    # DiLoCo waits for as many peers as are alive, within the run's bounds (membership.py's
    # group_target); here every peer is alive and heartbeating.
    cfg = scenario.matchmaking
    live_target = max(cfg.min_group_size, min(cfg.target_group_size, scenario.peers))
    mm = dataclasses.replace(cfg, target_group_size=live_target)
    async with trio.open_nursery() as nursery:
        progress(f"joining {scenario.peers} peers over {scenario.join_window_s:g} virtual s")
        await swarm.join(nursery, scenario.join_window_s)
        for r in range(scenario.rounds):
            results: dict[int, tuple[Group | None, float]] = {}

            async def one(
                i: int, delay: float, key: str, out: dict[int, tuple[Group | None, float]]
            ) -> None:
                await trio.sleep(delay)
                start = trio.current_time()
                group = await form_group(swarm.nodes[i], key, members[i], mm)
                out[i] = (group, trio.current_time() - start)

            async with trio.open_nursery() as round_nursery:
                for i in range(scenario.peers):
                    delay = rng.uniform(0, scenario.arrival_spread_s)
                    round_nursery.start_soon(one, i, delay, f"sim/mm/{r}", results)
            figures.append(_figures(results, members))
            f = figures[-1]
            progress(
                f"[{time.monotonic() - wall0:7.1f}s wall] round {r}: {f.groups} group(s) "
                f"{list(f.sizes)[:8]}, {f.alone} alone, {f.missing} named but missing, forming "
                f"took {f.median_form_s:.1f}s median, {f.max_form_s:.1f}s max (virtual)"
            )
            await trio.sleep(scenario.compute_s)
        nursery.cancel_scope.cancel()
    return MatchReport(
        peers=scenario.peers,
        rounds=tuple(figures),
        log_hash=swarm.net.trace.hexdigest(),
        calls=swarm.net.calls,
        virtual_s=trio.current_time() - t0,
        wall_s=time.monotonic() - wall0,
    )


def run_matchmaking(
    scenario: MatchScenario, progress: Callable[[str], None] | None = None
) -> MatchReport:
    return run_virtual(_scenario, scenario, progress or (lambda _: None), seed=scenario.seed)


def with_target(scenario: MatchScenario, target: int, minimum: int = 2) -> MatchScenario:
    """The scenario with another group size (what issue 46's runs vary)."""
    mm = dataclasses.replace(scenario.matchmaking, target_group_size=target, min_group_size=minimum)
    return dataclasses.replace(scenario, matchmaking=mm)


__all__ = ["MatchReport", "MatchScenario", "run_matchmaking", "with_target"]
