"""`swarmd dht`: a DHT-only node, e.g. a bootstrap node a volunteer runs on a small machine.

It imports only the transport and the DHT (never torch), prints one JSON line with its
address and peer id once it has joined, then logs its routing table size periodically until
SIGINT or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from swarmd.node.dht.node import DHT_TRANSPORT, DHTConfig, open_dht
from swarmd.node.runtime.jsonlines import print_event
from swarmd.protocol import rpc
from swarmd.protocol.address import Address
from swarmd.protocol.identity import Identity

log = logging.getLogger("swarmd.dht")


@dataclass(frozen=True)
class DHTNodeOptions:
    listen: Address = field(default_factory=lambda: Address("127.0.0.1", 0))
    peers: tuple[str, ...] = ()
    state_dir: Path = Path(".")
    log_interval_s: float = 30.0
    config: DHTConfig = field(default_factory=DHTConfig)
    rate_limits: rpc.RateLimits = field(default_factory=rpc.RateLimits)

    def __post_init__(self) -> None:
        if not self.log_interval_s > 0:
            raise ValueError("log_interval_s must be positive")


def _print(event: str, **fields: object) -> None:
    print_event({"event": event, **fields})


async def run_dht_node(options: DHTNodeOptions) -> None:
    """Runs until SIGINT/SIGTERM; raises BootstrapError if no bootstrap peer answers."""
    identity = Identity.load_or_create(options.state_dir)
    async with open_dht(
        identity,
        host=options.listen.host,
        port=options.listen.port,
        bootstrap=options.peers,
        config=options.config,
        transport=dataclasses.replace(DHT_TRANSPORT, rate_limits=options.rate_limits),
    ) as (node, server):
        _print(
            "listening",
            address=str(server.address),
            peer_id=str(identity.peer_id),
            routing_table=len(node.table),
        )
        log.info(
            "DHT node %s listening on %s, %d peers in the routing table",
            identity.peer_id,
            server.address,
            len(node.table),
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def report() -> None:
                    while True:
                        await trio.sleep(options.log_interval_s)
                        log.info("DHT node %s: %s", server.address, node.stats())

                nursery.start_soon(report)
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    break
                nursery.cancel_scope.cancel()
    _print("stopped")


def parse_peers(items: Sequence[str]) -> tuple[str, ...]:
    """Flattens repeated and comma-separated --peers values; validates each HOST:PORT."""
    from swarmd.protocol.address import parse_address

    found: list[str] = []
    for item in items:
        for part in item.split(","):
            if part.strip():
                found.append(str(parse_address(part)))
    return tuple(found)
