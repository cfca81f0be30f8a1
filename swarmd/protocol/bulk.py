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
replay guard; the declared size is checked against the limit before anything is allocated;
the caller's deadline travels with the request and bounds the handler; fault injection
(faults.py: partitions, loss, latency, pacing) and the byte counters apply. gRPC still carries
every control message and tells a client where a peer's bulk listener is (rpc.py, BulkInfo);
a client that cannot reach it uses gRPC instead.

Wire format, one call per connection (integers little-endian)::

    request   "SWB1" kind:u8 path_len:u16 body_len:u32 timeout_ms:u32 ts_ms:i64
              key[32] nonce[16] signature[64] path body
              then, for a put, the payload: exactly the header frame's nbytes
    response  status:u8 len:u32 data
              then, for a get whose status is OK, the payload

``status`` is the gRPC status code number (0 is OK). ``data`` is the handler's response
message (put) or the payload's header frame (get) on OK, the error's details otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from google.protobuf.message import DecodeError, Message

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
from swarmd.protocol.identity import NONCE_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, SignedHeader

log = logging.getLogger("swarmd.bulk")

MAGIC = b"SWB1"
KIND_PUT = 1
KIND_GET = 2
_PREFIX = struct.Struct("<4sBHIIq")
_AUTH_BYTES = PUBLIC_KEY_BYTES + NONCE_BYTES + SIGNATURE_BYTES
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
#: Kernel socket buffers: a few MB keep loopback and LAN transfers at line rate with fewer
#: wake-ups of the trio thread.
SOCKET_BUFFER_BYTES = 4 << 20
#: Largest single send while the uplink is paced (fault injection), so pacing stays smooth.
PACED_SEND_BYTES = 64 << 10
#: After refusing a put, read (and drop) its payload for at most this long, so the client sees
#: the refusal instead of a reset connection.
DRAIN_S = 1.0
_STATUS_BY_NUMBER = list(StatusCode)  # declared in gRPC's numeric order: OK is 0
#: What a connection raises when its other end is gone (died, gave up, reset).
_GOING_AWAY = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)

TensorInHandler = Callable[[TensorMeta, bytearray, CallContext], Awaitable[Message]]
TensorOutHandler = Callable[[Any, CallContext], Awaitable[tuple[TensorMeta, Payload]]]
#: (path, signed header, signed body, transport peer) -> the call's context, or raises.
Authenticate = Callable[[str, SignedHeader, bytes, str], CallContext]


def _tune(sock: trio.socket.SocketType) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # a kernel that caps buffers keeps its own size
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


async def _recv_into(
    sock: trio.socket.SocketType, view: memoryview, stall_s: float = math.inf
) -> None:
    """Fills ``view`` from the socket; a peer that closes early, or sends nothing for
    ``stall_s`` (a trickle holding a buffer and a server slot), is UNAVAILABLE."""
    pos, total = 0, len(view)
    while pos < total:
        n = -1
        with trio.move_on_after(stall_s):
            n = await sock.recv_into(view[pos:])
        if n < 0:
            raise RpcError(
                StatusCode.UNAVAILABLE, f"no data for {stall_s:g} s after {pos} of {total} bytes"
            )
        if n == 0:
            raise RpcError(
                StatusCode.UNAVAILABLE, f"connection closed after {pos} of {total} bytes"
            )
        pos += n


