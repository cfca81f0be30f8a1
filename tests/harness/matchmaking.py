"""Peers in one process that meet through a real DHT on loopback, each serving an Averager:
matchmaking and the all-reduce after it, without a process per peer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from swarmd.node.averaging.allreduce import AllReduceConfig, Averager, Group, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.dht import DHTConfig, open_dht
from swarmd.node.metrics import Metrics
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity

#: Groups of up to 4, gathered and committed within seconds.
FAST = MatchmakingConfig(target_group_size=4, min_group_size=2, gather_s=3.0, commit_wait_s=3.0)


class Peer:
    """One peer: its identity, Averager, DHT node and metrics, and the member it announces."""

    def __init__(
        self, identity: Identity, averager: Averager, dht: object, address: str, metrics: Metrics
    ) -> None:
        self.metrics = metrics
        self.identity = identity
        self.averager = averager
        self.dht = dht
        self.member = Member(identity.peer_id, address)


@asynccontextmanager
async def matchmaking_peers(
    n: int, config: AllReduceConfig | None = None
) -> AsyncIterator[list[Peer]]:
    """`n` peers, the first one everyone's bootstrap; all closed on exit."""
    async with AsyncExitStack() as stack:
        peers: list[Peer] = []
        bootstrap: list[str] = []
        for _ in range(n):
            identity = Identity.generate()
            client = rpc.RpcClient(identity)
            stack.callback(client.close)
            metrics = Metrics()
            averager = Averager(
                client, identity.peer_id, config or AllReduceConfig(codec="fp32"), metrics
            )
            node, server = await stack.enter_async_context(
                open_dht(
                    identity,
                    bootstrap=bootstrap,
                    config=DHTConfig(lookup_timeout_s=2.0),
                    extra_services=[averager.service()],
                )
            )
            bootstrap = bootstrap or [str(server.address)]
            peers.append(Peer(identity, averager, node, str(server.address), metrics))
        yield peers


async def form_all(peers: list[Peer], key: str, config: MatchmakingConfig) -> list[Group | None]:
    """Every peer asks for a group under `key` at once; the group each one got (or None)."""
    groups: list[Group | None] = [None] * len(peers)

    async def one(i: int) -> None:
        groups[i] = await form_group(peers[i].dht, key, peers[i].member, config)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            nursery.start_soon(one, i)
    return groups
