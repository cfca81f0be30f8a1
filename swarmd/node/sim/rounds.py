"""DiLoCo's communication at scale in virtual time: N peers of different speeds, each round
their inner steps (charged as virtual time), the real `form_group` under the round's key, and
the real all-reduce (Averager) of a vector with the group; a share of the peers replaced
every round. What it measures is what issue 45 asks of a 1,000-peer DiLoCo run and what
issue 46 needs: group formation time, rounds averaged, bytes per peer, peers left alone.

What it leaves out: the model (the vector is random, so no loss is reported) and state sync
(a replacement peer starts at the round the live peers are in, as if it had downloaded their
state); every peer holds the same state line, so one key per round is what real peers use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import trio

from swarmd.node.averaging.allreduce import Averager, Member
from swarmd.node.averaging.codecs import CodecName
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht.config import DHTConfig
from swarmd.node.sim.dht import DhtSwarm
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.virtual import run_virtual

FaultKind = Literal["kill", "partition", "slow", "liar"]
LIES = ("weight", "scale100", "signflip")


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: when the run enters ``at_round``, ``share`` of the live peers
    (drawn from the seed) are killed for good, cut off from the rest, slowed ``factor``
    times, or lie (chaos/byzantine.py's lies: a declared weight of 1e9, an update x100 or
    sign-flipped) for ``rounds`` rounds."""

    at_round: int
    kind: FaultKind
    share: float
    rounds: int = 1
    factor: float = 4.0
    lie: str = "weight"

    def __post_init__(self) -> None:
        if self.kind not in ("kill", "partition", "slow", "liar"):
            raise ValueError(f"fault kind {self.kind!r}: kill, partition, slow or liar")
        if self.at_round < 1 or self.rounds < 1:
            raise ValueError("a fault's at_round and rounds must be at least 1")
        if not 0 < self.share < 1:
            raise ValueError("a fault's share of the live peers is between 0 and 1")
        if not self.factor >= 1:
            raise ValueError("a slow fault's factor must be at least 1")
        if self.lie not in LIES:
            raise ValueError(f"lie {self.lie!r}: one of {', '.join(LIES)}")


@dataclass(frozen=True)
class RoundsScenario:
    peers: int = 100
    rounds: int = 5
    #: Values each peer averages per round (the pseudo-gradient's size).
    params: int = 10_000
    codec: CodecName = "int8"
    inner_steps: int = 50
    #: Virtual seconds one inner step takes on a speed-1 peer.
    step_s: float = 0.1
    #: Peer speeds are log-normal with this sigma (heterogeneous GPUs); 0: all equal.
    speed_sigma: float = 0.5
    #: Share of the live peers replaced each time the run enters a new round.
    churn: float = 0.0
    faults: tuple[Fault, ...] = ()
    #: The run's bound on a member's declared weight (RunConfig.max_weight's default role).
    max_weight: float = 32.0
    join_window_s: float = 60.0
    seed: int = 0
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)

    def __post_init__(self) -> None:
        if self.peers < 2 or self.rounds < 1 or self.params < 1 or self.inner_steps < 1:
            raise ValueError("a rounds scenario needs 2+ peers, 1+ rounds, params, inner steps")
        if not (self.step_s > 0 and self.speed_sigma >= 0 and 0 <= self.churn < 1):
            raise ValueError("step_s > 0, speed_sigma >= 0 and 0 <= churn < 1 are required")
        faults = tuple(f if isinstance(f, Fault) else Fault(**f) for f in self.faults)
        object.__setattr__(self, "faults", faults)


@dataclass(frozen=True)
class PeerRound:
    peer: int
    round: int
    group_size: int  # 1: alone (no group)
    dropped: int
    #: The lie this peer told this round ("" when honest).
    lie: str
    form_s: float
    allreduce_s: float


