"""The client half of the transport: gRPC calls awaited from trio, tensors over bulk or gRPC.

The client issues ``.future`` calls and awaits them from trio, cancelling the call when the
awaiting scope is cancelled, so a trio timeout on one peer becomes a cancelled handler on the
other. Before its first call to an address, a signing client asks the server who it is
(GetBulkInfo, the hello: its identity, key-exchange share and bulk port, cached), so that every
request names its recipient and every tensor call's frames are keyed (session.py). Tensor calls
go over the bulk data plane (bulk.py) when the peer has one, and over gRPC frame streams
otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
import trio
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarmd.protocol import bulk, faults
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol._pacing import paced
from swarmd.protocol._rpc_await import await_future, from_grpc
from swarmd.protocol._rpc_config import TransportConfig
from swarmd.protocol._rpc_service import GET_BULK_INFO
from swarmd.protocol.address import parse_address
from swarmd.protocol.calls import NullObserver, RpcError, RpcObserver, StatusCode
from swarmd.protocol.errors import FramingError, ProtocolError
from swarmd.protocol.framing import (
    Payload,
    TensorMeta,
    assemble,
    header_frame,
    iter_frames,
    payload_segments,
)
from swarmd.protocol.identity import MISADDRESSED, Identity, PeerId, SignedHeader
from swarmd.protocol.session import (
    CALLER,
    SERVER,
    CallerKey,
    StreamMac,
    open_frames,
    seal_frames,
    verify_server_key,
)

M = TypeVar("M", bound=Message)
T = TypeVar("T")

#: How long a peer's hello (who it is, its bulk port) is trusted before it is asked again.
BULK_INFO_TTL_S = 600.0
#: After a bulk listener could not be reached, calls to that peer use gRPC this long.
BULK_RETRY_S = 60.0
BULK_INFO_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class _Hello:
    """What a server said about itself: whom to address, how to key frames, where bulk is."""

    peer_id: PeerId
    kx_public: bytes
    #: None: no bulk listener, or it could not be reached lately.
    bulk_port: int | None
    #: time.monotonic() after which the server is asked again.
    until: float


class RpcClient:
    """Calls other peers. One per daemon; channels are cached per address."""

    def __init__(
        self,
        identity: Identity | None,
        config: TransportConfig | None = None,
        observer: RpcObserver | None = None,
    ) -> None:
        self._identity = identity
        #: Who this client speaks as (None: an anonymous client), for signing in the layers
        #: above (a reducer's proofs).
        self.identity = identity
        self._cfg = config or TransportConfig()
        self._observer: RpcObserver = observer or NullObserver()
        self._limiter = trio.CapacityLimiter(self._cfg.max_inflight_calls)
        self._channels: OrderedDict[str, grpc.Channel] = OrderedDict()
        self._faults = faults.from_env()
        self._caller_key = CallerKey() if identity is not None else None
        #: Per peer address: its last hello.
        self._hellos: OrderedDict[str, _Hello] = OrderedDict()
        #: (method path, request signature) -> the access tag to send with it, or b"": set
        #: by a peer that joined a run with a secret (node/access.py).
        self.access_tag: Callable[[str, bytes], bytes] | None = None

    async def _inject(self, address: str, nbytes: int) -> None:
        """Applies injected faults (chaos tests) to an outgoing call: delay, or UNAVAILABLE."""
        assert self._faults is not None
        why = await self._faults.outgoing(address, nbytes)
        if why:
            raise RpcError(StatusCode.UNAVAILABLE, why)

    async def _hello(
        self, address: str, timeout: float | None, expect: PeerId | None = None
    ) -> _Hello | None:
        """Who listens at ``address`` (asked once, then cached); None for an unsigned client.
        With ``expect`` (the peer id the caller knows from a signed record or a group), a
        server that says it is someone else is refused: a stale address, or a hop on the path
        answering the hello with its own key."""
        if self._identity is None:
            return None
        cached = self._hellos.get(address)
        if cached is not None and cached.until > time.monotonic():
            if expect is None or cached.peer_id == expect:
                return cached
            self._hellos.pop(address, None)  # ask again: a new peer may listen there
        info = await self.unary(
            address,
            GET_BULK_INFO,
            pb.BulkInfoRequest(),
            pb.BulkInfo,
            timeout=min(BULK_INFO_TIMEOUT_S, self._timeout(timeout)),
        )
        try:
            peer_id = verify_server_key(info.public_key, info.kx_public, info.kx_signature)
        except ProtocolError as exc:
            raise RpcError(StatusCode.UNAUTHENTICATED, f"{address}: {exc}") from None
        port = info.port if 0 < info.port <= 65535 and self._cfg.bulk else None
        hello = _Hello(peer_id, info.kx_public, port, time.monotonic() + BULK_INFO_TTL_S)
        self._remember(address, hello)
        if expect is not None and peer_id != expect:
            raise RpcError(
                StatusCode.UNAUTHENTICATED,
                f"{address} says it is peer {peer_id.short()}, not the expected {expect.short()}",
            )
        return hello

    def _remember(self, address: str, hello: _Hello) -> None:
        self._hellos[address] = hello
        self._hellos.move_to_end(address)
        while len(self._hellos) > self._cfg.max_channels:
            self._hellos.popitem(last=False)

    @contextlib.contextmanager
    def _forget_if_misaddressed(self, address: str) -> Iterator[None]:
        """A server that says we addressed someone else is a new peer at that address: what
        this client believed about it is dropped (the error still propagates)."""
        try:
            yield
        except RpcError as exc:
            if exc.code is StatusCode.UNAUTHENTICATED and MISADDRESSED in exc.details:
                self._hellos.pop(address, None)
            raise

    async def _await(self, address: str, fut: grpc.Future) -> Any:
        with self._forget_if_misaddressed(address):
            return await await_future(fut)

    def bulk_port(self, address: str) -> int | None:
        """The bulk port this client uses for ``address`` now (None: gRPC, or not asked yet)."""
        cached = self._hellos.get(address)
        return cached.bulk_port if cached is not None and cached.until > time.monotonic() else None

    def peer_id(self, address: str) -> PeerId | None:
        """Who this client believes listens at ``address`` (None: not asked yet)."""
        cached = self._hellos.get(address)
        return cached.peer_id if cached is not None else None

    def _sign(
        self, path: str, body: bytes, to: PeerId | None, server_kx: bytes | None = None
    ) -> tuple[SignedHeader | None, StreamMac | None]:
        """The request's signed header, addressed to ``to``, and for a tensor call (one with
        the server's key share) the key of its frames. (None, None) for an unsigned client."""
        if self._identity is None:
            return None, None
        assert self._caller_key is not None  # made with the identity
        now = self._faults.wall_clock() if self._faults is not None else None
        kx = self._caller_key.kx_public if server_kx is not None else b""
        signed = self._identity.sign_request(path, body, recipient=to, kx=kx, now=now)
        if self.access_tag is not None and (tag := self.access_tag(path, signed.signature)):
            signed = dataclasses.replace(signed, access=tag)
        mac = None
        if server_kx is not None and to is not None:
            mac = self._caller_key.stream_mac(signed, to, server_kx)
        return signed, mac

    def _sign_tensor(
        self, path: str, body: bytes, hello: _Hello | None
    ) -> tuple[SignedHeader | None, StreamMac | None]:
        if hello is None:
            return self._sign(path, body, None)
        return self._sign(path, body, hello.peer_id, hello.kx_public)

    async def _bulk_call(
        self,
        address: str,
        hello: _Hello | None,
        kind: int,
        path: str,
        first: bytes,
        timeout: float | None,
        exchange: Callable[[trio.SocketStream, bytes, StreamMac], Awaitable[T]],
    ) -> T | None:
        """One bulk call: connect, send the signed request, let ``exchange`` do the rest.
        None if the peer has no bulk listener or it cannot be reached (then use gRPC)."""
        if hello is None or hello.bulk_port is None:
            return None
        if len(first) > bulk.MAX_BODY_BYTES or len(path.encode()) > bulk.MAX_PATH_BYTES:
            return None
        # Bounded by the caller's _deadline scope, which also covers a gRPC fallback.
        if self._faults is not None:
            await self._inject(address, len(first))
        async with self._limiter:
            stream = await bulk.connect(parse_address(address).host, hello.bulk_port)
            if stream is None:
                until = time.monotonic() + BULK_RETRY_S
                self._remember(address, dataclasses.replace(hello, bulk_port=None, until=until))
                return None
            async with stream:
                signed, mac = self._sign_tensor(path, first, hello)
                assert signed is not None and mac is not None
                request = bulk.encode_request(kind, path, signed, first, self._timeout(timeout))
                with self._forget_if_misaddressed(address):
                    try:
                        return await exchange(stream, request, mac)
                    except bulk.BulkBusy:
                        # Nothing of the call was read (its slots are full, perhaps of a
                        # flood's idle connections): gRPC has its own.
                        return None

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        target = str(parse_address(address))
        channel = grpc.insecure_channel(target, options=self._cfg.grpc_options())
        self._channels[address] = channel
        while len(self._channels) > self._cfg.max_channels:
            _, old = self._channels.popitem(last=False)
            old.close()
        return channel

    def _metadata(self, path: str, signed: SignedHeader | None) -> list[tuple[str, str | bytes]]:
        """The signed request headers; their bytes (and the path's) count as sent, so byte
        counters include what a call costs beyond its body, not only tensor payloads."""
        metadata = signed.to_metadata() if signed is not None else []
        self._observer.on_bytes(path, len(path) + sum(len(k) + len(v) for k, v in metadata), 0)
        return metadata

    def _timeout(self, timeout: float | None) -> float:
        """The call's deadline: the explicit one, bounded by the enclosing trio deadline."""
        t = self._cfg.default_deadline_s if timeout is None else timeout
        deadline = trio.current_effective_deadline()
        if deadline != math.inf:
            t = min(t, deadline - trio.current_time())
        if t <= 0:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "no time left for the call")
        return t

    async def unary(
        self,
        address: str,
        path: str,
        request: Message,
        response_type: type[M],
        *,
        timeout: float | None = None,
        recipient: PeerId | None = None,
    ) -> M:
        """One request and its answer. ``recipient``: the peer id the caller expects at
        ``address`` (the DHT knows its contacts'), which saves asking the server who it is."""
        return await paced(
            self._timeout(timeout),
            self._cfg,
            lambda left: self._unary(address, path, request, response_type, left, recipient),
        )

    async def _unary(
        self,
        address: str,
        path: str,
        request: Message,
        response_type: type[M],
        timeout: float | None,
        recipient: PeerId | None,
    ) -> M:
        body = request.SerializeToString()
        if recipient is None and path != GET_BULK_INFO:
            hello = await self._hello(address, timeout)
            recipient = hello.peer_id if hello is not None else None
        if self._faults is not None:
            await self._inject(address, len(body))
        signed, _ = self._sign(path, body, recipient)
        async with self._limiter:
            call = self._channel(address).unary_unary(path)
            fut = call.future(
                body, timeout=self._timeout(timeout), metadata=self._metadata(path, signed)
            )
            raw: bytes = await self._await(address, fut)
        self._observer.on_bytes(path, len(body), len(raw))
        return _parse_response(response_type, raw, address)

    @contextlib.contextmanager
    def _deadline(self, timeout: float | None) -> Iterator[None]:
        """One deadline for a whole call, bulk attempt and gRPC fallback together."""
        try:
            with trio.fail_after(self._timeout(timeout)):
                yield
        except trio.TooSlowError:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None

    async def put_tensor(
        self,
        address: str,
        path: str,
        meta: TensorMeta,
        payload: Payload,
        response_type: type[M],
        *,
        timeout: float | None = None,
        expect: PeerId | None = None,
    ) -> M:
        """Streams a tensor to ``path``; the server's handler gets it whole, already validated.
        ``expect``: the peer id that must be listening at ``address`` (see `_hello`)."""
        with self._deadline(timeout):
            return await paced(
                self._timeout(timeout),
                self._cfg,
                lambda left: self._put_tensor(
                    address, path, meta, payload, response_type, left, expect
                ),
            )

    async def _put_tensor(
        self,
        address: str,
        path: str,
        meta: TensorMeta,
        payload: Payload,
        response_type: type[M],
        timeout: float | None,
        expect: PeerId | None,
    ) -> M:
        hello = await self._hello(address, timeout, expect)
        segments = payload_segments(payload)
        if sum(v.nbytes for v in segments) != meta.nbytes:
            raise FramingError(f"payload does not match its header's {meta.nbytes} B")

        async def exchange(stream: trio.SocketStream, request: bytes, mac: StreamMac) -> bytes:
            data, sent, received = await bulk.put(stream, request, segments, self._faults, mac)
            self._observer.on_bytes(path, sent, received)
            return data

        answer = await self._bulk_call(
            address, hello, bulk.KIND_PUT, path, header_frame(meta), timeout, exchange
        )
        if answer is not None:
            return _parse_response(response_type, answer, address)
        frames = iter_frames(meta, segments, self._cfg.chunk_bytes)
        first = next(frames)
        signed, mac = self._sign_tensor(path, first, hello)
        # The first frame is signed; the others each carry their tag.
        rest = frames if mac is None else seal_frames(mac, CALLER, frames, 1)
        sent = len(first)

        def all_frames() -> Iterator[bytes]:
            nonlocal sent
            yield first
            for frame in rest:
                if self._faults is not None:
                    self._faults.pace(len(frame))
                sent += len(frame)
                yield frame

        if self._faults is not None:
            await self._inject(address, len(first))
        async with self._limiter:
            call = self._channel(address).stream_unary(path)
            fut = call.future(
                all_frames(), timeout=self._timeout(timeout), metadata=self._metadata(path, signed)
            )
            raw: bytes = await self._await(address, fut)
        self._observer.on_bytes(path, sent, len(raw))
        return _parse_response(response_type, raw, address)

    async def get_tensor(
        self,
        address: str,
        path: str,
        request: Message,
        *,
        timeout: float | None = None,
        max_bytes: int | None = None,
        expect: PeerId | None = None,
    ) -> tuple[TensorMeta, bytearray]:
        """Fetches a tensor stream; raises FramingError if the peer's stream is malformed.
        ``expect``: the peer id that must be listening at ``address`` (see `_hello`)."""
        with self._deadline(timeout):
            return await paced(
                self._timeout(timeout),
                self._cfg,
                lambda left: self._get_tensor(address, path, request, left, max_bytes, expect),
            )

    async def _get_tensor(
        self,
        address: str,
        path: str,
        request: Message,
        timeout: float | None,
        max_bytes: int | None,
        expect: PeerId | None,
    ) -> tuple[TensorMeta, bytearray]:
        body = request.SerializeToString()
        limit = self._cfg.max_tensor_bytes if max_bytes is None else max_bytes
        hello = await self._hello(address, timeout, expect)

        async def exchange(
            stream: trio.SocketStream, raw_request: bytes, mac: StreamMac
        ) -> tuple[TensorMeta, bytearray]:
            meta, data, received = await bulk.get(stream, raw_request, limit, mac)
            self._observer.on_bytes(path, len(raw_request), received)
            return meta, data

        got = await self._bulk_call(address, hello, bulk.KIND_GET, path, body, timeout, exchange)
        if got is not None:
            return got
        if self._faults is not None:
            await self._inject(address, len(body))
        signed, mac = self._sign_tensor(path, body, hello)
        async with self._limiter:
            call = self._channel(address).unary_stream(path)
            stream = call(
                body, timeout=self._timeout(timeout), metadata=self._metadata(path, signed)
            )
            received = 0

            def counted() -> Iterator[bytes]:
                nonlocal received
                for frame in stream:
                    received += len(frame)
                    yield frame

            def read() -> tuple[TensorMeta, bytearray]:
                frames = counted() if mac is None else open_frames(mac, SERVER, counted(), 0)
                try:
                    with self._forget_if_misaddressed(address):
                        try:
                            return assemble(frames, limit)
                        except grpc.RpcError as exc:
                            raise from_grpc(exc) from None
                except ProtocolError:
                    stream.cancel()
                    raise

            try:
                meta, data = await trio.to_thread.run_sync(read, abandon_on_cancel=True)
            except trio.Cancelled:
                stream.cancel()
                raise
        self._observer.on_bytes(path, len(body), received)
        return meta, data

    async def check_health(
        self, address: str, *, service: str = "", timeout: float | None = None
    ) -> str:
        """The peer's grpc.health.v1 status name (e.g. "SERVING")."""
        if self._faults is not None:
            await self._inject(address, 0)
        async with self._limiter:
            stub = health_pb2_grpc.HealthStub(self._channel(address))
            fut = stub.Check.future(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout)
            )
            resp = await await_future(fut)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def _parse_response(response_type: type[M], raw: bytes, address: str) -> M:
    response = response_type()
    try:
        response.ParseFromString(raw)
    except DecodeError as exc:
        raise ProtocolError(f"malformed {response_type.__name__} from {address}: {exc}") from None
    return response
