"""DiLoCo at scale in virtual time: N peers of different speeds, each round their inner steps
(charged as virtual time, computed in closed form on sim/workload.py's quadratic), the real
`form_group` under the round's key, the real all-reduce (Averager) of their pseudo-gradients
and the real outer optimiser (optim/outer.py's Nesterov SGD) on each peer's own state; a share
of the peers replaced every round. What it measures is what issue 45 asks of a 1,000-peer
DiLoCo run and what issue 46 needs: group formation time, rounds averaged, bytes per peer,
peers left alone, how far the peers' states spread apart, the loss against one group of
everybody at equal tokens, and the share of the peers' time that was useful.

What it leaves out: state sync (a replacement peer copies a live peer's state and momentum,
as if it had downloaded them) and the state hash in the matchmaking key: groups of one round
meet under one key whatever their states, so states that forked show as spread instead of
as lines that never meet again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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
from swarmd.node.averaging.attendance import Attendance
from swarmd.node.averaging.codecs import CodecName
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.gridround import GridConfig, on_roster, roll_call, roll_verdict
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.averaging.reduction import Aggregation, ReductionConfig
from swarmd.node.chaos.byzantine import WEIGHTFLIP
from swarmd.node.dht.config import DHTConfig
from swarmd.node.sim.dht import DhtSwarm
from swarmd.node.sim.faults import Fault
from swarmd.node.sim.lines import Lines, RoundLine
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.virtual import run_virtual
from swarmd.node.sim.workload import Quadratic, QuadraticConfig
from swarmd.optim.outer import FlatOuter
from swarmd.protocol.identity import PeerId

#: How a round's peers reach each other: one matchmaking under the round's key ("flat", what
#: the daemon does), or issue 46's "grid" (averaging/grid.py: ⌈log_T N⌉ levels of groups
#: whose cells the round's roster fixes before anyone arrives; every peer ends the round with
#: the mean of every contribution). A first version cut its levels from the order peers
#: arrived in ("levels", removed): exact when all arrived together, spread 0.15 -> 0.46 over
#: four rounds once they did not.
Grouping = Literal["flat", "grid"]
#: How long a grid peer that sits a round out waits for a finished state before it goes on
#: with its own.
SIT_OUT_S = 120.0


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
    #: A round's inner phase is this many virtual seconds, a peer training ``inner_steps``
    #: at most in it (the run's ``inner_seconds``; 0: H steps however long they take). Each
    #: peer's pseudo-gradient is weighted by the steps it ran.
    inner_s: float = 0.0
    #: Peer speeds are log-normal with this sigma (heterogeneous GPUs); 0: all equal.
    speed_sigma: float = 0.5
    #: Share of the live peers replaced each time the run enters a new round.
    churn: float = 0.0
    faults: tuple[Fault, ...] = ()
    #: The run's bound on a member's declared weight (RunConfig.max_weight's default role).
    max_weight: float = 32.0
    aggregation: Aggregation = "mean"
    #: Reducers drop a contribution opposed to most others' (reduction.opposed_outliers).
    drop_opposed: bool = True
    #: Identities that heartbeat in the run (so every peer's group target counts them) and
    #: never join a group: issue 46's staller attack.
    stallers: int = 0
    workload: QuadraticConfig = field(default_factory=QuadraticConfig)
    grouping: Grouping = "flat"
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
        if not (self.inner_s >= 0 and math.isfinite(self.inner_s)):
            raise ValueError("inner_s must be >= 0 (0: rounds of H steps, however long)")
        if self.stallers < 0:
            raise ValueError("stallers must be >= 0")
        if self.grouping not in ("flat", "grid"):
            raise ValueError(f"grouping {self.grouping!r}: flat or grid")
        ReductionConfig(aggregation=self.aggregation)  # raises ValueError with the reason
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
    #: Virtual seconds of inner steps before this round's sync.
    train_s: float
    #: The workload's loss at the peer's state after the round's outer step.
    loss: float


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
    #: Calls a host's rate limit refused (each made again after the wait it named).
    limited: int
    virtual_s: float
    wall_s: float
    lines: tuple[RoundLine, ...]
    #: Share of the peers' time alive in the run spent on inner steps that then averaged
    #: (1.0: no peer ever waited, trained alone, or paid for the exchange).
    useful_ratio: float

    @property
    def averaged_share(self) -> float:
        """Share of peer-rounds that averaged in a group of 2 or more."""
        return sum(r.group_size > 1 for r in self.records) / max(1, len(self.records))

    @property
    def median_form_s(self) -> float:
        return statistics.median(r.form_s for r in self.records) if self.records else math.nan

    @property
    def honest_final_loss(self) -> float:
        """Mean loss of the honest peers that finished the last round."""
        last = [r.loss for r in self.records if r.round == self.rounds - 1 and not r.lie]
        return statistics.fmean(last) if last else math.nan

    @property
    def spread(self) -> float:
        """The honest states' spread after the last round any honest peer finished."""
        return self.lines[-1].spread if self.lines else math.nan

    @property
    def loss_ratio(self) -> float:
        """Honest final loss against one group of everybody after as many rounds."""
        return self.honest_final_loss / self.lines[-1].ideal_loss if self.lines else math.nan

    @property
    def mean_group(self) -> float:
        sizes = [r.group_size for r in self.records if r.group_size > 1]
        return statistics.fmean(sizes) if sizes else 1.0