async def _recv_exactly(sock: trio.socket.SocketType, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_into(sock, memoryview(buf))
    return bytes(buf)


async def _send_all(
    sock: trio.socket.SocketType,
    pieces: Sequence[bytes | memoryview],
    faults: FaultInjector | None,
) -> int:
    """Sends every piece, paced by the fault plan's bandwidth if it has one; bytes sent."""
    sent = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        pos = 0
        while pos < len(view):
            if faults is not None and faults.plan().bandwidth_bytes_s is not None:
                end = min(len(view), pos + PACED_SEND_BYTES)
                await faults.pace_async(end - pos)
                while pos < end:
                    pos += await sock.send(view[pos:end])
            else:
                pos += await sock.send(view[pos:])
        sent += len(view)
    return sent


def encode_request(
    kind: int, path: str, signed: SignedHeader, body: bytes, timeout_s: float
) -> bytes:
    raw_path = path.encode()
    if len(raw_path) > MAX_PATH_BYTES or len(body) > MAX_BODY_BYTES:
        raise ValueError("bulk request path or body too long")
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    prefix = _PREFIX.pack(MAGIC, kind, len(raw_path), len(body), timeout_ms, signed.timestamp_ms)
    return b"".join((prefix, signed.public_key, signed.nonce, signed.signature, raw_path, body))


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
        await _recv_exactly(sock, _PREFIX.size)
    )
    if magic != MAGIC:
        raise ProtocolError("not a swarmd bulk request (bad magic)")
    if kind not in (KIND_PUT, KIND_GET):
        raise ProtocolError(f"unknown bulk request kind {kind}")
    if path_len > MAX_PATH_BYTES or body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"bulk request header too large (path {path_len} B, body {body_len} B)")
    rest = await _recv_exactly(sock, _AUTH_BYTES + path_len + body_len)
    key = rest[:PUBLIC_KEY_BYTES]
    nonce = rest[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + NONCE_BYTES]
    sig = rest[PUBLIC_KEY_BYTES + NONCE_BYTES : _AUTH_BYTES]
    try:
        path = rest[_AUTH_BYTES : _AUTH_BYTES + path_len].decode()
    except UnicodeDecodeError:
        raise ProtocolError("bulk request path is not UTF-8") from None
    body = rest[_AUTH_BYTES + path_len :]
    return _Request(
        kind,
        path,
        SignedHeader(key, ts_ms, nonce, sig),
        body,
        timeout_ms / 1000.0,
        _PREFIX.size + len(rest),
    )


