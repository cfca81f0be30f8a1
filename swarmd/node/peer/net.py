"""Where a peer's calls go and where it is served: the daemon's sockets, or the simulator's.

The lifecycle (lifecycle.py) takes one `PeerNet` and reaches the network only through it: the
client every component calls with, the server its services are answered by, the address it
tells others, its DHT node's clocks and randomness, and whether the OS's signals stop it. A
daemon uses `SocketNet` (gRPC and the bulk plane on real sockets, the OS's clocks); the
simulator (swarmd/node/sim/peers.py) runs the same lifecycle over its in-memory network in
virtual time, so one seed replays a whole run of real peers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

import trio

from swarmd.node.dht import DHTNode
from swarmd.node.dht.config import DHTConfig
from swarmd.node.metrics import Metrics
from swarmd.node.peer.advertise import advertised_address
from swarmd.protocol import rpc
from swarmd.protocol.address import Address
from swarmd.protocol.identity import Identity


class PeerClient(rpc.TensorCaller, Protocol):
    """The client a peer's components share: unary and tensor calls, the run's access tag."""

    #: Tags each request with the run's access proof once the peer has joined (access.py).
    access_tag: Callable[[str, bytes], bytes] | None

    def close(self) -> None: ...


class Served(Protocol):
    """Where the peer's services answer (RpcServer, or a simulated host)."""

    @property
    def address(self) -> Address: ...

    @property
    def bulk_port(self) -> int: ...


class PeerNet(Protocol):
    #: Whether SIGINT/SIGTERM stop the peer (a daemon); the simulator stops its peers itself.
    signals: bool
    #: The peer's random choices (seeded from the OS; from the seed in the simulator).
    rng: random.Random

    async def inner_step(self) -> None:
        """After each inner step: nothing in a daemon, where the step took its own time; in
        the simulator, which runs steps inline in no virtual time, the simulated device's
        step time (and the wait of a paused host)."""
        ...

    def monotonic(self) -> float:
        """Seconds for the peer's own timeouts (a state donor's leases): the OS's monotonic
        clock, or virtual time."""
        ...

    def wall(self) -> float:
        """The wall clock (SWARM's stage rounds fall on its boundaries): the OS's, or the
        simulated host's."""
        ...

    def device_s(self, kind: str, took: float) -> tuple[float, float]:
        """A compute of ``kind`` ("forward", "backward", "last", ...: SWARM's stage calls)
        that ran for ``took`` seconds: how long it counts as taking, and how much of that
        has passed already. A daemon: (took, took); the simulator runs it inline in no
        virtual time and charges its device model's time: (charged, 0)."""
        ...

    def identity(self, state_dir: Path) -> Identity:
        """Who the peer is: its key in ``state_dir`` (a daemon), or the seed's (simulated)."""
        ...

    def client(
        self, identity: Identity, transport: rpc.TransportConfig, metrics: Metrics
    ) -> PeerClient: ...

    def serve(
        self,
        services: Sequence[rpc.Service],
        listen: Address,
        transport: rpc.TransportConfig,
        metrics: Metrics,
        identity: Identity,
    ) -> AbstractAsyncContextManager[Served]: ...

    async def advertised(self, served: Served, peers: Sequence[str]) -> Address:
        """The address others dial this peer at."""
        ...

    def dht(self, identity: Identity, client: PeerClient, config: DHTConfig) -> DHTNode:
        """The peer's DHT node, on this network's clocks."""
        ...


class SocketNet:
    """A daemon's network: gRPC and the bulk plane on real sockets, the OS's clocks."""

    signals = True

    def __init__(self) -> None:
        self.rng = random.Random()

    async def inner_step(self) -> None:
        return None

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def device_s(self, kind: str, took: float) -> tuple[float, float]:
        return took, took

    def identity(self, state_dir: Path) -> Identity:
        return Identity.load_or_create(state_dir)

    def client(
        self, identity: Identity, transport: rpc.TransportConfig, metrics: Metrics
    ) -> rpc.RpcClient:
        return rpc.RpcClient(identity, transport, metrics)

    def serve(
        self,
        services: Sequence[rpc.Service],
        listen: Address,
        transport: rpc.TransportConfig,
        metrics: Metrics,
        identity: Identity,
    ) -> AbstractAsyncContextManager[rpc.RpcServer]:
        return rpc.serve(
            services,
            listen.host,
            listen.port,
            config=transport,
            observer=metrics,
            identity=identity,
        )

    async def advertised(self, served: Served, peers: Sequence[str]) -> Address:
        # Blocking (it may resolve names): a worker thread, not the loop.
        return await trio.to_thread.run_sync(advertised_address, served.address, peers)

    def dht(self, identity: Identity, client: PeerClient, config: DHTConfig) -> DHTNode:
        return DHTNode(identity, client, config)
