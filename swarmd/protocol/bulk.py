"""The bulk data plane: tensor streams over plain TCP, beside gRPC.

Why it exists: gRPC's core and its Python binding copy every byte of a tensor stream several
times on each end (frames joined into messages, HTTP/2 framing, message objects, reassembly).
Measured on the 2-core machine: 1.4-2.3 CPU-s per GB sent and received, against about 0.8 for a
raw socket. A 4-peer fp32 all-reduce of 100M values moves 2.4 GB per round, so gRPC alone spent
more CPU than the whole 2 s round budget. Here a payload goes from the sender's memory (a
tensor, or codec output) to the kernel in one copy and from the kernel into a pooled receive
buffer (framing.RECEIVE_BUFFERS) in one copy, all in the trio thread: no frames, no threads.

What is the same as on gRPC, so that a handler cannot tell the two apart: the request carries
the same signed header (identity.py) over the same bytes (the method path and the first
frame: the header frame for a put, the request message for a get), verified by the server's
replay guard, addressed to the server and carrying the caller's key share; every frame after
it is authenticated with the call's stream key (session.py); the declared size is checked
against the limit before anything is allocated; the caller's deadline travels with the
request and bounds the handler; fault injection (faults.py: partitions, loss, latency, pacing)
and the byte counters apply. gRPC still carries every control message and tells a client who a
peer is and where its bulk listener is (the hello, BulkInfo); a client that cannot reach it
uses gRPC instead.

Wire format, one call per connection (integers little-endian)::

    request   "SWB2" kind:u8 path_len:u16 body_len:u32 timeout_ms:u32 ts_ms:i64
              key[32] to[32] kx[32] nonce[16] signature[64] path body
              then, for a put, the payload: exactly the header frame's nbytes, sealed
    response  status:u8 len:u32 data
              then, for a get whose status is OK, tag[16] over data, and the payload, sealed

``to`` is the recipient's peer id and ``kx`` the caller's X25519 share. A sealed payload is
cut into session.MAC_CHUNK_BYTES frames (the last one shorter), each followed by its 16-byte
tag. ``status`` is the gRPC status code number (0 is OK). ``data`` is the handler's response
message (put) or the payload's header frame (get) on OK, the error's details otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import trio
from google.protobuf.message import DecodeError, Message

from swarmd.protocol._bulk_io import recv_exactly, recv_sealed, send_all, tune
from swarmd.protocol._bulk_slots import Slot, Slots
from swarmd.protocol._receive_budget import Reservation
from swarmd.protocol.calls import CallContext, RpcError, RpcObserver, StatusCode, to_rpc_error
from swarmd.protocol.errors import FramingError, ListenError, ProtocolError
from swarmd.protocol.faults import FaultInjector
from swarmd.protocol.framing import (
    RECEIVE_BUFFERS,
    Payload,
    TensorMeta,
    header_frame,
    parse_header_frame,
    payload_segments,
)
from swarmd.protocol.identity import (
    ACCESS_TAG_BYTES,
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    SignedHeader,
)
from swarmd.protocol.session import (
    CALLER,
    KX_BYTES,
    SERVER,
    TAG_BYTES,
    StreamMac,
    seal_payload,
    sealed_nbytes,
)

log = logging.getLogger("swarmd.bulk")

MAGIC = b"SWB2"
KIND_PUT = 1
KIND_GET = 2
_PREFIX = struct.Struct("<4sBHIIq")
_PEER_ID_BYTES = 32
#: The auth block ends with the access tag (SignedHeader.access), all zeros when there is none.
_AUTH_BYTES = (
    PUBLIC_KEY_BYTES + _PEER_ID_BYTES + KX_BYTES + NONCE_BYTES + SIGNATURE_BYTES + ACCESS_TAG_BYTES
)
_NO_TAG = bytes(ACCESS_TAG_BYTES)
_RESPONSE = struct.Struct("<BI")
MAX_PATH_BYTES = 256
#: Header frames and request messages are small; anything larger is refused unread.
MAX_BODY_BYTES = 64 << 10
#: A connection must deliver its request header within this, whatever its deadline.
HEADER_TIMEOUT_S = 10.0
#: A put whose sender sends nothing for this long is dropped (it holds a buffer and a slot).
STALL_S = 30.0
#: Longest a call may run, whatever deadline its client declares (it holds a server slot).
MAX_DEADLINE_S = 3600.0
#: How long a client tries to reach a bulk listener before it uses gRPC for the call.
CONNECT_TIMEOUT_S = 3.0
#: After refusing a put, read (and drop) its payload for at most this long, so the client sees
#: the refusal instead of a reset connection.
DRAIN_S = 1.0
_STATUS_BY_NUMBER = list(StatusCode)  # declared in gRPC's numeric order: OK is 0
#: What a connection raises when its other end is gone (died, gave up, reset).
_GOING_AWAY = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)

TensorInHandler = Callable[[TensorMeta, bytearray, CallContext], Awaitable[Message]]
TensorOutHandler = Callable[[Any, CallContext], Awaitable[tuple[TensorMeta, Payload]]]
#: (path, signed header, signed body, transport peer) -> the call's context and the key of its
#: frames, or raises.
Authenticate = Callable[[str, SignedHeader, bytes, str], tuple[CallContext, StreamMac]]
#: (path, declared tensor, call) -> room for it, or raises: runs before anything is allocated.
Admit = Callable[[str, TensorMeta, CallContext], Awaitable[Reservation]]


def encode_request(
    kind: int, path: str, signed: SignedHeader, body: bytes, timeout_s: float
) -> bytes:
    raw_path = path.encode()
    if len(raw_path) > MAX_PATH_BYTES or len(body) > MAX_BODY_BYTES:
        raise ValueError("bulk request path or body too long")
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    prefix = _PREFIX.pack(MAGIC, kind, len(raw_path), len(body), timeout_ms, signed.timestamp_ms)
    if len(signed.recipient) != _PEER_ID_BYTES or len(signed.kx) != KX_BYTES:
        raise ValueError("a bulk request names its recipient and carries a key share")
    tag = signed.access or _NO_TAG
    auth = (signed.public_key, signed.recipient, signed.kx, signed.nonce, signed.signature, tag)
    return b"".join((prefix, *auth, raw_path, body))


@dataclass(frozen=True)
class _Request:
    kind: int
    path: str
    signed: SignedHeader
    body: bytes
    timeout_s: float
    nbytes: int  # what the request header took on the wire


async def _read_request(sock: trio.socket.SocketType) -> _Request:
    magic, kind, path_len, body_len, timeout_ms, ts_ms = _PREFIX.unpack(
        await recv_exactly(sock, _PREFIX.size)
    )
    if magic != MAGIC:
        raise ProtocolError("not a swarmd bulk request (bad magic)")
    if kind not in (KIND_PUT, KIND_GET):
        raise ProtocolError(f"unknown bulk request kind {kind}")
    if path_len > MAX_PATH_BYTES or body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"bulk request header too large (path {path_len} B, body {body_len} B)")
    rest = await recv_exactly(sock, _AUTH_BYTES + path_len + body_len)
    fields, pos = [], 0
    sizes = (PUBLIC_KEY_BYTES, _PEER_ID_BYTES, KX_BYTES, NONCE_BYTES, SIGNATURE_BYTES)
    for size in (*sizes, ACCESS_TAG_BYTES):
        fields.append(rest[pos : pos + size])
        pos += size
    key, to, kx, nonce, sig, tag = fields
    try:
        path = rest[_AUTH_BYTES : _AUTH_BYTES + path_len].decode()
    except UnicodeDecodeError:
        raise ProtocolError("bulk request path is not UTF-8") from None
    body = rest[_AUTH_BYTES + path_len :]
    return _Request(
        kind,
        path,
        SignedHeader(key, ts_ms, nonce, sig, to, kx, b"" if tag == _NO_TAG else tag),
        body,
        timeout_ms / 1000.0,
        _PREFIX.size + len(rest),
    )


#: What a listener with no slot for a connection answers before reading anything from it.
BUSY = b"bulk server busy"


class BulkBusy(RpcError):
    """The listener had no slot and read nothing of the call: it is safe to make over gRPC."""


def _raise_for(status: StatusCode, data: bytes) -> None:
    if status is StatusCode.RESOURCE_EXHAUSTED and data == BUSY:
        raise BulkBusy(status, BUSY.decode())
    if status is not StatusCode.OK:
        raise RpcError(status, data.decode(errors="replace"))


async def _read_response(sock: trio.socket.SocketType) -> tuple[StatusCode, bytes, int]:
    number, length = _RESPONSE.unpack(await recv_exactly(sock, _RESPONSE.size))
    if number >= len(_STATUS_BY_NUMBER) or length > MAX_BODY_BYTES:
        raise RpcError(StatusCode.INTERNAL, "malformed bulk response")
    data = await recv_exactly(sock, length)
    return _STATUS_BY_NUMBER[number], data, _RESPONSE.size + length


def _response(status: StatusCode, data: bytes) -> bytes:
    return _RESPONSE.pack(_STATUS_BY_NUMBER.index(status), len(data)) + data


class BulkServer:
    """Serves the tensor methods of an RpcServer on its own TCP listener."""

    def __init__(
        self,
        *,
        tensor_in: Mapping[str, TensorInHandler],
        tensor_out: Mapping[str, tuple[type[Message], TensorOutHandler]],
        authenticate: Authenticate,
        admit: Admit,
        observer: RpcObserver,
        faults: FaultInjector | None,
        max_tensor_bytes: int,
        max_concurrent: int,
        max_per_address: int,
        default_deadline_s: float,
    ) -> None:
        self._in = dict(tensor_in)
        self._out = dict(tensor_out)
        self._authenticate = authenticate
        self._admit = admit
        self._observer = observer
        self._faults = faults
        self._max_tensor_bytes = max_tensor_bytes
        self.slots = Slots(max_concurrent, max_per_address)
        self._default_deadline_s = default_deadline_s
        self.port = 0

    async def start(self, nursery: trio.Nursery, host: str, port: int = 0) -> None:
        """Listens where the gRPC server does: on ``host``, or for "" and "::" on every IPv4
        and IPv6 address through one dual-stack socket (so one port is advertised and both
        families reach it, as they reach gRPC); serves in ``nursery``."""
        try:
            listener = await self._listen(host, port)
        except OSError as exc:
            raise ListenError(
                f"cannot listen on {host or '*'}:{port} for tensors (the bulk plane): "
                f"{exc.strerror or exc}; choose another --bulk-port, or --no-bulk"
            ) from None
        self.port = listener.socket.getsockname()[1]
        tune(listener.socket)
        nursery.start_soon(trio.serve_listeners, self._connection, [listener])

    @staticmethod
    async def _listen(host: str, port: int) -> trio.SocketListener:
        if host in ("", "::") and socket.has_ipv6:
            sock = trio.socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                await sock.bind(("::", port))
                sock.listen(128)
            except OSError:
                sock.close()
                raise
            listener = trio.SocketListener(sock)
        else:
            # A name may resolve to several addresses, each listener with its own port: the
            # first one is the one advertised, so it is the only one kept.
            first, *others = await trio.open_tcp_listeners(port, host=host or "0.0.0.0")
            for other in others:
                await other.aclose()
            listener = first
        return listener

    async def _connection(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        try:
            addr = sock.getpeername()
            host = str(addr[0])
            peer = f"ipv{6 if sock.family == socket.AF_INET6 else 4}:{host}:{addr[1]}"
        except OSError:
            host = peer = "unknown"
        slot = self.slots.admit(host)
        if slot is None:
            with trio.move_on_after(1.0), contextlib.suppress(*_GOING_AWAY):
                await send_all(sock, [_response(StatusCode.RESOURCE_EXHAUSTED, BUSY)], None)
            await stream.aclose()
            return
        try:
            with slot.scope:
                await self._serve(sock, peer, slot)
        finally:
            self.slots.release(slot)
            with contextlib.suppress(*_GOING_AWAY):
                await stream.aclose()

    async def _serve(self, sock: trio.socket.SocketType, peer: str, slot: Slot) -> None:
        start = time.perf_counter()
        path, sent, received = "(bulk)", 0, 0
        req_path = "(unread)"  # what the caller asked for, for the log only
        payload_left = 0
        #: Set once the first byte of an OK answer may have gone out: after that, an error
        #: can only close the connection (an error response would land inside the payload).
        answering = False
        try:
            with trio.fail_after(HEADER_TIMEOUT_S):
                req = await _read_request(sock)
            slot.idle = False  # a request: no longer a connection to close for room
            received = req.nbytes
            req_path = repr(req.path[:MAX_PATH_BYTES])
            if req.path in self._in or req.path in self._out:
                path = req.path  # a metrics label: never a string a stranger chose
            timeout = min(req.timeout_s or self._default_deadline_s, MAX_DEADLINE_S)
            with trio.fail_after(timeout):
                if req.kind == KIND_PUT:
                    # The declared size first (no allocation): a refused put's payload is
                    # then read away, so its sender reads the refusal, not a reset.
                    meta = parse_header_frame(req.body, self._max_tensor_bytes)
                    payload_left = sealed_nbytes(meta.nbytes)
                ctx, mac = self._authenticate(req.path, req.signed, req.body, peer)
                if req.kind == KIND_PUT:
                    handler = self._in.get(req.path)
                    if handler is None:
                        raise RpcError(StatusCode.UNIMPLEMENTED, f"no tensor method {req.path}")
                    held = await self._admit(req.path, meta, ctx)  # before any allocation
                    try:
                        buf = RECEIVE_BUFFERS.take(meta.nbytes)
                        await recv_sealed(sock, memoryview(buf), mac, CALLER, STALL_S)
                        payload_left = 0
                        received += sealed_nbytes(meta.nbytes)
                        response = await handler(meta, buf, ctx)
                    finally:
                        held.release()
                    answer: Iterable[bytes | memoryview] = [
                        _response(StatusCode.OK, response.SerializeToString())
                    ]
                else:
                    answer = await self._get_answer(req, ctx, mac)
                answering = True
                faults = self._faults if req.kind == KIND_GET else None
                sent += await send_all(sock, answer, faults)
        except Exception as exc:
            if isinstance(exc, trio.TooSlowError):
                err = RpcError(StatusCode.DEADLINE_EXCEEDED, "deadline passed")
            elif isinstance(exc, _GOING_AWAY):
                # The client went away mid-call (it died, or gave up): not a handler failure.
                log.info("bulk call %s from %s ended: %s", path, peer, exc)
                err = RpcError(StatusCode.UNAVAILABLE, f"connection lost: {exc}")
            else:
                err = to_rpc_error(exc)
            if err.code is StatusCode.INTERNAL:
                log.exception("bulk handler for %s failed", path)
            elif err.code is StatusCode.UNAUTHENTICATED:  # forged, replayed or altered
                log.warning("refused bulk call %s from %s: %s", req_path, peer, err.details)
            self._observer.on_served(path, err.code.name, time.perf_counter() - start)
            self._observer.on_bytes(path, sent, received)
            if not answering:  # nothing of an answer went out yet: say why
                await self._refuse(sock, err, payload_left)
            return
        self._observer.on_served(path, StatusCode.OK.name, time.perf_counter() - start)
        self._observer.on_bytes(path, sent, received)

    async def _get_answer(
        self, req: _Request, ctx: CallContext, mac: StreamMac
    ) -> Iterable[bytes | memoryview]:
        """Runs a get's handler; what goes back: status, header frame, its tag, sealed payload."""
        entry = self._out.get(req.path)
        if entry is None:
            raise RpcError(StatusCode.UNIMPLEMENTED, f"no tensor method {req.path}")
        request_type, out_handler = entry
        message = request_type()
        try:
            message.ParseFromString(req.body)
        except DecodeError as exc:
            raise RpcError(
                StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}"
            ) from None
        meta, payload = await out_handler(message, ctx)
        segments = payload_segments(payload)
        if sum(v.nbytes for v in segments) != meta.nbytes:
            raise FramingError("handler's payload does not match its header")
        head = header_frame(meta)
        return itertools.chain(
            [_response(StatusCode.OK, head), mac.tag(SERVER, 0, head)],
            seal_payload(mac, SERVER, segments),
        )

    async def _refuse(self, sock: trio.socket.SocketType, err: RpcError, payload_left: int) -> None:
        with trio.move_on_after(DRAIN_S), contextlib.suppress(*_GOING_AWAY):
            await send_all(sock, [_response(err.code, err.details.encode()[:4096])], None)
            sock.shutdown(socket.SHUT_WR)
            # A put's payload may still be on its way: read it away, so that the client reads
            # the refusal rather than a connection reset.
            scratch = bytearray(1 << 16)
            while payload_left > 0:
                n = await sock.recv_into(scratch)
                if n == 0:
                    break
                payload_left -= n


