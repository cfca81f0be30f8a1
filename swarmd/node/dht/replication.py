"""Where a store puts a record: on the `replicas` nodes closest to its key, one bulk Store
per node.

Kept apart from DHTNode, which decides what to store and when (a store, a re-publish), because
placement has state of its own: the last lookup that found the whole network, which spares a
small run's stores a lookup each, and the neighbourhoods of keys looked up lately, which spare
a large run's repeated stores and reads of one key theirs (see Replicator.closest_nodes).
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
#: How long the k nodes a lookup found closest to a target stand in for the next lookups of
#: it (Replicator.near), and how many targets are remembered.
NEAR_S = 30.0
NEAR_KEPT = 256


class Replicator:
    """Stores records for one DHTNode; ``find_nodes(target, width)`` is its node lookup (no
    key, no quorum) for the ``width`` closest nodes."""

    def __init__(
        self,
        config: DHTConfig,
        caller: Caller,
        table: RoutingTable,
        storage: Storage,
        find_nodes: Callable[[int, int], Awaitable[LookupResult]],
    ) -> None:
        self.config = config
        #: How many nodes a record goes to (DHTConfig.replicas, at most k).
        self.replicas = min(config.replicas, config.k)
        self.caller = caller
        self.table = table
        self.storage = storage
        self._find_nodes = find_nodes
        #: (when, nodes): the last node lookup that found fewer than k nodes, i.e. all of them.
        self._whole_network: tuple[float, frozenset[tuple[PeerId, str]]] | None = None
        #: target -> (when, the lookup's width, the closest nodes it found, closest first).
        self._near: dict[int, tuple[float, int, list[tuple[PeerId, str]]]] = {}

    def near(self, target: int) -> list[tuple[PeerId, str]]:
        """The closest nodes a node lookup found for ``target`` within NEAR_S (else []).

        A matchmaking round stores an announcement under its key, reads the key a few times,
        and its leader stores again: each was a lookup from this node's own contacts, several
        hops to the key's neighbourhood. In a simulated 64-peer DiLoCo run those lookups were
        about a third of a round's Finds (40 a peer-round of 117). Within NEAR_S the
        neighbourhood is taken as found: a store goes straight to it, and a get starts its
        lookup there (a node that left since fails and is passed over; one that joined nearer
        since is found in the routing table, and the entry is dropped: see `_outgrown`)."""
        entry = self._near.get(target)
        if entry is None or trio.current_time() - entry[0] >= NEAR_S:
            return []
        if self._outgrown(target, entry[1], entry[2]):
            del self._near[target]
            return []
        return entry[2]

    def _outgrown(self, target: int, width: int, nodes: list[tuple[PeerId, str]]) -> bool:
        """Whether the routing table holds a node nearer ``target`` than the farthest of
        ``nodes`` (any node, while they are fewer than the lookup's ``width``) that they lack.

        A heartbeat is re-stored every ttl/3 (10 s) and used to go to the neighbourhood its
        first store found for NEAR_S (30 s): nodes that joined since held none of it, and a
        read that stopped at three holders among them missed a live peer for up to 30 s (CI:
        a peer counted 4 of 5 live peers for two rounds). A joiner near the key shows here
        first: it looks itself up through its neighbours, who add it to their tables."""
        held = {peer for peer, _ in nodes}
        full = len(nodes) >= width
        bound = node_id(nodes[-1][0]) ^ target if full and nodes else None
        for contact in self.table.closest(target, width):
            if contact.peer_id not in held and (bound is None or contact.id ^ target < bound):
                return True
        return False

    def _remember(self, target: int, width: int, nodes: list[tuple[PeerId, str]]) -> None:
        now = trio.current_time()
        if len(self._near) >= NEAR_KEPT:
            self._near = {t: e for t, e in self._near.items() if now - e[0] < NEAR_S}
            while len(self._near) >= NEAR_KEPT:
                del self._near[next(iter(self._near))]
        self._near[target] = (now, width, nodes)

    async def closest_nodes(self, target: int) -> list[tuple[PeerId, str]]:
        """The `replicas` nodes closest to ``target``, for a store.

        A node lookup that finds fewer than k nodes, every one answering, has found the whole
        network, and the closest to any target are then among it. In a small run (the usual
        case: a handful of peers) every store used to repeat that lookup, asking every node
        for its contacts: with each peer storing an announcement, a group record and a state
        advert per round, that was about half of a streaming fragment sync's DHT bytes. For
        WHOLE_NETWORK_S after such a lookup, and only while the routing table holds exactly
        the nodes it found (a node that joined, left or moved shows there first), stores use
        that set instead.

        A routing table of k contacts or more means a network larger than k: the lookup then
        waits only for the `replicas` closest (on 64 processes, 18 ms against 33 for 20).
        """
        replicas = self.replicas
        whole = self._whole_network
        if whole is not None:
            at, nodes = whole
            table = frozenset((c.peer_id, c.address) for c in self.table.contacts())
            if trio.current_time() - at < WHOLE_NETWORK_S and table == nodes:
                return sorted(nodes, key=lambda node: node_id(node[0]) ^ target)[:replicas]
        if near := self.near(target):
            return near[:replicas]
        k = self.config.k
        width = k if len(self.table) < k else replicas
        result = await self._find_nodes(target, width)
        # Every node asked answered (none timed out or failed), and they were fewer than k.
        complete = result.queried == len(result.closest) < width == k and not result.failed
        self._whole_network = (trio.current_time(), frozenset(result.closest)) if complete else None
        if complete or len(result.closest) == width:
            self._remember(target, width, result.closest)
        return result.closest[:replicas]

    async def replicate(self, records: list[Record]) -> list[int]:
        """Stores each record on its `replicas` closest nodes; one bulk Store per destination."""
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
            # This node keeps a replica too if it is among the closest.
            near = len(nodes) < self.replicas or own_id ^ target < node_id(nodes[-1][0]) ^ target
            if near:
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
