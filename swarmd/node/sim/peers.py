"""Real peers in virtual time: `swarmd join`'s whole lifecycle on the simulated network.

Each `SimPeer` is the daemon's own `lifecycle.Peer` (its DHT node, the run's signed config,
access, heartbeats, the run's strategy with its real model, data and optimisers, state sync,
the all-reduce with its proofs) given a `SimNet` instead of sockets: its calls are the
SimNetwork's (the same signed bytes, latency, bandwidth, partitions), its clocks are virtual,
its inner steps run inline and are charged ``step_s`` of virtual time each. What the
process tests check with wall-clock deadlines (a split and its heal, a joiner's state sync, a
member killed mid-round) runs here keyed to virtual time, and one seed replays it.

What differs from a daemon: no signals (`SimPeers.stop` sets the peer's stop event, as
SIGTERM would), no bulk plane of its own (tensor calls are the network's), no dial-back check
(peers say whether they are reachable), and the run's processes share one CPU, so a run of
real models is for a handful of peers; scale is sim/rounds.py's synthetic workload.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from swarmd.node.algorithms.registry import STRATEGIES
from swarmd.node.dht import DHTNode
from swarmd.node.dht.config import DHTConfig
from swarmd.node.metrics import Metrics
from swarmd.node.peer.lifecycle import Peer
from swarmd.node.peer.net import Served
from swarmd.node.peer.options import JoinOptions
from swarmd.node.peer.progress import NOTICE_KINDS, Progress
from swarmd.node.peer.progress_record import MAX_NOTICE_TEXT, Notice
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.peer.strategy import Strategies
from swarmd.node.sim.dht import seeded_identity
from swarmd.node.sim.network import (
    Host,
    NetworkConfig,
    SimNetwork,
    SimTensorClient,
    current_host,
)
from swarmd.node.timing import TimingProfile
from swarmd.protocol import rpc
from swarmd.protocol.address import Address, parse_address
from swarmd.protocol.identity import Identity

log = logging.getLogger(__name__)

Event = dict[str, Any]


@dataclass(frozen=True)
class _Served:
    address: Address
    bulk_port: int = 0


@dataclass
class SimNet:
    """`peer/net.py`'s PeerNet over one simulated host."""

    network: SimNetwork
    host: Host
    rng: random.Random
    step_s: float = 0.0
    #: Virtual seconds a SWARM stage's forward of one micro-batch takes (`device_s`).
    call_s: float = 0.01
    signals: bool = False

    async def inner_step(self) -> None:
        """``step_s`` of virtual time, and, while the host is paused, until it is resumed."""
        if self.step_s:
            await trio.sleep(self.step_s)
        await self.host.unpaused()

    def monotonic(self) -> float:
        return trio.current_time()

    def wall(self) -> float:
        return self.network.wall(self.host)

    def device_s(self, kind: str, took: float) -> tuple[float, float]:
        """A stage call's compute: ``call_s`` a forward, twice that a backward or a last
        stage's (forward, loss and backward), nothing for the rest (take, apply)."""
        weight = {"forward": 1.0, "backward": 2.0, "last": 3.0}.get(kind.split("-")[0], 0.0)
        return weight * self.call_s, 0.0

    def identity(self, state_dir: Path) -> Identity:
        return self.host.identity

    def client(
        self, identity: Identity, transport: rpc.TransportConfig, metrics: Metrics
    ) -> SimTensorClient:
        return self.network.client(self.host)

    @asynccontextmanager
    async def serve(
        self,
        services: Sequence[rpc.Service],
        listen: Address,
        transport: rpc.TransportConfig,
        metrics: Metrics,
        identity: Identity,
    ) -> AsyncIterator[_Served]:
        SimNetwork.serve(self.host, services)
        yield _Served(parse_address(self.host.address))

    async def advertised(self, served: Served, peers: Sequence[str]) -> Address:
        return served.address

    def dht(self, identity: Identity, client: rpc.UnaryCaller, config: DHTConfig) -> DHTNode:
        return DHTNode(
            identity,
            client,
            config,
            clock=functools.partial(self.network.wall, self.host),
            timer=trio.current_time,
            rng=random.Random(self.rng.getrandbits(64)),
        )


class Recorder(Progress):
    """A peer's progress events as a list (virtual time in ``t``), not printed lines."""

    def __init__(self) -> None:
        super().__init__("json")
        self.events: list[Event] = []

    def event(self, kind: str, text: str, **fields: Any) -> None:
        now = trio.current_time()
        if kind in NOTICE_KINDS:
            self.notices.append(Notice(round(now, 3), kind, text[:MAX_NOTICE_TEXT]))
        self.events.append({"event": kind, "t": now, "text": text, **fields})

    def announce(self, event: str, **fields: object) -> None:
        self.events.append({"event": event, "t": trio.current_time(), **fields})

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["event"] == kind]


