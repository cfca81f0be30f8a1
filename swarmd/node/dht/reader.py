"""KeyReader: one key read again and again by one node, transferring and merging only what
changed (matchmaking's polls, membership's heartbeats)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import trio

from swarmd.node.dht.records import Record, fingerprint
from swarmd.node.dht.service import MAX_KNOWN
from swarmd.node.dht.storage import Storage
from swarmd.node.dht.values import Value, announced_peers, key_bytes, merge
from swarmd.protocol.identity import PeerId


class _Node(Protocol):
    """What a reader uses of its DHTNode (node.py imports this module)."""

    storage: Storage

    def now(self) -> float: ...

    async def get_records(
        self,
        key: str | bytes,
        *,
        exhaustive: bool = False,
        light: bool = False,
        local: bool = False,
        known: Sequence[bytes] = (),
    ) -> list[Record]: ...

    def admitted(self, key: bytes, entries: dict[str, Value]) -> dict[str, Value]: ...


class KeyReader:
    """Reads one key again and again, transferring only what changed.

    A matchmaking round polls its key until the group is full; every node asked used to send
    every announcement back on every poll (a third of a round's DHT bytes). The reader keeps
    the records it has read and lists their fingerprints in each Find; nodes leave those out.
    """

    def __init__(self, node: _Node, key: str | bytes) -> None:
        self._node = node
        self._key = key_bytes(key)
        self._held: dict[bytes, Record] = {}
        #: The merged map of the held records; None once a read brought or expired some.
        self._merged: dict[str, Value] | None = None

    async def records(self, *, light: bool = False, local: bool = False) -> list[Record]:
        """Every live record read so far or now (``light``: see DHTNode.get_records;
        ``local``: only what this node holds, no network)."""
        now_ms = int(self._node.now() * 1000)
        live = {f: r for f, r in self._held.items() if r.expires_ms > now_ms}
        if len(live) < len(self._held):
            self._held, self._merged = live, None
        known = list(self._held)[-MAX_KNOWN:]
        found = await self._node.get_records(self._key, light=light, local=local, known=known)
        for record in found:
            if (f := fingerprint(record)) not in self._held:
                self._held[f], self._merged = record, None
        return list(self._held.values())

    async def get_map(self, *, light: bool = False, local: bool = False) -> dict[str, Value]:
        """Merged again only when a read brought or expired records (a round's later polls
        mostly bring none, and merging 1,000 announcements each time was a fifth of a
        simulated 1,000-peer round's CPU)."""
        held = await self.records(light=light, local=local)
        if self._merged is None:
            found = merge(held, self._node.now())
            self._merged = found if isinstance(found, dict) else {}
        return self._node.admitted(self._key, self._merged)

    async def peers(self, *, light: bool = False, local: bool = False) -> dict[PeerId, Value]:
        return announced_peers(await self.get_map(light=light, local=local))

    def next_store(self) -> trio.Event:
        """Set when this node next stores a record under the key (Storage.next_store)."""
        return self._node.storage.next_store(self._key)
