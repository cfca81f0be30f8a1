"""The DHT at scale in virtual time: N real `DHTNode`s on a `SimNetwork`, a share of them
killed, then gets of keys stored before the killing (issue 45: 10,000 nodes, 30 % killed,
1,000 gets, success >= 0.99, median hops <= 4)."""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmd.node.dht.config import DHTConfig
from swarmd.node.dht.node import DHTNode
from swarmd.node.dht.records import Verifier
from swarmd.node.sim.network import Host, NetworkConfig, SimNetwork
from swarmd.node.sim.virtual import run_virtual
from swarmd.protocol.identity import Identity


@dataclass(frozen=True)
class DhtScenario:
    nodes: int = 1000
    #: Share of the nodes killed (silently: they stop answering) after the keys are stored.
    killed: float = 0.3
    #: Keys stored before the killing, then each read once by a random live node.
    gets: int = 1000
    #: Nodes join at uniform random times over this many virtual seconds.
    join_window_s: float = 60.0
    #: Virtual seconds between the killing and the gets (no refresh can hide the dead).
    settle_s: float = 10.0
    seed: int = 0
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("a DHT scenario needs at least 2 nodes")
        if not 0 <= self.killed < 1:
            raise ValueError("killed is the share of nodes killed, below 1")
        if self.gets < 1:
            raise ValueError("gets must be at least 1")
        if self.join_window_s < 0 or self.settle_s < 0:
            raise ValueError("join_window_s and settle_s must be >= 0")


@dataclass(frozen=True)
class DhtReport:
    nodes: int
    killed: int
    gets: int
    found: int
    median_hops: float
    p90_hops: float
    calls: int
    #: The network's trace digest (every call: when, who, to whom, what): equal on every run
    #: of one seed.
    log_hash: str
    virtual_s: float
    wall_s: float

    @property
    def success(self) -> float:
        return self.found / self.gets


def seeded_identity(rng: random.Random) -> Identity:
    """An identity drawn from the run's seed: the same peer ids (so the same routing) on
    every run of a seed. Never for a real peer, whose key must come from the OS."""
    return Identity(Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)))