class _Run:
    def __init__(self, scenario: RoundsScenario, say: Callable[[str], None]) -> None:
        self.s = scenario
        self.say, self.wall0, self.said = say, time.monotonic(), -1
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
        self.work = Quadratic(
            scenario.params, scenario.inner_steps, scenario.workload, scenario.seed
        )
        self.outers: list[FlatOuter] = []
        self.lines = Lines(scenario.rounds, scenario.params)
        #: Virtual seconds each peer spent in the run (from its first round to its end).
        self.alive_s: dict[int, float] = {}
        #: The stallers' identities, and each peer's record of who never came (attendance.py).
        self.stallers = [
            PeerId(hashlib.sha256(f"staller/{scenario.seed}/{k}".encode()).digest())
            for k in range(scenario.stallers)
        ]
        self.attendance: list[Attendance] = []
        #: grouping = "grid": the first finished state of each round (what a peer outside its
        #: roster takes), and whether one is there yet.
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.done: dict[int, trio.Event] = {}
        for i in range(scenario.peers):
            self._equip(i)

    def _equip(self, i: int) -> None:
        """Peer i's averager, speed and outer optimiser (at the run's start)."""
        host = self.swarm.hosts[i]
        reduction = ReductionConfig(
            aggregation=self.s.aggregation, drop_opposed=self.s.drop_opposed
        )
        config = AllReduceConfig(codec=self.s.codec, reduction=reduction)
        averager = Averager(self.swarm.net.client(host), host.identity.peer_id, config)
        averager.limit_weights(self.s.max_weight)
        self.swarm.net.serve(host, [averager.service()])
        self.averagers.append(averager)
        self.scopes.append(trio.CancelScope())
        self.speeds.append(math.exp(self.rng.gauss(0.0, self.s.speed_sigma)))
        self.outers.append(self.work.outer())
        self.attendance.append(Attendance())

    def steps(self, i: int) -> int:
        """Peer i's inner steps this round: H, or with ``inner_s`` the steps until the one
        that ends at or after it (a daemon checks the time after each step), at most H."""
        h = self.s.inner_steps
        if self.s.inner_s:
            h = min(h, max(1, math.ceil(self.s.inner_s * self.speeds[i] / self.s.step_s)))
        return h

    def live_ids(self) -> list[PeerId]:
        """Whose heartbeats a peer reads: the live peers and the stallers."""
        return [self.swarm.nodes[j].peer_id for j in self.alive] + self.stallers

    def target(self, i: int, live: list[PeerId]) -> MatchmakingConfig:
        """DiLoCo waits for as many peers as heartbeat in the run and are not absent in
        peer i's attendance (membership.py's group_target)."""
        cfg = self.s.matchmaking
        target = self.attendance[i].target(live, cfg.min_group_size, cfg.target_group_size)
        return dataclasses.replace(cfg, target_group_size=target)

    async def peer(self, i: int, first_round: int) -> None:
        node, host = self.swarm.nodes[i], self.swarm.hosts[i]
        me = Member(node.peer_id, host.address)
        optimum = self.work.optimum(i)
        outer = self.outers[i]
        began = trio.current_time()
        try:
            with self.scopes[i]:
                for r in range(first_round, self.s.rounds):
                    self.round_of[i] = r
                    steps = self.steps(i)
                    train_s = steps * self.s.step_s / self.speeds[i]
                    # A peer capped at H waits the round's inner_s out (DiLoCo.time_left).
                    await trio.sleep(max(train_s, self.s.inner_s))
                    delta = self.work.pseudo_gradient(outer.values, optimum, steps)
                    share = steps / self.s.inner_steps
                    t0 = trio.current_time()
                    lie, until = self.lying.get(i, ("", -1))
                    lie = lie if r <= until else ""
                    sent = delta * (100.0 if lie == "scale100" else -1.0) if lie else delta
                    weight = {"weight": 1e9, "weightflip": WEIGHTFLIP}.get(lie, share)
                    if self.s.grouping == "grid":
                        sat_out = await self._grid_round(i, r, me, sent, weight, lie, t0, train_s)
                        if sat_out or i in self.lying:
                            continue
                        self.lines.add(r, outer.values, optimum, self.work.gain(steps), share)
                        self.finished(r).set()
                        continue
                    live = self.live_ids()
                    gathered = self.attendance[i].gathering(
                        live, self.s.matchmaking.target_group_size
                    )
                    key = f"sim/diloco/{r}"
                    group = await form_group(node, key, me, self.target(i, live), gathered)
                    self.attendance[i].record(live, gathered)
                    t1 = trio.current_time()
                    size, dropped, averaged = 1, 0, delta
                    if group is not None and len(group.members) > 1:
                        result = await self.averagers[i].allreduce(group, sent, weight)
                        size, dropped = len(group.members), len(result.dropped)
                        averaged = result.tensor
                    outer.step(averaged)
                    self._progress(r)
                    t2 = trio.current_time()
                    loss = self.work.loss(outer.values)
                    self.records.append(
                        PeerRound(i, r, size, dropped, lie, t1 - t0, t2 - t1, train_s, loss)
                    )
                    if i not in self.lying:
                        self.lines.add(r, outer.values, optimum, self.work.gain(steps), share)
        finally:
            self.alive_s[i] = trio.current_time() - began
            self.alive.discard(i)

    def _progress(self, r: int) -> None:
        """One line as the first peer ends each round (a 1,000-peer run takes many minutes)."""
        if r > self.said:
            self.said = r
            wall = time.monotonic() - self.wall0
            self.say(f"[{wall:7.1f}s wall] round {r} ends first at {trio.current_time():.0f}s")

    def finished(self, r: int) -> trio.Event:
        return self.done.setdefault(r, trio.Event())

    async def _grid_round(
        self, i: int, r: int, me: Member, value: torch.Tensor, weight: float, lie: str,
        t0: float, train_s: float,
    ) -> bool:  # fmt: skip
        """One round on the grid as a daemon's DiLoCo runs it (loop.py `average_grid`): a
        roll call of the peers this peer expects, the grid planned from its roster, the
        levels' groups built from it (averaging/gridround.py); the outer step on the
        result. A peer the roll call formed without, or one left out of a group, takes the
        state of the first peer to finish the round (as its catch-up would) and drops its
        inner steps: True then. With no roll call of two it steps on its own, as the daemon
        does."""
        node, outer, attendance = self.swarm.nodes[i], self.outers[i], self.attendance[i]
        live, key = self.live_ids(), f"sim/diloco/{r}"
        target = self.s.matchmaking.target_group_size
        gathered = attendance.gathering(live, target)
        roll = await roll_call(
            node, key, me, self.s.matchmaking, attendance.expected(live), gathered
        )
        attendance.record(live, gathered)
        verdict = roll_verdict(roll, gathered, me.peer_id)
        if verdict == "sit_out":
            return await self._sit_out(i, r, t0, train_s)
        if verdict == "alone" or roll is None:
            outer.step(value)
            self._record(i, r, 1, 0, lie, trio.current_time() - t0, 0.0, train_s)
            return False
        config = GridConfig(target)
        grid, peer = on_roster(roll, key, self.averagers[i], me, config)
        form_s = trio.current_time() - t0
        got = await peer.average(grid, key, value, weight)
        if got.result is None:
            return await self._sit_out(i, r, t0, train_s)
        outer.step(got.result)
        if r not in self.snapshots and i not in self.lying:
            self.snapshots[r] = (outer.values.clone(), outer.momentum().clone())
        alone = trio.current_time() - t0 - form_s
        self._record(i, r, got.row_size, got.dropped, lie, form_s, alone, train_s)
        return False

    def _record(
        self, i: int, r: int, size: int, dropped: int, lie: str, form_s: float, alone: float,
        train_s: float,
    ) -> None:  # fmt: skip
        self._progress(r)
        loss = self.work.loss(self.outers[i].values)
        self.records.append(PeerRound(i, r, size, dropped, lie, form_s, alone, train_s, loss))

    async def _sit_out(self, i: int, r: int, t0: float, train_s: float) -> bool:
        """A peer outside round r's roster, or one its group formed without (it came after
        the group's window): it takes the state of the first peer to finish the round, as its
        catch-up would, and its inner steps are lost. Its own state if nobody finishes."""
        with trio.move_on_after(SIT_OUT_S):
            await self.finished(r).wait()
        if r in self.snapshots:
            self.outers[i].load(*self.snapshots[r])
        loss = self.work.loss(self.outers[i].values)
        self.records.append(PeerRound(i, r, 1, 0, "", trio.current_time() - t0, 0.0, train_s, loss))
        return True

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
        """A replacement peer: its DHT join and state download take 5 s, then it copies a
        live peer's state and momentum (state sync) and starts at that peer's round."""
        await trio.sleep(5.0)
        # Only peers that started training hold a state: another replacement still in its
        # own 5 s has the initial one (copied, it entered round 1 with it: 150 peers, 5%
        # replaced, states 0.13 apart after the round).
        donors = sorted(j for j in self.alive - {i} - set(self.lying) if j in self.round_of)
        if donors:
            donor = self.rng.choice(donors)
            self.outers[i].load(self.outers[donor].values, self.outers[donor].momentum())
            first_round = self.round_of.get(donor, first_round)
        await self.peer(i, first_round)