@dataclass(frozen=True)
class RoundsReport:
    peers: int
    rounds: int
    records: tuple[PeerRound, ...]
    replaced: int
    #: Bans the honest peers hold at the end (a liar banned by 3 peers counts 3).
    bans: int
    bytes_per_peer_round: float
    log_hash: str
    calls: int
    virtual_s: float
    wall_s: float

    @property
    def averaged_share(self) -> float:
        """Share of peer-rounds that averaged in a group of 2 or more."""
        return sum(r.group_size > 1 for r in self.records) / max(1, len(self.records))

    @property
    def median_form_s(self) -> float:
        return statistics.median(r.form_s for r in self.records) if self.records else math.nan

    @property
    def mean_group(self) -> float:
        sizes = [r.group_size for r in self.records if r.group_size > 1]
        return statistics.fmean(sizes) if sizes else 1.0


class _Run:
    def __init__(self, scenario: RoundsScenario) -> None:
        self.s = scenario
        self.swarm = DhtSwarm(scenario.peers, scenario.network, scenario.dht, scenario.seed)
        self.rng = random.Random(scenario.seed + 3)
        self.averagers: list[Averager] = []
        #: Each peer's training loop (its DHT node has its own scope in the swarm).
        self.scopes: list[trio.CancelScope] = []
        self.speeds: list[float] = []
        self.alive: set[int] = set()
        self.round_of: dict[int, int] = {}
        self.records: list[PeerRound] = []
        self.replaced = 0
        #: Peer -> (lie, last round it tells it).
        self.lying: dict[int, tuple[str, int]] = {}
        for i in range(scenario.peers):
            self._equip(i)

    def _equip(self, i: int) -> None:
        host = self.swarm.hosts[i]
        config = AllReduceConfig(codec=self.s.codec)
        averager = Averager(self.swarm.net.client(host), host.identity.peer_id, config)
        averager.limit_weights(self.s.max_weight)
        self.swarm.net.serve(host, [averager.service()])
        self.averagers.append(averager)
        self.scopes.append(trio.CancelScope())
        self.speeds.append(math.exp(self.rng.gauss(0.0, self.s.speed_sigma)))

    def target(self) -> MatchmakingConfig:
        """DiLoCo waits for as many peers as are alive (membership.py's group_target)."""
        cfg = self.s.matchmaking
        live = max(cfg.min_group_size, min(cfg.target_group_size, len(self.alive)))
        return dataclasses.replace(cfg, target_group_size=live)

    async def peer(self, i: int, first_round: int) -> None:
        node, host = self.swarm.nodes[i], self.swarm.hosts[i]
        me = Member(node.peer_id, host.address)
        gen = torch.Generator().manual_seed(self.s.seed * 1_000_003 + i)
        with self.scopes[i]:
            for r in range(first_round, self.s.rounds):
                self.round_of[i] = r
                await trio.sleep(self.s.inner_steps * self.s.step_s / self.speeds[i])
                t0 = trio.current_time()
                group = await form_group(node, f"sim/diloco/{r}", me, self.target())
                t1 = trio.current_time()
                size, dropped = 1, 0
                lie, until = self.lying.get(i, ("", -1))
                lie = lie if r <= until else ""
                if group is not None and len(group.members) > 1:
                    vector = torch.randn(self.s.params, generator=gen)
                    weight = 1e9 if lie == "weight" else 1.0
                    if lie:
                        vector *= 100.0 if lie == "scale100" else -1.0
                    result = await self.averagers[i].allreduce(group, vector, weight)
                    size, dropped = len(group.members), len(result.dropped)
                t2 = trio.current_time()
                self.records.append(PeerRound(i, r, size, dropped, lie, t1 - t0, t2 - t1))
        self.alive.discard(i)

    async def churn(self, nursery: trio.Nursery) -> None:
        """Each time the run enters a new round (the first live peer starts it), replaces
        ``churn`` of the live peers: killed at once, new ones joining."""
        seen = 0
        while True:
            await trio.sleep(1.0)
            live = sorted(self.alive)
            now_round = max((self.round_of.get(i, 0) for i in live), default=0)
            count = round(self.s.churn * len(live))
            if now_round <= seen or not count:
                continue
            seen = now_round
            for i in self.rng.sample(live, count):
                self.alive.discard(i)
                self.swarm.kill(i)
                self.scopes[i].cancel()
            for _ in range(count):
                i = self.swarm.add(nursery)
                self._equip(i)
                self.alive.add(i)
                self.replaced += 1
                nursery.start_soon(self._late_peer, i, now_round)

    async def faults(self) -> None:
        """Applies each scheduled fault as the run enters its round, and undoes it (heals a
        partition, restores speeds) ``rounds`` rounds later."""
        pending = sorted(self.s.faults, key=lambda f: f.at_round)
        undo: list[tuple[int, Callable[[], None]]] = []
        while pending or undo:
            await trio.sleep(1.0)
            live = sorted(self.alive)
            now_round = max((self.round_of.get(i, 0) for i in live), default=0)
            for end, fn in [u for u in undo if u[0] <= now_round]:
                fn()
                undo.remove((end, fn))
            while pending and pending[0].at_round <= now_round:
                fault = pending.pop(0)
                chosen = self.rng.sample(live, max(1, round(fault.share * len(live))))
                end = now_round + fault.rounds
                if fault.kind == "kill":
                    for i in chosen:
                        self.alive.discard(i)
                        self.swarm.kill(i)
                        self.scopes[i].cancel()
                elif fault.kind == "partition":
                    self.swarm.net.partition([[self.swarm.hosts[i].address for i in chosen]])
                    undo.append((end, self.swarm.net.heal))
                elif fault.kind == "slow":
                    for i in chosen:
                        self.speeds[i] /= fault.factor
                    undo.append((end, functools.partial(self._speed_up, chosen, fault.factor)))
                else:
                    for i in chosen:
                        self.lying[i] = (fault.lie, end - 1)

    def _speed_up(self, peers: list[int], factor: float) -> None:
        for i in peers:
            self.speeds[i] *= factor

    async def _late_peer(self, i: int, first_round: int) -> None:
        await trio.sleep(5.0)  # its DHT join and its state download
        await self.peer(i, first_round)