class DhtSwarm:
    """N real DHTNodes on one SimNetwork, each in its own cancel scope (killing one cancels
    its tasks and silences its host). Identities and RNGs come from ``seed``."""

    def __init__(self, nodes: int, network: NetworkConfig, dht: DHTConfig, seed: int) -> None:
        self.rng = random.Random(seed)
        self.net = SimNetwork(network, seed)
        self.hosts: list[Host] = []
        self.nodes: list[DHTNode] = []
        self.scopes: list[trio.CancelScope] = []
        self.dht = dht
        #: One record cache for all nodes: every reader of a round's key verified each of its
        #: announcements, a million Ed25519 checks a round at 1,000 peers, for one answer each.
        self.verifier = Verifier(capacity=1 << 18)
        for _ in range(nodes):
            self._make()
        self.joined: list[int] = []

    def _make(self) -> int:
        identity = seeded_identity(self.rng)
        host = self.net.add_host(identity)
        node = DHTNode(
            identity,
            self.net.client(host),
            self.dht,
            clock=functools.partial(self.net.wall, host),
            timer=trio.current_time,
            rng=random.Random(self.rng.getrandbits(64)),
            verifier=self.verifier,
        )
        self.net.serve(host, [node.service()])
        self.hosts.append(host)
        self.nodes.append(node)
        self.scopes.append(trio.CancelScope())
        return len(self.nodes) - 1

    async def join(self, nursery: trio.Nursery, window_s: float) -> None:
        """Starts every node: the first at once, the others at uniform random times over
        ``window_s`` (each bootstraps from the first and two that joined before it); returns
        once the window is over and the last joiner has had time to finish."""
        nursery.start_soon(self._run_node, 0, 0.0)
        await trio.sleep(1.0)
        for i in range(1, len(self.nodes)):
            nursery.start_soon(self._run_node, i, self.rng.uniform(0, window_s))
        await trio.sleep(window_s + 5.0)

    async def start(self, nursery: trio.Nursery, i: int) -> None:
        """Starts node ``i`` now; returns once it has joined (a test's own join order)."""
        await nursery.start(self._run_node, i, 0.0)

    async def _run_node(
        self, i: int, delay: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with self.scopes[i]:
            await trio.sleep(delay)
            others = self.rng.sample(self.joined, min(2, len(self.joined)))
            boot = [self.hosts[0].address] + [self.hosts[j].address for j in others]
            async with trio.open_nursery() as nursery:
                await nursery.start(self.nodes[i].run, 4000, boot if i else [])
                self.joined.append(i)
                task_status.started()

    def kill(self, i: int) -> None:
        self.net.kill(self.hosts[i].address)
        self.scopes[i].cancel()
        if i in self.joined:
            self.joined.remove(i)

    def add(self, nursery: trio.Nursery) -> int:
        """A new node (a volunteer arriving mid-run), joining at once; returns its index."""
        i = self._make()
        nursery.start_soon(self._run_node, i, 0.0)
        return i


async def _scenario(scenario: DhtScenario, progress: Callable[[str], None]) -> DhtReport:
    wall0 = time.monotonic()

    def say(what: str) -> None:
        progress(
            f"[{time.monotonic() - wall0:7.1f}s wall, {trio.current_time():6.1f}s virtual] {what}"
        )

    say(f"making {scenario.nodes} nodes (seed {scenario.seed})")
    swarm = DhtSwarm(scenario.nodes, scenario.network, scenario.dht, scenario.seed)
    rng = random.Random(scenario.seed + 1)
    t0 = trio.current_time()
    say(f"joining them over {scenario.join_window_s:g} virtual seconds")
    async with trio.open_nursery() as nursery:
        await swarm.join(nursery, scenario.join_window_s)
        keys = [f"sim/key/{i}" for i in range(scenario.gets)]
        expires = swarm.net.wall() + 3600

        async def store(key: str) -> None:
            node = swarm.nodes[rng.randrange(scenario.nodes)]
            await node.store(key, key.encode(), expires)

        say(f"storing {len(keys)} keys")
        async with trio.open_nursery() as stores:
            for key in keys:
                stores.start_soon(store, key)
        doomed = rng.sample(range(scenario.nodes), int(scenario.killed * scenario.nodes))
        for i in doomed:
            swarm.kill(i)
        say(f"killed {len(doomed)} nodes; reading every key from a live node")
        await trio.sleep(scenario.settle_s)
        dead = set(doomed)
        live = [i for i in range(scenario.nodes) if i not in dead]
        hops: list[int] = []
        found = 0

        async def get(key: str) -> None:
            nonlocal found
            result = await swarm.nodes[rng.choice(live)].find_value(key)
            if any(r.value == key.encode() for r in result.records):
                found += 1
                hops.append(result.hops)

        async with trio.open_nursery() as gets:
            for key in keys:
                gets.start_soon(get, key)
        nursery.cancel_scope.cancel()
    hops.sort()
    return DhtReport(
        nodes=scenario.nodes,
        killed=len(doomed),
        gets=scenario.gets,
        found=found,
        median_hops=statistics.median(hops) if hops else float("nan"),
        p90_hops=float(hops[int(0.9 * (len(hops) - 1))]) if hops else float("nan"),
        calls=swarm.net.calls,
        log_hash=swarm.net.trace.hexdigest(),
        virtual_s=trio.current_time() - t0,
        wall_s=time.monotonic() - wall0,
    )


def run_dht(scenario: DhtScenario, progress: Callable[[str], None] | None = None) -> DhtReport:
    """Runs the scenario in virtual time (trio's MockClock, autojump); ``progress`` hears
    each phase as it begins."""
    return run_virtual(_scenario, scenario, progress or (lambda _: None), seed=scenario.seed)
