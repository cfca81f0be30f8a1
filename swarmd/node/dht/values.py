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


def value_of(record: Record) -> Value:
    return Value(record.value, record.expires, record.owner)


def subkey_text(subkey: bytes) -> str:
    """A sub-key as the merged map names it."""
    return subkey.decode("utf-8", "backslashreplace")


@functools.lru_cache(maxsize=1 << 16)
def peer_named(subkey: str) -> PeerId | None:
    """The peer a sub-key names, if it is a peer id: parsed once per sub-key (a matchmaking
    read lists every announcement under its key, and parsing them on each read was a fifth
    of a simulated 1,000-peer round's CPU)."""
    return PeerId.from_string(subkey) if is_peer_subkey(subkey.encode()) else None


def announcer(subkey: str, value: Value) -> PeerId | None:
    """The peer whose own announcement this entry is (its sub-key names its signer), if it
    is one and not withdrawn (an empty value, see DHTNode.announce)."""
    return value.owner if value.value and peer_named(subkey) == value.owner else None


def announced_peers(entries: dict[str, Value]) -> dict[PeerId, Value]:
    """The entries of a sub-key map that are peers' own announcements, less withdrawn ones."""
    found: dict[PeerId, Value] = {}
    for subkey, value in entries.items():
        if (peer := announcer(subkey, value)) is not None:
            found[peer] = value
    return found


def newest(records: Sequence[Record], now_ms: int) -> tuple[Record | None, dict[bytes, Record]]:
    """The newest live plain record, and the newest live record of each sub-key."""
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
    return plain, subs


def merge(records: Sequence[Record], now: float) -> Value | dict[str, Value] | None:
    """Newest version of each slot; a key's sub-key map wins over its plain value if it
    expires later (and the other way round)."""
    plain, subs = newest(records, int(now * 1000))
    if subs and (plain is None or max(r.expires_ms for r in subs.values()) >= plain.expires_ms):
        return {subkey_text(k): value_of(r) for k, r in subs.items()}
    return value_of(plain) if plain is not None else None