async def _scenario(scenario: RoundsScenario, progress: Callable[[str], None]) -> RoundsReport:
    wall0 = time.monotonic()
    run = _Run(scenario)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        progress(f"joining {scenario.peers} peers over {scenario.join_window_s:g} virtual s")
        await run.swarm.join(nursery, scenario.join_window_s)
        progress(f"[{time.monotonic() - wall0:7.1f}s wall] training {scenario.rounds} rounds")
        async with trio.open_nursery() as peers:
            for i in range(scenario.peers):
                run.alive.add(i)
                peers.start_soon(run.peer, i, 0)
            if scenario.churn:
                peers.start_soon(run.churn, peers)
            if scenario.faults:
                peers.start_soon(run.faults)
            while run.alive:
                await trio.sleep(1.0)
            peers.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    peer_rounds = max(1, len(run.records))
    sent = sum(h.sent_bytes for h in run.swarm.hosts)
    return RoundsReport(
        peers=scenario.peers,
        rounds=scenario.rounds,
        records=tuple(run.records),
        replaced=run.replaced,
        bans=sum(a.bans.active() for i, a in enumerate(run.averagers) if i not in run.lying),
        bytes_per_peer_round=sent / peer_rounds,
        log_hash=run.swarm.net.trace.hexdigest(),
        calls=run.swarm.net.calls,
        virtual_s=trio.current_time() - t0,
        wall_s=time.monotonic() - wall0,
    )


def run_rounds(
    scenario: RoundsScenario, progress: Callable[[str], None] | None = None
) -> RoundsReport:
    """Runs the scenario in virtual time (sim/virtual.py)."""
    return run_virtual(_scenario, scenario, progress or (lambda _: None), seed=scenario.seed)
