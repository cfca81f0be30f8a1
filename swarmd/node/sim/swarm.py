"""SWARM pipelines at scale in virtual time (issue 45: 8 stages, 400 stage servers, 100
trainers on unequal speeds, servers preempted and replaced): how much of the servers'
compute the pipeline turns into trained micro-batches.

What runs is the real code of the decisions: each trainer is a `SwarmTrainer` whose hops go
through its real `routed` loop (the Router's expected-finish choice, its bans, busy rests and
retries, MAX_ATTEMPTS, the call timeout) and whose micro-batches follow `route.route`; each
server takes its first stage with `rebalance.least_served`, admits calls with
`stage_service.admits`, and moves with `rebalance.choose_move`, `Looks` and `contest`, on
records that are the real `StageRecord`s, refreshed every `SwarmTimings.refresh_s` and lapsing
after its `record_ttl_s`. What is modelled: a stage server is one device taking calls in
order, a forward costing a third of `stage_s / speed` and a backward two thirds (the last
stage's one call all of it); the directory is one map every reader sees at once (the DHT's
spread delay is left out; its lapse and refresh are in); a call costs its transfers on the
network model's links (RTT, FIFO up- and downlinks) and two round trips (put, then fetch); a
call to a server that is gone waits `CONNECT_S`, one in flight when it goes waits out the
trainer's timeout; the stage rounds' averaging and the state download's own compute are free.

The ideal is the servers' live compute perfectly spread over the stages: at each moment
sum(speed) / (stage_s x stages) micro-batches per second, counting every server that is up,
downloading or not. Efficiency is the micro-batches completed after the warm-up against that
integral over the same time.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import trio

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.rebalance import Looks, choose_move, contest, least_served
from swarmd.node.algorithms.swarm.route import Hop
from swarmd.node.algorithms.swarm.router import Choice
from swarmd.node.algorithms.swarm.stage_service import (
    BACKWARD,
    CHECK_BACKWARD,
    CHECK_LAST,
    FORWARD,
    LAST,
    admits,
)
from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.node.algorithms.swarm.trainer import Answer, MicroBatchFailed, SwarmTrainer
from swarmd.node.sim.dht import seeded_identity
from swarmd.node.sim.network import Host, SimNetwork
from swarmd.node.sim.swarm_spec import SwarmReport, SwarmScenario
from swarmd.node.sim.virtual import run_virtual
from swarmd.protocol import rpc
from swarmd.protocol.identity import PeerId

#: How long a call to a server that is gone waits before it fails (the bulk plane's connect
#: timeout: a vanished host answers nothing).
CONNECT_S = 3.0
#: A server's longest wait for its device before it refuses a call (StageJob.max_wait_s).
MAX_WAIT_S = 10.0
#: The modelled servers' directory timings (the trainers' are their own, the same defaults).
TIMINGS = SwarmTimings()
_KINDS = {
    FORWARD: "forward",
    BACKWARD: "backward",
    LAST: "last",
    CHECK_BACKWARD: "backward",
    CHECK_LAST: "last",
}
_SHARE = {"forward": 1 / 3, "backward": 2 / 3, "last": 1.0}
_LOSS = torch.zeros(())
#: What an honest server answers (every hop's hidden state or gradient), and a liar: x(-20).
_HIDDEN = torch.ones(1, 1, 1)
_LIE = -20 * _HIDDEN
_TOKENS = torch.zeros(1, 1, dtype=torch.int64)


@dataclass
class _Server:
    peer: PeerId
    host: Host
    speed: float
    stage: int
    state: str = "joining"
    up: bool = True
    waiting: int = 0
    #: Seconds its device computed after the warm-up.
    busy_s: float = 0.0
    up_at: float = 0.0
    down_at: float = math.inf
    #: Answers every call x(-20) (issue 47: a stage server that computes honestly, at honest
    #: speed, and lies in what it answers).
    liar: bool = False
    looks: Looks = field(default_factory=Looks)
    device: trio.Lock = field(default_factory=trio.Lock)

    def record(self, scenario: SwarmScenario) -> StageRecord:
        return StageRecord(
            stage=self.stage,
            address=self.host.address,
            rate=self.speed / scenario.stage_s,
            queue=self.waiting,
            state=self.state,
        )


class _Pipeline:
    """The servers, the directory and the trainers of one run."""

    def __init__(self, scenario: SwarmScenario) -> None:
        self.scenario = scenario
        #: Who comes when, at what speed, for how long: drawn in the same order whatever the
        #: servers decide, so a run without rebalancing sees the same servers.
        self.trace = random.Random(scenario.seed)
        self.rng = random.Random(scenario.seed + 1)
        self.net = SimNetwork(scenario.network, scenario.seed)
        self.servers: dict[PeerId, _Server] = {}
        #: peer -> (its last record, when it lapses): the DHT's stage directory.
        self.records: dict[PeerId, tuple[StageRecord, float]] = {}
        self.stages = scenario.swarm.stages
        self.done = 0
        self.latencies: list[float] = []
        self.moves = self.preempted = 0
        self.trainers: list[SwarmTrainer] = []
        #: Measured micro-batches a liar answered a call of.
        self.poisoned = 0
        #: The ideal's integral: sum of live speeds, since when, and the area so far.
        self._speed, self._since, self._area = 0.0, 0.0, 0.0

    # -- the ideal -------------------------------------------------------------------------

    def _live(self, delta: float) -> None:
        """The live servers' total speed changes by `delta` now."""
        now = trio.current_time()
        start = max(self._since, self.scenario.warmup_s)
        if now > start:
            self._area += self._speed * (now - start)
        self._since = now
        self._speed += delta

    def busy(self) -> list[float]:
        """Each stage's servers' compute over what they could have computed (speed-weighted
        time up since the warm-up; servers counted at the stage they are on now)."""
        done, could = [0.0] * self.stages, [0.0] * self.stages
        now, warm = trio.current_time(), self.scenario.warmup_s
        for server in self.servers.values():
            done[server.stage] += server.busy_s * server.speed
            up = min(server.down_at, now) - max(server.up_at, warm)
            could[server.stage] += server.speed * max(up, 0.0)
        return [round(d / c, 3) if c else math.nan for d, c in zip(done, could, strict=True)]

    def ideal(self) -> float:
        self._live(0.0)
        return self._area / (self.scenario.stage_s * self.stages)

    # -- the directory ---------------------------------------------------------------------

    def publish(self, server: _Server) -> None:
        now = trio.current_time()
        self.records[server.peer] = (server.record(self.scenario), now + TIMINGS.record_ttl_s)

    async def read(self) -> dict[PeerId, StageRecord]:
        now = trio.current_time()
        return {
            p: r for p, (r, until) in self.records.items() if until > now and r.state != "leaving"
        }

    # -- a server --------------------------------------------------------------------------

    async def server(self, nursery: trio.Nursery, first: bool = False, liar: bool = False) -> None:
        """One server's life: take the least served stage, serve and rebalance until
        preempted; its replacement starts `downtime_s` later. The run's first servers start
        their stages from the seed; later ones download the stage's state."""
        s, trace = self.scenario, self.trace
        host = self.net.add_host(seeded_identity(trace))
        speed = trace.lognormvariate(0.0, s.speed_sigma)
        lifetime = trace.expovariate(1 / s.lifetime_s) if math.isfinite(s.lifetime_s) else math.inf
        lifetime = math.inf if liar else lifetime
        stage = least_served(await self.read(), self.stages)
        server = _Server(host.identity.peer_id, host, speed, stage, up_at=trio.current_time())
        server.liar = liar
        self.servers[server.peer] = server
        self._live(speed)
        with trio.move_on_after(lifetime):
            try:
                await self._take(server, stage, download=not first)
                async with trio.open_nursery() as own:
                    own.start_soon(self._refresh, server)
                    if s.swarm.rebalance_s > 0:
                        await self._rebalance(server)
            finally:
                server.up, server.down_at = False, trio.current_time()
                self._live(-speed)
        self.preempted += 1
        await trio.sleep(s.downtime_s)
        nursery.start_soon(self.server, nursery)

    async def _take(self, server: _Server, stage: int, download: bool = True) -> None:
        """Downloads `stage`'s state (counted there as joining meanwhile), then serves it."""
        server.stage, server.state = stage, "joining"
        self.publish(server)
        records = await self.read()
        donors = [p for p, r in records.items() if r.stage == stage and r.state == "serving"]
        if download and donors and self.scenario.stage_bytes:
            donor = self.servers[self.rng.choice(sorted(donors, key=lambda p: p.raw))]
            await self.net.transfer(donor.host, server.host, self.scenario.stage_bytes)
        server.state = "serving"
        self.publish(server)

    async def _refresh(self, server: _Server) -> None:
        while True:
            await trio.sleep(TIMINGS.refresh_s)
            self.publish(server)

    async def _rebalance(self, server: _Server) -> None:
        """The stage server's looks (server_role.serve and _maybe_move): the first after at
        least half a period more, then one every [0.5, 1.5] x rebalance_s."""
        period, gain = self.scenario.swarm.rebalance_s, self.scenario.swarm.rebalance_gain
        await trio.sleep(period * (0.5 + self.rng.uniform(0.5, 1.5)))
        while True:
            records = await self.read()
            records[server.peer] = server.record(self.scenario)
            move = choose_move(records, server.peer, self.stages, gain, server.looks.named)
            if server.looks.confirm(move):
                assert move is not None
                if await self._claim(server, move.target):
                    self.moves += 1
                    await self._take(server, move.target)
            await trio.sleep(period * self.rng.uniform(0.5, 1.5))

    async def _claim(self, server: _Server, target: int) -> bool:
        source = server.stage
        server.stage, server.state = target, "joining"
        self.publish(server)
        verdict = contest(await self.read(), server.peer, target)
        if verdict == "wait":
            await trio.sleep(TIMINGS.contest_wait_s)
            verdict = "go" if contest(await self.read(), server.peer, target) == "go" else "yield"
        if verdict != "go":
            server.stage, server.state = source, "serving"
            self.publish(server)
        return verdict == "go"

    # -- a call ----------------------------------------------------------------------------

    async def call(self, caller: Host, choice: Choice, stage: int, kind: str, answer: int) -> None:
        """One stage call as the trainer sees it: put (its bundle up, compute, the ack back),
        then fetch (the answer down). Raises what the real call raises."""
        server = self.servers[choice.peer]
        rtt = self.net.rtt(caller.address, server.host.address)
        if not server.up:
            await trio.sleep(CONNECT_S)
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "connect timed out")
        sent = 2 if kind == "backward" else 1
        await self.net.transfer(
            caller, server.host, sent * self.scenario.activation_bytes, latency=rtt / 2
        )
        await self._alive(server)
        if server.state != "serving" or server.stage != stage:
            await trio.sleep(rtt / 2)
            raise rpc.RpcError(rpc.StatusCode.FAILED_PRECONDITION, "serves another stage")
        # StageJob.per_call_s: the mean of the stage's kinds (forward and backward; last).
        per_call = self.scenario.stage_s / server.speed * (1.0 if kind == "last" else 0.5)
        if not admits(server.waiting, per_call, MAX_WAIT_S):
            await trio.sleep(rtt / 2)
            raise rpc.RpcError(rpc.StatusCode.RESOURCE_EXHAUSTED, "stage server busy")
        server.waiting += 1
        try:
            async with server.device:
                await self._alive(server)
                held = _SHARE[kind] * self.scenario.stage_s / server.speed
                await trio.sleep(held)
                if trio.current_time() >= self.scenario.warmup_s:
                    server.busy_s += held
        finally:
            server.waiting -= 1
        await self._alive(server)
        self.net.record(caller.address, server.host.address, kind, sent)
        if not answer:
            await trio.sleep(rtt / 2)  # the ack
            return
        # The ack back and the fetch there (a round trip), then the answer down.
        answer_bytes = self.scenario.activation_bytes
        await self.net.transfer(server.host, caller, answer_bytes, after=rtt, latency=rtt / 2)

    @staticmethod
    async def _alive(server: _Server) -> None:
        """A call in flight at a server that is gone hangs until the caller's timeout."""
        if not server.up:
            await trio.sleep_forever()

    # -- a trainer -------------------------------------------------------------------------

    async def trainer(self, index: int) -> None:
        host = self.net.add_host(seeded_identity(self.trace))
        trainer = _SimTrainer(self, host, random.Random(self.trace.getrandbits(64)))
        seqs = iter(range(1 << 62))
        batch = (_TOKENS, _TOKENS)

        async def worker() -> None:
            for seq in seqs:
                t0 = trio.current_time()
                try:
                    await trainer.micro_batch(seq, batch)
                except MicroBatchFailed:
                    trainer.stats.failed += 1
                    trainer.was_poisoned(seq)
                    continue
                poisoned = trainer.was_poisoned(seq)
                if t0 >= self.scenario.warmup_s:
                    self.done += 1
                    self.poisoned += poisoned
                    self.latencies.append(trio.current_time() - t0)

        self.trainers.append(trainer)
        async with trio.open_nursery() as nursery:
            for _ in range(self.scenario.swarm.inflight):
                nursery.start_soon(worker)