async def _scenario(scenario: RoundsScenario, progress: Callable[[str], None]) -> RoundsReport:
    wall0 = time.monotonic()
    run = _Run(scenario, progress)
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
    useful = sum(r.train_s for r in run.records if r.group_size > 1 and r.peer not in run.lying)
    honest_s = sum(t for i, t in run.alive_s.items() if i not in run.lying)
    return RoundsReport(
        peers=scenario.peers,
        rounds=scenario.rounds,
        records=tuple(run.records),
        replaced=run.replaced,
        bans=sum(a.bans.active() for i, a in enumerate(run.averagers) if i not in run.lying),
        bytes_per_peer_round=sent / peer_rounds,
        log_hash=run.swarm.net.trace.hexdigest(),
        calls=run.swarm.net.calls,
        limited=run.swarm.net.limited,
        virtual_s=trio.current_time() - t0,
        wall_s=time.monotonic() - wall0,
        lines=run.lines.finish(run.work),
        useful_ratio=useful / honest_s if honest_s else math.nan,
    )


def run_rounds(
    scenario: RoundsScenario, progress: Callable[[str], None] | None = None
) -> RoundsReport:
    """Runs the scenario in virtual time (sim/virtual.py)."""
    return run_virtual(_scenario, scenario, progress or (lambda _: None), seed=scenario.seed)
