"""What a read returns: the newest version of each slot of a key, as values with their signer.

Kept apart from the node so the merge rule (which version wins, plain value against sub-key
map) is one small function any reader (a get, a watch, `swarmd status`) shares.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from swarmd.node.dht.records import Record, is_peer_subkey
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class Value:
    """A value as read from the DHT, with who signed it and until when it is valid."""

    value: bytes
    expires: float
    owner: PeerId


def key_bytes(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


def _value(record: Record) -> Value:
    return Value(record.value, record.expires, record.owner)


@functools.lru_cache(maxsize=1 << 16)
def _peer_named(subkey: str) -> PeerId | None:
    """The peer a sub-key names, if it is a peer id: parsed once per sub-key (a matchmaking
    read lists every announcement under its key, and parsing them on each read was a fifth
    of a simulated 1,000-peer round's CPU)."""
    return PeerId.from_string(subkey) if is_peer_subkey(subkey.encode()) else None


def announced_peers(entries: dict[str, Value]) -> dict[PeerId, Value]:
    """The entries of a sub-key map that are peers' own announcements (sub-key = signer),
    less withdrawn ones (empty values, see DHTNode.announce)."""
    found: dict[PeerId, Value] = {}
    for subkey, value in entries.items():
        if value.value and _peer_named(subkey) == value.owner:
            found[value.owner] = value
    return found


def merge(records: Sequence[Record], now: float) -> Value | dict[str, Value] | None:
    """Newest version of each slot; a key's sub-key map wins over its plain value if it
    expires later (and the other way round)."""
    now_ms = int(now * 1000)
    plain: Record | None = None
    subs: dict[bytes, Record] = {}
    for r in records:
        if r.expires_ms <= now_ms:
            continue
        if r.subkey is None:
            if plain is None or r.supersedes(plain):
                plain = r
        elif (old := subs.get(r.subkey)) is None or r.supersedes(old):
            subs[r.subkey] = r
    if subs and (plain is None or max(r.expires_ms for r in subs.values()) >= plain.expires_ms):
        return {k.decode("utf-8", "backslashreplace"): _value(r) for k, r in subs.items()}
    return _value(plain) if plain is not None else None