class _SimTrainer(SwarmTrainer):
    """The real trainer, its hops made against the modelled servers."""

    def __init__(self, pipeline: _Pipeline, host: Host, rng: random.Random) -> None:
        cfg = pipeline.scenario.swarm
        super().__init__(pipeline.net.client(host), pipeline.read, cfg, _quiet, rng=rng)
        self.pipeline, self.host = pipeline, host
        #: Micro-batches (their call prefix) a liar answered a call of.
        self.poisoned: set[str] = set()

    async def call(
        self,
        hop: Hop,
        path: str,
        tensors: list[torch.Tensor],
        call: str,
        *,
        answer: int,
        like: torch.Tensor,
        exclude: Collection[PeerId] = (),
    ) -> Answer:
        kind = _KINDS[path]

        async def attempt(choice: Choice, _: int) -> list[torch.Tensor]:
            await self.pipeline.call(self.host, choice, hop.stage, kind, answer)
            hidden = _HIDDEN
            if self.pipeline.servers[choice.peer].liar:
                self.poisoned.add(call.partition("/")[0])
                hidden = _LIE
            if kind == "last":
                return [_LOSS, hidden][:answer]
            return [hidden] if answer else []

        out, peer = await self.routed(hop.stage, attempt, exclude)
        # Stage rounds are not modelled: every answer is comparable.
        return Answer(out, peer, 0, b"modelled")

    def was_poisoned(self, seq: int) -> bool:
        """Whether a liar answered any call of micro-batch `seq` (forgotten once asked)."""
        mb = f"{self._nonce}-{seq}"
        if mb in self.poisoned:
            self.poisoned.discard(mb)
            return True
        return False


