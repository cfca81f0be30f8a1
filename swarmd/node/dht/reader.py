"""KeyReader: one key read again and again by one node, transferring and merging only what
changed (matchmaking's polls, membership's heartbeats)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import trio

from swarmd.node.dht.records import Record
from swarmd.node.dht.service import MAX_KNOWN
from swarmd.node.dht.storage import Storage
from swarmd.node.dht.values import (
    Value,
    announced_peers,
    announcer,
    key_bytes,
    merge,
    newest,
    peer_named,
    subkey_text,
    value_of,
)
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
    """Reads one key again and again, transferring and merging only what changed.

    A matchmaking round polls its key until the group is full; every node asked used to send
    every announcement back on every poll (a third of a round's DHT bytes). The reader keeps
    the records it has read and lists their fingerprints in each Find; nodes leave those out.

    The merged map is kept up to date record by record, and `peers_changed` hands a caller
    only the announcements that are new since its last call: a roll call's polls each merged
    and walked all of its key's announcements again, O(N) a poll and O(N²) a round over the
    run (1,000 simulated peers: a third of the run's CPU). Only an expiry, or a plain value
    under the key, merges everything again.
    """

    def __init__(self, node: _Node, key: str | bytes) -> None:
        self._node = node
        self._key = key_bytes(key)
        self._held: dict[bytes, Record] = {}
        #: The earliest expiry among the held records: until then none has lapsed.
        self._first_expiry_ms = math.inf
        #: Each sub-key's winning record, the merged map of them, and its announcements.
        self._winners: dict[bytes, Record] = {}
        self._merged: dict[str, Value] = {}
        self._peers: dict[PeerId, Value] = {}
        #: Whether a plain (sub-key-less) record is held: then `merge` decides alone.
        self._plain = False
        #: Announcements new or changed since the last `peers_changed`.
        self._changed: dict[PeerId, Value] = {}

    async def records(self, *, light: bool = False, local: bool = False) -> list[Record]:
        """Every live record read so far or now (``light``: see DHTNode.get_records;
        ``local``: only what this node holds, no network)."""
        await self._read(light, local)
        return list(self._held.values())

    async def get_map(self, *, light: bool = False, local: bool = False) -> dict[str, Value]:
        """The key's sub-key map as read so far (the newest version of each entry)."""
        await self._read(light, local)
        return self._node.admitted(self._key, self._merged)

    async def peers(self, *, light: bool = False, local: bool = False) -> dict[PeerId, Value]:
        """Every announcement under the key as read so far (see `announced_peers`)."""
        await self._read(light, local)
        admitted = self._node.admitted(self._key, self._merged)
        if admitted is not self._merged:  # the run's access rules left some out
            return announced_peers(admitted)
        return dict(self._peers)

    async def peers_changed(
        self, *, light: bool = False, local: bool = False
    ) -> dict[PeerId, Value]:
        """The announcements new or changed since this reader's last call of this method
        (all of them at the first): what a poll learnt, without walking what it knew. One
        withdrawn or lapsed since is not reported (a gathering counts who came). One the
        run's access rules do not admit yet stays pending and is handed over once they do:
        a peer learns who is allowed as the run goes, and dropped at its first read, a
        member read before it was known to be allowed was never seen again (CI rehearsal:
        a secret run's two peers averaged apart)."""
        await self._read(light, local)
        if not self._changed:
            return {}
        admitted = self._node.admitted(self._key, {str(p): v for p, v in self._changed.items()})
        news = {p: v for p, v in self._changed.items() if str(p) in admitted}
        self._changed = {p: v for p, v in self._changed.items() if str(p) not in admitted}
        return news

    def next_store(self) -> trio.Event:
        """Set when this node next stores a record under the key (Storage.next_store)."""
        return self._node.storage.next_store(self._key)

    async def _read(self, light: bool, local: bool) -> None:
        now_ms = int(self._node.now() * 1000)
        if now_ms >= self._first_expiry_ms:
            self._held = {f: r for f, r in self._held.items() if r.expires_ms > now_ms}
            self._rebuild(now_ms)
        known = list(self._held)[-MAX_KNOWN:]
        found = await self._node.get_records(self._key, light=light, local=local, known=known)
        new = [r for r in found if r.fingerprint not in self._held]
        if not new:
            return
        for record in new:
            self._held[record.fingerprint] = record
            self._first_expiry_ms = min(self._first_expiry_ms, record.expires_ms)
        now_ms = int(self._node.now() * 1000)
        if self._plain or any(r.subkey is None for r in new):
            self._rebuild(now_ms)
            return
        for record in new:
            subkey = record.subkey
            assert subkey is not None
            old = self._winners.get(subkey)
            if record.expires_ms > now_ms and (old is None or record.supersedes(old)):
                self._winners[subkey] = record
                self._set(subkey_text(subkey), value_of(record))

    def _set(self, subkey: str, value: Value) -> None:
        """One entry of the merged map replaced, and the announcements kept in step."""
        self._merged[subkey] = value
        peer = announcer(subkey, value)
        if peer is not None:
            self._peers[peer] = self._changed[peer] = value
        elif (named := peer_named(subkey)) is not None:
            self._peers.pop(named, None)  # withdrawn
            self._changed.pop(named, None)

    def _rebuild(self, now_ms: int) -> None:
        """Merges every held record again (after an expiry, or with a plain value held)."""
        held = list(self._held.values())
        self._first_expiry_ms = min((r.expires_ms for r in held), default=math.inf)
        self._plain = any(r.subkey is None for r in held)
        _, self._winners = newest(held, now_ms)
        if self._plain:
            merged = merge(held, now_ms / 1000)
            self._merged = merged if isinstance(merged, dict) else {}
        else:
            self._merged = {subkey_text(k): value_of(r) for k, r in self._winners.items()}
        before, self._peers = self._peers, announced_peers(self._merged)
        self._changed = {p: v for p, v in self._changed.items() if p in self._peers}
        for peer, value in self._peers.items():
            if before.get(peer) != value:
                self._changed[peer] = value
