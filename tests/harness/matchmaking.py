"""Peers that meet through real DHT nodes on the simulated network (swarmd/node/sim), each
serving a real Averager: matchmaking and the all-reduce after it, in virtual time.

These tests ran on loopback sockets in the pytest process with wall-clock gather windows,
and formed two groups (or none) whenever another pytest worker loaded the machine: their
deadlines measured the machine, not the protocol. In virtual time a deadline passes only
when every task waits, so the figures they assert are the protocol's own. Real sockets
between real processes are `swarmd join`'s tests (tests/integration/test_join.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Group, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht.config import DHTConfig
from swarmd.node.dht.node import DHTNode
from swarmd.node.metrics import Metrics
from swarmd.node.sim.dht import DhtSwarm
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.virtual import run_virtual
from swarmd.protocol.identity import Identity

#: Groups of up to 4, gathered and committed within seconds.
FAST = MatchmakingConfig(target_group_size=4, min_group_size=2, gather_s=3.0, commit_wait_s=3.0)

#: An address no simulated host has: a call there waits out its deadline, as one to a peer
#: behind NAT does on the internet (no refusal comes back through a home router).
UNREACHABLE = "10.255.255.1:4000"


class Peer:
    """One peer: its identity, Averager, DHT node and metrics, and the member it announces."""

    def __init__(
        self, identity: Identity, averager: Averager, dht: DHTNode, address: str, metrics: Metrics
    ) -> None:
        self.metrics = metrics
        self.identity = identity
        self.averager = averager
        self.dht = dht
        self.member = Member(identity.peer_id, address)


@asynccontextmanager
async def matchmaking_peers(
    n: int, config: AllReduceConfig | None = None, *, seed: int = 0
) -> AsyncIterator[list[Peer]]:
    """`n` joined peers (run it inside `run_sim`); their nodes stop on exit."""
    swarm = DhtSwarm(n, NetworkConfig(), DHTConfig(), seed)
    peers = []
    for host, node in zip(swarm.hosts, swarm.nodes, strict=True):
        metrics = Metrics()
        averager = Averager(
            swarm.net.client(host),
            host.identity.peer_id,
            config or AllReduceConfig(codec="fp32"),
            metrics,
        )
        swarm.net.serve(host, [averager.service()])
        peers.append(Peer(host.identity, averager, node, host.address, metrics))
    async with trio.open_nursery() as nursery:
        await swarm.join(nursery, 1.0)
        yield peers
        nursery.cancel_scope.cancel()


def run_sim(main: Callable[[], Awaitable[None]], seed: int = 0) -> None:
    """``main`` in virtual time (sim/virtual.py), seeded."""
    run_virtual(main, seed=seed)


async def form_all(peers: list[Peer], key: str, config: MatchmakingConfig) -> list[Group | None]:
    """Every peer asks for a group under `key` at once; the group each one got (or None)."""
    groups: list[Group | None] = [None] * len(peers)

    async def one(i: int) -> None:
        groups[i] = await form_group(peers[i].dht, key, peers[i].member, config)

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            nursery.start_soon(one, i)
    return groups