def _quiet(*_: object, **__: object) -> None:
    """Trainers' progress events are not printed in a run of hundreds."""


async def _scenario(scenario: SwarmScenario, progress: Callable[[str], None]) -> SwarmReport:
    wall0 = time.monotonic()
    p = _Pipeline(scenario)
    progress(f"{scenario.servers} servers, {scenario.trainers} trainers, seed {scenario.seed}")
    async with trio.open_nursery() as nursery:
        liars = set(
            random.Random(scenario.seed + 2).sample(range(scenario.servers), scenario.liars)
        )
        for i in range(scenario.servers):
            nursery.start_soon(p.server, nursery, True, i in liars)
            await trio.sleep(0)
        # Servers publish before trainers look: the first read sees them all.
        await trio.sleep(TIMINGS.refresh_s)
        for i in range(scenario.trainers):
            nursery.start_soon(p.trainer, i)
        step = max(scenario.duration_s / 10, 1.0)
        while trio.current_time() < scenario.duration_s:
            await trio.sleep(min(step, scenario.duration_s - trio.current_time()))
            progress(
                f"[{time.monotonic() - wall0:6.0f}s wall, {trio.current_time():6.0f}s virtual] "
                f"{p.done} micro-batches, {p.moves} moves, {p.preempted} preempted"
            )
        ideal = p.ideal()
        nursery.cancel_scope.cancel()
    rates = [0.0] * p.stages
    for r in (await p.read()).values():
        if r.state == "serving":
            rates[r.stage] += r.rate
    mean = statistics.fmean(rates) or 1.0
    return SwarmReport(
        stages=p.stages,
        servers=scenario.servers,
        trainers=scenario.trainers,
        done=p.done,
        ideal=ideal,
        failed=sum(t.stats.failed for t in p.trainers),
        retries=sum(t.stats.retries for t in p.trainers),
        moves=p.moves,
        preempted=p.preempted,
        liars=scenario.liars,
        audits=sum(t.stats.audits for t in p.trainers),
        caught=sum(t.stats.caught for t in p.trainers),
        poisoned=p.poisoned,
        latency_s=statistics.median(p.latencies) if p.latencies else math.nan,
        busy=p.busy(),
        stage_balance=[round(r / mean, 3) for r in rates],
        log_hash=p.net.trace.hexdigest(),
        wall_s=time.monotonic() - wall0,
    )


def run_swarm(
    scenario: SwarmScenario, progress: Callable[[str], None] | None = None
) -> SwarmReport:
    """Runs the scenario in virtual time (trio's MockClock, autojump)."""
    return run_virtual(_scenario, scenario, progress or (lambda _: None), seed=scenario.seed)
