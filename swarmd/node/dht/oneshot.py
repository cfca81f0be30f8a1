"""A client-only DHT node for commands that read or write a few records and leave."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from swarmd.node.dht.node import DHTNode
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity


@asynccontextmanager
async def client_dht(identity: Identity, peers: Sequence[str]) -> AsyncIterator[DHTNode]:
    """Joined through `peers` without a server (port 0): nobody enters it in a routing table,
    and it is gone when the block ends (`swarmd status`, `swarmd run allow`). Raises
    BootstrapError (in a group, as `open_dht`'s callers see it) when nobody answers."""
    client = rpc.RpcClient(identity)
    dht = DHTNode(identity, client)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(dht.run, 0, list(peers))
            yield dht
            nursery.cancel_scope.cancel()
    finally:
        client.close()
