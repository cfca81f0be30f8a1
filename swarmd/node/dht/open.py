"""A DHT-only node with its own server and client: for tools, tests and `swarmd dht`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from swarmd.node.dht.config import DHTConfig
from swarmd.node.dht.node import BootstrapError, DHTNode
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity


@asynccontextmanager
async def open_dht(
    identity: Identity,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    bootstrap: Sequence[str] = (),
    config: DHTConfig | None = None,
    transport: rpc.TransportConfig | None = None,
    clock: Callable[[], float] = time.time,
    extra_services: Sequence[rpc.Service] = (),
) -> AsyncIterator[tuple[DHTNode, rpc.RpcServer]]:
    """A DHT-only node with its own server and client, joined and running in the block."""
    transport = transport or rpc.TransportConfig(max_concurrent_rpcs=16, max_inflight_calls=64)
    client = rpc.RpcClient(identity, transport)
    node = DHTNode(identity, client, config, clock=clock)
    try:
        async with (
            rpc.serve([node.service(), *extra_services], host, port, config=transport) as server,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(node.run, server.address.port, list(bootstrap))
            yield node, server
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nurseries wrap a failed join; callers want to catch BootstrapError itself.
        leaf = _single_leaf(group)
        if isinstance(leaf, BootstrapError):
            raise leaf from None
        raise
    finally:
        client.close()


def _single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
