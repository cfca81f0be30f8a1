"""What the peer lifecycle lends a strategy: the shared services, output and accounting.

A strategy gets one `PeerContext` and nothing else from the lifecycle, so what every algorithm
may rely on is written down in one place: the run's config, this peer's identity and address,
the DHT, the RPC client, the averager, the state donor and each algorithm's host already
served on the peer's port, metrics, progress output, the stop signal and the wait/held clocks.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import trio

from swarmd.node.averaging.allreduce import Averager
from swarmd.node.dht import DHTNode
from swarmd.node.metrics import Metrics
from swarmd.node.peer.local.ranks import LocalRanks
from swarmd.node.peer.membership import LivePeers
from swarmd.node.peer.net import PeerNet, SocketNet
from swarmd.node.peer.options import JoinOptions
from swarmd.node.peer.progress import Progress, TrainStats
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.statesync.donor import StateDonor
from swarmd.node.timing import TimingProfile
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, PeerId


class Hosted(Protocol):
    """A service an algorithm needs served on every peer's port from the start, before the
    run's config (and so its algorithm) is known: DeMo's all-gather, SWARM's stage calls."""

    def service(self) -> rpc.Service: ...


H = TypeVar("H", bound=Hosted)
T = TypeVar("T")


@dataclass
class WaitClock:
    """Where the trainer's wall time went, for the `stopped` line's utilisation figure."""

    #: Seconds the trainer waited for the network (matchmaking, all-reduce, state sync): with
    #: the run's wall time it gives compute utilisation, 1 - wait / wall.
    wait_s: float = 0.0
    #: Seconds the trainer spent outside inner steps for outer steps (waiting included).
    held_s: float = 0.0
    #: The peer's monotonic clock (its PeerNet's: virtual time in the simulator).
    now: Callable[[], float] = time.monotonic

    def held(self, t0: float) -> float:
        """Adds the time since `t0` to the trainer's time outside inner steps; returns it."""
        held = self.now() - t0
        self.held_s += held
        return held


@dataclass
class PeerContext:
    opts: JoinOptions
    config: RunConfig
    identity: Identity
    #: The address other peers reach this one at (host:port of its gRPC server).
    address: str
    client: rpc.TensorCaller
    dht: DHTNode
    averager: Averager
    donor: StateDonor
    #: Each algorithm's own always-served service, by `algo` (`Strategy.host`): served
    #: whatever the run's algorithm, used only by the one that made it.
    hosts: Mapping[str, Hosted]
    metrics: Metrics
    out: Progress
    live: LivePeers
    #: Set on SIGINT/SIGTERM: the trainer stops at its next step boundary (or stops waiting).
    stopping: trio.Event
    #: Who signed the run's config (this peer, if it created the run): the one peer every
    #: member trusts already, whose state settles which of two groups' states is the run's.
    creator: PeerId | None = None
    stats: TrainStats = field(default_factory=TrainStats)
    clock: WaitClock = field(default_factory=WaitClock)
    #: Others cannot dial this peer (issue 27): it reduces no part and serves no state.
    client_mode: bool = False
    #: This peer's other local ranks (--local-workers N > 1), once started.
    ranks: LocalRanks | None = None
    #: Every protocol timing its components read (node/timing.py).
    timings: TimingProfile = field(default_factory=TimingProfile)
    #: Its network, clocks, random choices and simulated device (peer/net.py): the OS's in
    #: a daemon, virtual and seeded in the simulator.
    net: PeerNet = field(default_factory=SocketNet)

    def __post_init__(self) -> None:
        self.clock.now = self.net.monotonic

    def host(self, algo: str, kind: type[H]) -> H:
        """The service ``algo``'s strategy hosts on this peer (made by its `host`)."""
        host = self.hosts[algo]
        if not isinstance(host, kind):
            raise TypeError(f"{algo}'s host is a {type(host).__name__}, not a {kind.__name__}")
        return host

    def batch_index(self, step: int) -> int:
        """The index of the shard's batch this process trains on at inner step `step`: the
        step itself, or with N local ranks rank 0's of the N batches the ranks take together
        (the ranks are told the step with it)."""
        return step if self.ranks is None else self.ranks.data_index(step)

    async def unless_stopping(self, wait: Callable[[], Awaitable[T]]) -> T | None:
        """``wait()``'s result, or None once the peer is told to stop (SIGINT/SIGTERM) first:
        a leaving peer must not sit out a gather window or a late round before it exits."""
        result: T | None = None
        async with trio.open_nursery() as nursery:

            async def on_stop() -> None:
                await self.stopping.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_stop)
            result = await wait()
            nursery.cancel_scope.cancel()
        return result

    def at_end(self, run_step: int) -> bool:
        """Whether the run's clock has reached the run's end (RunConfig.total_steps)."""
        return 0 < self.config.total_steps <= run_step

    def should_stop(self, step: int, start: float, run_step: int | None = None) -> bool:
        """Signalled, at the user's --max-steps / --duration, or, given the run's clock
        (``run_step``), at the run's end (RunConfig.total_steps)."""
        opts = self.opts
        if self.stopping.is_set():
            return True
        if run_step is not None and self.at_end(run_step):
            return True
        if opts.max_steps is not None and step >= opts.max_steps:
            return True
        return opts.duration_s is not None and self.net.monotonic() - start >= opts.duration_s