class PeerLogs(logging.Handler):
    """Keeps each simulated host's log records of ``level`` and above in its `Host.logs`, as
    "virtual time, logger: message" (a daemon's stderr, for a failing test's message)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)

    def emit(self, record: logging.LogRecord) -> None:
        host = current_host.get()
        if host is not None:
            host.logs.append(f"{trio.current_time():8.2f} {record.name}: {record.getMessage()}")


@dataclass
class SimPeer:
    name: str
    net: SimNet
    peer: Peer
    out: Recorder
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Set when its lifecycle has returned, raised, or been killed.
    done: trio.Event = field(default_factory=trio.Event)
    #: What its lifecycle raised (None: it returned, or was killed).
    error: BaseException | None = None

    @property
    def address(self) -> str:
        return self.net.host.address

    @property
    def logs(self) -> list[str]:
        """Its warnings (`PeerLogs`, installed by `SimPeers.run`)."""
        return self.net.host.logs


class SimPeers:
    """Peers of one run on one SimNetwork, made and started by a test or a scenario."""

    def __init__(
        self,
        root: Path,
        *,
        seed: int,
        network: NetworkConfig | None = None,
        timings: TimingProfile | None = None,
        strategies: Strategies = STRATEGIES,
    ) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.net = SimNetwork(network, seed)
        self.timings = timings or TimingProfile()
        self.strategies = strategies
        self.peers: list[SimPeer] = []

    async def bootstrap(self, nursery: trio.Nursery) -> str:
        """A DHT-only node (`swarmd dht`) started in ``nursery``; returns its address."""
        host = self.net.add_host(seeded_identity(self.rng))
        node = SimNet(self.net, host, random.Random(self.rng.getrandbits(64))).dht(
            host.identity, self.net.client(host), self.timings.dht
        )
        SimNetwork.serve(host, [node.service()])
        await nursery.start(node.run, 4000, [])
        return host.address

    def add(
        self,
        name: str,
        *,
        run: str,
        peers: Sequence[str],
        create_run: RunConfig | None = None,
        max_steps: int | None = None,
        step_s: float = 0.0,
        reachable: bool = True,
        **more: Any,
    ) -> SimPeer:
        """A peer (not started) with its own state directory under ``root/name``; ``more``:
        more of JoinOptions' fields (a SWARM peer's ``role`` and ``stage``)."""
        host = self.net.add_host(seeded_identity(self.rng), dialable=reachable)
        net = SimNet(self.net, host, random.Random(self.rng.getrandbits(64)), step_s)
        options = JoinOptions(
            run=run,
            state_dir=self.root / name,
            peers=tuple(peers),
            create_run=create_run,
            max_steps=max_steps,
            log_format="json",
            progress_interval_s=600.0,
            bulk_port=None,
            reachable="yes" if reachable else "no",
            **more,
        )
        options.state_dir.mkdir(parents=True, exist_ok=True)
        peer = Peer(options, self.strategies, net, self.timings)
        out = peer.out = Recorder()
        sim_peer = SimPeer(name, net, peer, out)
        self.peers.append(sim_peer)
        return sim_peer

    def run_of(
        self,
        config: RunConfig,
        count: int,
        boot: str,
        *,
        max_steps: int | None = None,
        step_s: float = 0.0,
    ) -> list[SimPeer]:
        """``count`` more peers (not started) of ``config``'s run, joining through ``boot``;
        the simulation's first peer creates the run."""
        return [
            self.add(
                f"p{len(self.peers)}",
                run=config.name,
                peers=[boot],
                create_run=None if self.peers else config,
                max_steps=max_steps,
                step_s=step_s,
            )
            for _ in range(count)
        ]

    async def run(self, peer: SimPeer) -> None:
        """Runs ``peer``'s lifecycle until it returns, raises (kept in ``error``) or is killed;
        then its server is gone (calls to it are refused, as a closed port's are)."""
        current_host.set(peer.net.host)
        swarmd_log = logging.getLogger("swarmd")
        if not any(isinstance(h, PeerLogs) for h in swarmd_log.handlers):
            swarmd_log.addHandler(PeerLogs())
        try:
            with peer.scope:
                await peer.peer.run()
        except Exception as exc:  # a test asserts on it; one peer must not end the others
            log.warning("%s: %r", peer.name, exc)
            peer.error = exc
        finally:
            peer.net.host.listening = False
            peer.done.set()

    def kill(self, peer: SimPeer) -> None:
        """Gone at once, as a killed process: its tasks end and nobody reaches its host."""
        self.net.kill(peer.address)
        peer.scope.cancel()

    def stop(self, peer: SimPeer) -> None:
        """As SIGTERM: the peer stops at its next step boundary and leaves."""
        peer.out.event("leaving", "SIGTERM: leaving the run")
        peer.peer.stopping.set()
