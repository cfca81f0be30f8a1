"""Stream keys: every frame of a tensor call is authenticated, not only the signed first one.

A request's signature (identity.py) covers its header frame (a put) or its request message (a
get), but not the megabytes that follow, nor anything the server sends back: without more, a
hop on the path could splice, alter or truncate a payload and the receiver would average it.

Key agreement, with no extra round trip per call: each server has a static X25519 key derived
from its Ed25519 identity (HKDF over the identity's deterministic signature of a fixed label:
the same identity gives the same key after a restart, and there is no second secret to store)
and tells callers its public half in the hello (GetBulkInfo), signed by that identity. A caller
puts its own X25519 share in the signed request; both ends compute X25519 and then HKDF over
the request's nonce and both parties' keys, so every call has its own stream key and only the
caller who signed the request and the holder of the server's identity can compute it.

Each frame then carries a 16-byte AES-GCM tag over it (GMAC: authentication, not encryption;
payloads are training updates, not secrets). Measured on the 2-core machine: GMAC 6.7 GB/s on
AES-NI, against 1.4 for HMAC-SHA256 and 1.9 for ChaCha20-Poly1305 (Poly1305 alone is faster
but needs a fresh key per message). The tag's nonce is the direction and the frame's index, so
a frame cannot be dropped, reordered, moved to the other direction or taken from another call
without its tag failing. Payload frames are MAC_CHUNK_BYTES long, whatever the sender's
buffers: the receiver knows where each tag lies from the declared size alone.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from swarmd.protocol.errors import AuthError
from swarmd.protocol.identity import Identity, PeerId, SignedHeader, verify_signature

#: Payload bytes per authenticated frame on the bulk plane.
MAC_CHUNK_BYTES = 1 << 20
TAG_BYTES = 16
KX_BYTES = 32
#: Directions, part of every tag's nonce.
CALLER = 0
SERVER = 1
_NONCE = struct.Struct("<B3xQ")
_KX_SEED = b"swarmd/kx-seed/v1\0"
_KX_PUBLIC = b"swarmd/kx-public/v1\0"
_STREAM = b"swarmd/stream/v1\0"


class StreamMac:
    """Tags and checks the frames of one call."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def tag(self, direction: int, seq: int, data: bytes | memoryview) -> bytes:
        return self._aead.encrypt(_NONCE.pack(direction, seq), b"", data)

    def check(self, direction: int, seq: int, data: bytes | memoryview, tag: bytes) -> None:
        try:
            self._aead.decrypt(_NONCE.pack(direction, seq), tag, data)
        except InvalidTag:
            raise AuthError(
                f"frame {seq} of the stream failed authentication (altered, spliced or cut)"
            ) from None


def _stream_key(shared: bytes, header: SignedHeader, server: PeerId) -> StreamMac:
    info = b"".join((_STREAM, header.public_key, server.raw, header.kx))
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=header.nonce, info=info).derive(shared)
    return StreamMac(key)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _exchange(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # wrong length, or a low-order point giving an all-zero secret
        raise AuthError("malformed key-exchange share") from None


class ServerKey:
    """A server's static X25519 key and the signature that ties it to the server's identity."""

    def __init__(self, identity: Identity) -> None:
        seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KX_SEED).derive(
            identity.sign(_KX_SEED)
        )
        self._key = X25519PrivateKey.from_private_bytes(seed)
        self.peer_id = identity.peer_id
        self.public_key = identity.public_key
        self.kx_public = _raw(self._key.public_key())
        self.kx_signature = identity.sign(_KX_PUBLIC + self.kx_public)

    def stream_mac(self, header: SignedHeader) -> StreamMac:
        """The key of the call ``header`` opens (its signature already verified)."""
        if len(header.kx) != KX_BYTES:
            raise AuthError("a tensor call must carry a key-exchange share")
        return _stream_key(_exchange(self._key, header.kx), header, self.peer_id)


def verify_server_key(public_key: bytes, kx_public: bytes, kx_signature: bytes) -> PeerId:
    """The peer id of a hello's sender, once its key share is shown to be its own."""
    if len(kx_public) != KX_BYTES or not verify_signature(
        public_key, kx_signature, _KX_PUBLIC + kx_public
    ):
        raise AuthError("the peer's key-exchange share is not signed by its identity")
    return PeerId.from_public_key(public_key)


class CallerKey:
    """A client's X25519 share, the same for all its calls (each call's key still differs,
    through the request's nonce)."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.kx_public = _raw(self._key.public_key())

    def stream_mac(self, header: SignedHeader, server: PeerId, server_kx: bytes) -> StreamMac:
        return _stream_key(_exchange(self._key, server_kx), header, server)


def sealed_nbytes(nbytes: int) -> int:
    """Wire size of an authenticated payload of ``nbytes``."""
    return nbytes + TAG_BYTES * -(-nbytes // MAC_CHUNK_BYTES)


def seal_payload(
    mac: StreamMac, direction: int, segments: Sequence[memoryview], first_seq: int = 1
) -> Iterator[memoryview | bytes]:
    """The payload in MAC_CHUNK_BYTES frames, each followed by its tag. No copy, except of a
    frame that spans two of the sender's buffers (its tag needs it in one piece)."""
    seq = first_seq
    pending: list[memoryview] = []
    filled = 0
    for segment in segments:
        pos = 0
        while pos < segment.nbytes:
            piece = segment[pos : pos + MAC_CHUNK_BYTES - filled]
            pos += piece.nbytes
            pending.append(piece)
            filled += piece.nbytes
            if filled == MAC_CHUNK_BYTES:
                yield from _frame(mac, direction, seq, pending)
                seq, pending, filled = seq + 1, [], 0
    if pending:
        yield from _frame(mac, direction, seq, pending)


def _frame(
    mac: StreamMac, direction: int, seq: int, pieces: list[memoryview]
) -> Iterator[memoryview | bytes]:
    whole = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    yield from pieces
    yield mac.tag(direction, seq, whole)


def seal_frames(
    mac: StreamMac, direction: int, frames: Iterable[bytes], first_seq: int
) -> Iterator[bytes]:
    """gRPC frames with their tags appended (the gRPC plane, where frames are messages)."""
    for seq, frame in enumerate(frames, first_seq):
        yield bytes(frame) + mac.tag(direction, seq, frame)


def open_frames(
    mac: StreamMac, direction: int, frames: Iterable[bytes], first_seq: int
) -> Iterator[memoryview]:
    """The frames of seal_frames, each checked; raises AuthError at the first bad one."""
    for seq, frame in enumerate(frames, first_seq):
        if len(frame) < TAG_BYTES:
            raise AuthError(f"frame {seq} of the stream is too short to carry its tag")
        view = memoryview(frame)
        body = view[: len(frame) - TAG_BYTES]
        mac.check(direction, seq, body, bytes(view[len(frame) - TAG_BYTES :]))
        yield body