async def connect(host: str, port: int) -> trio.SocketStream | None:
    """A connection to a bulk listener, or None if it cannot be reached quickly."""
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            log.debug("bulk listener %s:%d unreachable: %s", host, port, exc)
            return None
        tune(stream.socket)
        return stream
    return None


async def put(
    stream: trio.SocketStream,
    request: bytes,
    payload: list[memoryview],
    faults: FaultInjector | None,
    mac: StreamMac,
) -> tuple[bytes, int, int]:
    """Sends a put's request and payload; (response message, bytes sent, bytes received).

    The response is read while the payload is still going out, so a refusal (bad signature,
    unknown round, too large) ends the call at once instead of after the whole payload."""
    sock = stream.socket
    outcome: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            try:
                outcome["response"] = await _read_response(sock)
            except (OSError, RpcError) as exc:
                outcome["read_error"] = exc
            status = outcome.get("response", (StatusCode.OK,))[0]
            if status is not StatusCode.OK:
                nursery.cancel_scope.cancel()

        async def send() -> None:
            try:
                pieces = [request, *seal_payload(mac, CALLER, payload)]
                outcome["sent"] = await send_all(sock, pieces, faults)
            except OSError as exc:
                outcome["send_error"] = exc

        nursery.start_soon(read)
        nursery.start_soon(send)
    if "response" in outcome:
        status, data, received = outcome["response"]
        _raise_for(status, data)
        return data, outcome.get("sent", len(request)), received
    why = outcome.get("send_error") or outcome.get("read_error")
    raise RpcError(StatusCode.UNAVAILABLE, f"bulk connection failed: {why}")


async def get(
    stream: trio.SocketStream, request: bytes, max_bytes: int, mac: StreamMac
) -> tuple[TensorMeta, bytearray, int]:
    """Sends a get's request and reads the tensor; (meta, payload, bytes received)."""
    sock = stream.socket
    try:
        await send_all(sock, [request], None)
        status, data, received = await _read_response(sock)
        _raise_for(status, data)
        mac.check(SERVER, 0, data, await recv_exactly(sock, TAG_BYTES))
        meta = parse_header_frame(data, max_bytes)
        buf = RECEIVE_BUFFERS.take(meta.nbytes)
        await recv_sealed(sock, memoryview(buf), mac, SERVER)
    except OSError as exc:
        raise RpcError(StatusCode.UNAVAILABLE, f"bulk connection failed: {exc}") from None
    return meta, buf, received + TAG_BYTES + sealed_nbytes(meta.nbytes)
