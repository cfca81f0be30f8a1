"""Peer identity and signed request headers.

A peer is its Ed25519 key. The peer id is a hash of the public key, so anyone holding a request's
public key can check the id it claims, and nobody can pick an id (which matters for the DHT,
whose ids derive from peer ids). Every request carries the key, a timestamp, a nonce and a
signature over (method, timestamp, nonce, recipient, key-exchange share, digest of the body);
the receiver refuses forged, replayed and stale requests, and requests addressed to another
peer: naming the recipient is what stops a request captured at one server from being replayed
to another within the freshness window (the nonce only stops replays to the same server).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from swarmd.protocol.errors import AuthError, IdentityError, MalformedHeader

KEY_FILE = "identity.key"
_PEER_ID_DOMAIN = b"swarmd/peer-id/v1\0"
_REQUEST_DOMAIN = b"swarmd/request/v2\0"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
NONCE_BYTES = 16
#: A run access tag: HMAC-SHA256 (SignedHeader.access).
ACCESS_TAG_BYTES = 32
#: How a refusal for a request addressed to another peer begins: a caller that sees it
#: forgets what it believed about the address (a new peer listens there now).
MISADDRESSED = "request is addressed to peer"


@functools.lru_cache(maxsize=1 << 16)
def _text(raw: bytes) -> str:
    """A peer id's text, made once per id: every record a DHT node checks compares its
    sub-key with its owner's (at 1,000 simulated peers, with parsing ids, about 15% of a
    round's CPU)."""
    return base64.b32encode(raw).decode().rstrip("=").lower()


