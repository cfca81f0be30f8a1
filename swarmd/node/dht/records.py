"""Signed, expiring DHT records and the limits every node enforces before storing one.

A record is valid on its own: the owner's Ed25519 public key travels with it and the
signature covers a domain-separated, length-prefixed encoding of everything else, so any node
can forward a record (replication, answers to finds) and every receiver verifies it again.
Nothing in a record is trusted because of who delivered it.

Expiry is absolute wall-clock time in whole milliseconds (an integer, so the signed bytes are
canonical). Peers' clocks must agree to within the transport's skew bound anyway (rpc.py
refuses requests from clocks that are further off).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    PeerId,
    verify_signature,
)

_RECORD_DOMAIN = b"swarmd/dht-record/v1\0"


class RecordError(ValueError):
    """A record that must not be stored or returned; the message says why."""


@dataclass(frozen=True)
class RecordLimits:
    """Size limits on one record; a node refuses records beyond them before verifying."""

    max_key_bytes: int = 512
    max_subkey_bytes: int = 256
    max_value_bytes: int = 64 << 10
    #: Expiries further ahead than this are refused: nobody gets to store forever.
    max_ttl_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_subkey_bytes", "max_value_bytes", "max_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RecordLimits.{name} must be positive")


@dataclass(frozen=True)
class Record:
    """One key (or key + sub-key) → value binding, signed by its owner."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expires_ms: int
    owner_key: bytes
    signature: bytes

    @property
    def expires(self) -> float:
        return self.expires_ms / 1000.0

    @functools.cached_property
    def owner(self) -> PeerId:
        """Derived once per record: a matchmaking read merges every announcement under its
        key again (at 1,000 simulated peers, 18% of a round's CPU derived owners)."""
        return PeerId.from_public_key(self.owner_key)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """See `fingerprint`: hashed once per record (a node answering a reader's Find checks
        every record under the key against the reader's list, on every poll)."""
        return hashlib.sha256(self.signature).digest()[:FINGERPRINT_BYTES]

    @property
    def size(self) -> int:
        """Bytes this record costs a node that stores it (what quotas count)."""
        return (
            len(self.key)
            + len(self.subkey or b"")
            + len(self.value)
            + len(self.owner_key)
            + len(self.signature)
            + 8
        )

    def signed_message(self) -> bytes:
        return signed_message(self.key, self.subkey, self.value, self.expires_ms, self.owner_key)

    def to_pb(self) -> pb.Record:
        return pb.Record(
            key=self.key,
            has_subkey=self.subkey is not None,
            subkey=self.subkey or b"",
            value=self.value,
            expires_ms=self.expires_ms,
            owner_key=self.owner_key,
            signature=self.signature,
        )

    @classmethod
    def from_pb(cls, msg: pb.Record) -> Record:
        return cls(
            key=msg.key,
            subkey=msg.subkey if msg.has_subkey else None,
            value=msg.value,
            expires_ms=msg.expires_ms,
            owner_key=msg.owner_key,
            signature=msg.signature,
        )

    def supersedes(self, other: Record) -> bool:
        """Newer expiry wins; equal expiries are broken by signature so replicas converge."""
        if self.expires_ms != other.expires_ms:
            return self.expires_ms > other.expires_ms
        return self.signature > other.signature


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def signed_message(
    key: bytes, subkey: bytes | None, value: bytes, expires_ms: int, owner_key: bytes
) -> bytes:
    return b"".join(
        (
            _RECORD_DOMAIN,
            _field(key),
            b"\1" + _field(subkey) if subkey is not None else b"\0",
            _field(value),
            struct.pack(">q", expires_ms),
            _field(owner_key),
        )
    )


def expiry_ms(expires: float) -> int:
    if not math.isfinite(expires):
        raise ValueError(f"expiry must be a finite time, got {expires}")
    return int(expires * 1000)


def sign_record(
    identity: Identity, key: bytes, value: bytes, expires: float, subkey: bytes | None = None
) -> Record:
    ms = expiry_ms(expires)
    message = signed_message(key, subkey, value, ms, identity.public_key)
    return Record(key, subkey, value, ms, identity.public_key, identity.sign(message))


def check_shape(record: Record, limits: RecordLimits, now: float) -> None:
    """Cheap checks that need no cryptography: sizes, expiry window, sub-key binding."""
    if len(record.key) == 0:
        raise RecordError("empty key")
    if len(record.key) > limits.max_key_bytes:
        raise RecordError(f"key of {len(record.key)} B exceeds {limits.max_key_bytes} B")
    if record.subkey is not None and len(record.subkey) > limits.max_subkey_bytes:
        raise RecordError(f"sub-key of {len(record.subkey)} B exceeds {limits.max_subkey_bytes} B")
    if len(record.value) > limits.max_value_bytes:
        raise RecordError(f"value of {len(record.value)} B exceeds {limits.max_value_bytes} B")
    if len(record.owner_key) != PUBLIC_KEY_BYTES or len(record.signature) != SIGNATURE_BYTES:
        raise RecordError("record is not signed (missing owner key or signature)")
    if record.expires <= now:
        raise RecordError("record has expired")
    if record.expires > now + limits.max_ttl_s:
        raise RecordError(f"expiry is more than {limits.max_ttl_s:.0f}s ahead")
    # A sub-key that names a peer can only be written by that peer: otherwise anyone could
    # squat on (or shadow) another peer's announcement.
    subkey = record.subkey
    if subkey is not None and is_peer_subkey(subkey) and subkey.decode() != str(record.owner):
        raise RecordError("sub-key names a peer other than the record's owner")


FINGERPRINT_BYTES = 8


def fingerprint(record: Record) -> bytes:
    """A short name for one exact version of a record (its signature is unique to it): what a
    reader lists in a Find so that nodes leave out records it already holds. Only the owner
    can make a record, so only the owner could make two whose fingerprints collide."""
    return record.fingerprint


@functools.lru_cache(maxsize=1 << 16)
def is_peer_subkey(subkey: bytes) -> bool:
    """Whether a sub-key is a peer id's text: parsed once per sub-key (every node checks it
    on every record it is sent; with `PeerId.__str__`, about 15% of a simulated 1,000-peer
    round's CPU)."""
    if len(subkey) != 52:
        return False
    try:
        PeerId.from_string(subkey.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return False
    return True


class Verifier:
    """Verifies record signatures, remembering recent successes.

    The same record arrives many times (k replicas answer a get; republishes repeat it) and an
    Ed25519 verification costs about as much as a whole loopback RPC, so a record already seen
    valid is accepted by looking up its digest. Thread-safe: stores may be verified off-loop.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, record: Record) -> None:
        message = record.signed_message()
        digest = hashlib.sha256(message + record.signature).digest()
        with self._lock:
            if digest in self._seen:
                self._seen.move_to_end(digest)
                return
        if not verify_signature(record.owner_key, record.signature, message):
            raise RecordError("signature does not verify")
        with self._lock:
            self._seen[digest] = None
            while len(self._seen) > self._capacity:
                self._seen.popitem(last=False)

    def check(self, record: Record, limits: RecordLimits, now: float) -> None:
        check_shape(record, limits, now)
        self.verify(record)