async def _read_response(sock: trio.socket.SocketType) -> tuple[StatusCode, bytes, int]:
    number, length = _RESPONSE.unpack(await _recv_exactly(sock, _RESPONSE.size))
    if number >= len(_STATUS_BY_NUMBER) or length > MAX_BODY_BYTES:
        raise RpcError(StatusCode.INTERNAL, "malformed bulk response")
    data = await _recv_exactly(sock, length)
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
        observer: RpcObserver,
        faults: FaultInjector | None,
        max_tensor_bytes: int,
        max_concurrent: int,
        default_deadline_s: float,
    ) -> None:
        self._in = dict(tensor_in)
        self._out = dict(tensor_out)
        self._authenticate = authenticate
        self._observer = observer
        self._faults = faults
        self._max_tensor_bytes = max_tensor_bytes
        self._limiter = trio.CapacityLimiter(max_concurrent)
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
        _tune(listener.socket)
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
            peer = f"ipv{6 if sock.family == socket.AF_INET6 else 4}:{addr[0]}:{addr[1]}"
        except OSError:
            peer = "unknown"
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(1.0), contextlib.suppress(*_GOING_AWAY):
                await _send_all(
                    sock, [_response(StatusCode.RESOURCE_EXHAUSTED, b"bulk server busy")], None
                )
            await stream.aclose()
            return
        try:
            await self._serve(sock, peer)
        finally:
            self._limiter.release()
            with contextlib.suppress(*_GOING_AWAY):
                await stream.aclose()

    async def _serve(self, sock: trio.socket.SocketType, peer: str) -> None:
        start = time.perf_counter()
        path, sent, received = "(bulk)", 0, 0
        payload_left = 0
        #: Set once the first byte of an OK answer may have gone out: after that, an error
        #: can only close the connection (an error response would land inside the payload).
        answering = False
        try:
            with trio.fail_after(HEADER_TIMEOUT_S):
                req = await _read_request(sock)
            received = req.nbytes
            if req.path in self._in or req.path in self._out:
                path = req.path  # a metrics label: never a string a stranger chose
            timeout = min(req.timeout_s or self._default_deadline_s, MAX_DEADLINE_S)
            with trio.fail_after(timeout):
                if req.kind == KIND_PUT:
                    # The declared size first (no allocation): a refused put's payload is
                    # then read away, so its sender reads the refusal, not a reset.
                    meta = parse_header_frame(req.body, self._max_tensor_bytes)
                    payload_left = meta.nbytes
                ctx = self._authenticate(req.path, req.signed, req.body, peer)
                if req.kind == KIND_PUT:
                    handler = self._in.get(req.path)
                    if handler is None:
                        raise RpcError(StatusCode.UNIMPLEMENTED, f"no tensor method {req.path}")
                    buf = RECEIVE_BUFFERS.take(meta.nbytes)
                    await _recv_into(sock, memoryview(buf), STALL_S)
                    payload_left = 0
                    received += meta.nbytes
                    response = await handler(meta, buf, ctx)
                    answering = True
                    sent += await _send_all(
                        sock, [_response(StatusCode.OK, response.SerializeToString())], None
                    )
                else:
                    entry = self._out.get(req.path)
                    if entry is None:
                        raise RpcError(StatusCode.UNIMPLEMENTED, f"no tensor method {req.path}")
                    request_type, out_handler = entry
                    message = request_type()
                    try:
                        message.ParseFromString(req.body)
                    except DecodeError as exc:
                        raise RpcError(
                            StatusCode.INVALID_ARGUMENT,
                            f"malformed {request_type.__name__}: {exc}",
                        ) from None
                    meta, payload = await out_handler(message, ctx)
                    segments = payload_segments(payload)
                    if sum(v.nbytes for v in segments) != meta.nbytes:
                        raise FramingError("handler's payload does not match its header")
                    head = _response(StatusCode.OK, header_frame(meta))
                    answering = True
                    sent += await _send_all(sock, [head, *segments], self._faults)
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
            self._observer.on_served(path, err.code.name, time.perf_counter() - start)
            self._observer.on_bytes(path, sent, received)
            if not answering:  # nothing of an answer went out yet: say why
                await self._refuse(sock, err, payload_left)
            return
        self._observer.on_served(path, StatusCode.OK.name, time.perf_counter() - start)
        self._observer.on_bytes(path, sent, received)

    async def _refuse(self, sock: trio.socket.SocketType, err: RpcError, payload_left: int) -> None:
        with trio.move_on_after(DRAIN_S), contextlib.suppress(*_GOING_AWAY):
            await _send_all(sock, [_response(err.code, err.details.encode()[:4096])], None)
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
        _tune(stream.socket)
        return stream
    return None


async def put(
    stream: trio.SocketStream,
    request: bytes,
    payload: Sequence[memoryview],
    faults: FaultInjector | None,
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
                outcome["sent"] = await _send_all(sock, [request, *payload], faults)
            except OSError as exc:
                outcome["send_error"] = exc

        nursery.start_soon(read)
        nursery.start_soon(send)
    if "response" in outcome:
        status, data, received = outcome["response"]
        if status is not StatusCode.OK:
            raise RpcError(status, data.decode(errors="replace"))
        return data, outcome.get("sent", len(request)), received
    why = outcome.get("send_error") or outcome.get("read_error")
    raise RpcError(StatusCode.UNAVAILABLE, f"bulk connection failed: {why}")


async def get(
    stream: trio.SocketStream, request: bytes, max_bytes: int
) -> tuple[TensorMeta, bytearray, int]:
    """Sends a get's request and reads the tensor; (meta, payload, bytes received)."""
    sock = stream.socket
    try:
        await _send_all(sock, [request], None)
        status, data, received = await _read_response(sock)
        if status is not StatusCode.OK:
            raise RpcError(status, data.decode(errors="replace"))
        meta = parse_header_frame(data, max_bytes)
        buf = RECEIVE_BUFFERS.take(meta.nbytes)
        await _recv_into(sock, memoryview(buf))
    except OSError as exc:
        raise RpcError(StatusCode.UNAVAILABLE, f"bulk connection failed: {exc}") from None
    return meta, buf, received + meta.nbytes