@dataclass(frozen=True, order=True)
class PeerId:
    """32 bytes derived from a public key; shown as lowercase base32 without padding."""

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != 32:
            raise ValueError(f"a peer id has 32 bytes, got {len(self.raw)}")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerId:
        return cls(hashlib.sha256(_PEER_ID_DOMAIN + public_key).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerId:
        try:
            raw = base64.b32decode(text.upper() + "=" * (-len(text) % 8))
        except ValueError:
            raise ValueError(f"not a peer id: {text!r}") from None
        return cls(raw)

    def __str__(self) -> str:
        return _text(self.raw)

    def short(self) -> str:
        return str(self)[:10]


class Identity:
    """This node's key pair."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw
        )
        self.peer_id = PeerId.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def create(cls, state_dir: Path, *, overwrite: bool = False) -> Identity:
        """Writes a new key with mode 0600, refusing to replace an existing one unless asked."""
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = state_dir / KEY_FILE
        if path.exists() and not overwrite:
            raise IdentityError(f"{path} already exists; refusing to replace a peer's identity")
        identity = cls.generate()
        pem = identity._key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
        # The key must never be readable by others, not even between create and chmod.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return identity

    @classmethod
    def load(cls, state_dir: Path) -> Identity:
        path = state_dir / KEY_FILE
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise IdentityError(
                f"no identity at {path}; create one with `swarmd identity create --state-dir "
                f"{state_dir}`"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(
                f"{path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
                f"run `chmod 600 {path}`"
            )
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise IdentityError(f"{path} is not a valid identity key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, state_dir: Path) -> Identity:
        if (state_dir / KEY_FILE).exists():
            return cls.load(state_dir)
        return cls.create(state_dir)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def sign_request(
        self,
        method: str,
        body: bytes,
        *,
        recipient: PeerId | None = None,
        kx: bytes = b"",
        now: float | None = None,
    ) -> SignedHeader:
        """Signs a request to ``recipient`` (None only for the methods a server answers
        unaddressed: the hello that tells a caller who the server is). ``kx`` is the caller's
        key-exchange share for the call's stream key (session.py), empty for unary calls."""
        ts_ms = int((time.time() if now is None else now) * 1000)
        nonce = secrets.token_bytes(NONCE_BYTES)
        to = recipient.raw if recipient is not None else b""
        sig = self._key.sign(_request_message(method, ts_ms, nonce, body, to, kx))
        return SignedHeader(self.public_key, ts_ms, nonce, sig, to, kx)


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def _request_message(
    method: str, ts_ms: int, nonce: bytes, body: bytes, recipient: bytes, kx: bytes
) -> bytes:
    return b"".join(
        (
            _REQUEST_DOMAIN,
            method.encode(),
            b"\0",
            ts_ms.to_bytes(8, "big", signed=True),
            nonce,
            len(recipient).to_bytes(1, "big"),
            recipient,
            len(kx).to_bytes(1, "big"),
            kx,
            hashlib.sha256(body).digest(),
        )
    )


@dataclass(frozen=True)
class SignedHeader:
    """What travels in gRPC metadata with every request."""

    public_key: bytes
    timestamp_ms: int
    nonce: bytes
    signature: bytes
    #: The recipient's peer id (32 bytes), or empty for an unaddressed hello.
    recipient: bytes = b""
    #: The caller's X25519 share for the call's stream key (32 bytes), or empty.
    kx: bytes = b""
    #: A run's access tag (32 bytes) or empty: an HMAC under the run's secret over
    #: ``signature`` (node/access.py), which proves the caller knows the secret without
    #: sending it, for this request only. Not signed: it is a function of the signature.
    access: bytes = b""

    def __post_init__(self) -> None:
        if len(self.recipient) not in (0, 32) or len(self.kx) not in (0, 32):
            raise AuthError("malformed signed header (recipient or key share length)")
        if len(self.access) not in (0, ACCESS_TAG_BYTES):
            raise AuthError("malformed signed header (access tag length)")

    def to_metadata(self) -> list[tuple[str, str | bytes]]:
        metadata: list[tuple[str, str | bytes]] = [
            ("swarmd-key-bin", self.public_key),
            ("swarmd-ts", str(self.timestamp_ms)),
            ("swarmd-nonce-bin", self.nonce),
            ("swarmd-sig-bin", self.signature),
        ]
        if self.recipient:
            metadata.append(("swarmd-to-bin", self.recipient))
        if self.kx:
            metadata.append(("swarmd-kx-bin", self.kx))
        if self.access:
            metadata.append(("swarmd-access-bin", self.access))
        return metadata

    @classmethod
    def from_metadata(cls, metadata: dict[str, str | bytes]) -> SignedHeader:
        try:
            key, ts, nonce, sig = (
                metadata["swarmd-key-bin"],
                metadata["swarmd-ts"],
                metadata["swarmd-nonce-bin"],
                metadata["swarmd-sig-bin"],
            )
        except KeyError as exc:
            raise AuthError(f"request is not signed: missing {exc.args[0]} header") from None
        if not (isinstance(key, bytes) and isinstance(nonce, bytes) and isinstance(sig, bytes)):
            raise AuthError("malformed signed header")
        # Bounded before parsing: a 400-digit timestamp once reached float() and came back
        # as gRPC INTERNAL (OverflowError); an int64 of milliseconds is all a clock needs.
        try:
            ts_ms = int(ts) if len(ts) <= 20 else None
        except ValueError:
            ts_ms = None
        if ts_ms is None or not -(1 << 63) <= ts_ms < 1 << 63:
            raise MalformedHeader("malformed request timestamp")  # INVALID_ARGUMENT
        if len(nonce) != NONCE_BYTES:
            raise AuthError(f"request nonce must be {NONCE_BYTES} bytes")
        to, kx = metadata.get("swarmd-to-bin", b""), metadata.get("swarmd-kx-bin", b"")
        access = metadata.get("swarmd-access-bin", b"")
        if not (isinstance(to, bytes) and isinstance(kx, bytes) and isinstance(access, bytes)):
            raise AuthError("malformed signed header")
        return cls(key, ts_ms, nonce, sig, to, kx, access)


class ReplayGuard:
    """Refuses requests that are forged, replayed, or from a clock too far off ours.

    A nonce only needs remembering while its timestamp is within the skew window: anything
    older is refused for staleness anyway, so memory is bounded by the request rate times the
    window. Past ``max_entries`` we refuse rather than forget, because forgetting would let a
    flood open a replay hole.

    A request must name ``own`` as its recipient, except for the ``unaddressed`` methods (the
    hello a caller uses to learn who listens at an address); a guard without ``own`` (a bare
    test server) accepts any recipient.
    """

    def __init__(
        self,
        max_skew_s: float = 30.0,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.time,
        *,
        own: PeerId | None = None,
        unaddressed: frozenset[str] = frozenset(),
    ) -> None:
        if max_skew_s <= 0:
            raise ValueError("max_skew_s must be positive")
        self.own = own
        self.unaddressed = unaddressed
        self.max_skew_s = max_skew_s
        self.max_entries = max_entries
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        # gRPC handler threads verify concurrently.
        self._lock = threading.Lock()

    def verify(self, method: str, header: SignedHeader, body: bytes) -> PeerId:
        now = self._clock()
        skew = abs(header.timestamp_ms / 1000.0 - now)
        if skew > self.max_skew_s:
            raise AuthError(
                f"request timestamp is {skew:.1f}s away from our clock (limit {self.max_skew_s}s)"
            )
        self._check_recipient(method, header)
        message = _request_message(
            method, header.timestamp_ms, header.nonce, body, header.recipient, header.kx
        )
        if not verify_signature(header.public_key, header.signature, message):
            raise AuthError("request signature does not verify")
        key = header.public_key + header.nonce
        with self._lock:
            self._expire(now)
            if key in self._seen:
                raise AuthError("replayed request (nonce already seen)")
            if len(self._seen) >= self.max_entries:
                raise AuthError("too many recent requests to track; try again shortly")
            # Entries are appended in arrival order and all live for the same window, so the
            # oldest are always at the front.
            self._seen[key] = now + 2 * self.max_skew_s
        return PeerId.from_public_key(header.public_key)

    def _check_recipient(self, method: str, header: SignedHeader) -> None:
        if self.own is None:
            return
        if not header.recipient:
            if method not in self.unaddressed:
                raise AuthError("request does not name its recipient")
        elif header.recipient != self.own.raw:
            raise AuthError(
                f"{MISADDRESSED} {PeerId(header.recipient).short()}, not this one "
                f"({self.own.short()})"
            )

    def _expire(self, now: float) -> None:
        while self._seen:
            key, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            del self._seen[key]
