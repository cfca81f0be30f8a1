"""Where a store puts a record: on the k nodes closest to its key, one bulk Store per node.

Kept apart from DHTNode, which decides what to store and when (a store, a re-publish), because
placement has state of its own: the last lookup that found the whole network, which spares a
small run's stores a lookup each (see Replicator.closest_nodes).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from swarmd.node.dht.caller import Caller
from swarmd.node.dht.config import DHTConfig
from swarmd.node.dht.ids import key_id, node_id
from swarmd.node.dht.lookup import LookupResult
from swarmd.node.dht.records import Record, RecordError
from swarmd.node.dht.routing import RoutingTable
from swarmd.node.dht.storage import Storage
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.dht")

#: How long a lookup that found the whole network stands in for stores' lookups (see
#: Replicator.closest_nodes).
WHOLE_NETWORK_S = 20.0


class Replicator:
    """Stores records for one DHTNode; ``find_nodes`` is its node lookup (no key, no quorum)."""

    def __init__(
        self,
        config: DHTConfig,
        caller: Caller,
        table: RoutingTable,
        storage: Storage,
        find_nodes: Callable[[int], Awaitable[LookupResult]],
    ) -> None:
        self.config = config
        self.caller = caller
        self.table = table
        self.storage = storage
        self._find_nodes = find_nodes
        #: (when, nodes): the last node lookup that found fewer than k nodes, i.e. all of them.
        self._whole_network: tuple[float, frozenset[tuple[PeerId, str]]] | None = None

    async def closest_nodes(self, target: int) -> list[tuple[PeerId, str]]:
        """The k nodes closest to ``target``, for a store.

        A node lookup that finds fewer than k nodes, every one answering, has found the whole
        network, and the k closest to any target are then all of it. In a small run (the usual
        case: a handful of peers) every store used to repeat that lookup, asking every node
        for its contacts: with each peer storing an announcement, a group record and a state
        advert per round, that was about half of a streaming fragment sync's DHT bytes. For
        WHOLE_NETWORK_S after such a lookup, and only while the routing table holds exactly
        the nodes it found (a node that joined, left or moved shows there first), stores use
        that set instead.
        """
        whole = self._whole_network
        if whole is not None:
            at, nodes = whole
            table = frozenset((c.peer_id, c.address) for c in self.table.contacts())
            if trio.current_time() - at < WHOLE_NETWORK_S and table == nodes:
                return sorted(nodes, key=lambda node: node_id(node[0]) ^ target)
        result = await self._find_nodes(target)
        # Every node asked answered (none timed out or failed), and they were fewer than k.
        complete = result.queried == len(result.closest) < self.config.k and not result.failed
        self._whole_network = (trio.current_time(), frozenset(result.closest)) if complete else None
        return result.closest

    async def replicate(self, records: list[Record]) -> list[int]:
        """Stores each record on its k closest nodes; one bulk Store per destination."""
        keys = sorted({r.key for r in records})
        closest: dict[bytes, list[tuple[PeerId, str]]] = {}

        async def find(key: bytes) -> None:
            closest[key] = await self.closest_nodes(key_id(key))

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(find, key)
        by_node: dict[tuple[PeerId, str], list[int]] = {}
        counts = [0] * len(records)
        own_id = self.table.own_id
        for i, record in enumerate(records):
            target = key_id(record.key)
            nodes = closest[record.key]
            # This node keeps a replica too if it is among the k closest.
            if len(nodes) < self.config.k or (own_id ^ target) < (node_id(nodes[-1][0]) ^ target):
                try:
                    self.storage.put(record)
                    counts[i] += 1
                except RecordError as exc:
                    log.debug("not keeping own record locally: %s", exc)
            for node in nodes:
                by_node.setdefault(node, []).append(i)

        async def send(node: tuple[PeerId, str], indices: list[int]) -> None:
            batch = self.config.service.max_batch
            for start in range(0, len(indices), batch):
                chunk = indices[start : start + batch]
                try:
                    resp = await self.caller.store(
                        node[0], node[1], [records[i].to_pb() for i in chunk]
                    )
                except (rpc.RpcError, ProtocolError):
                    return
                for i, outcome in zip(chunk, resp.outcomes, strict=True):
                    if outcome != pb.StoreResponse.REFUSED:
                        counts[i] += 1

        with trio.move_on_after(self.config.lookup_timeout_s):
            async with trio.open_nursery() as nursery:
                for node, indices in by_node.items():
                    nursery.start_soon(send, node, indices)
        return counts
