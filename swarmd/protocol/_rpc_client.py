"""The client half of the transport: gRPC calls awaited from trio, tensors over bulk or gRPC.

The client issues ``.future`` calls and awaits them from trio, cancelling the call when the
awaiting scope is cancelled, so a trio timeout on one peer becomes a cancelled handler on the
other. Tensor calls go over the bulk data plane (bulk.py) when the peer has one, learnt from its
GetBulkInfo and cached, and over gRPC frame streams otherwise.
"""

from __future__ import annotations

import contextlib
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
from swarmd.protocol.identity import Identity

M = TypeVar("M", bound=Message)
T = TypeVar("T")

#: How long a peer's bulk port (or its lack of one) is trusted before it is asked again.
BULK_INFO_TTL_S = 600.0
#: After a bulk listener could not be reached, calls to that peer use gRPC this long.
BULK_RETRY_S = 60.0
BULK_INFO_TIMEOUT_S = 5.0
#: After asking a peer for its bulk port failed, how long its calls use gRPC without asking.
BULK_INFO_RETRY_S = 10.0


async def _await_future(fut: grpc.Future) -> Any:
    """Awaits a gRPC future from trio; cancelling the awaiting scope cancels the call."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: grpc.Future) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    fut.add_done_callback(wake)
    try:
        await done.wait()
    except trio.Cancelled:
        fut.cancel()
        raise
    try:
        return fut.result()
    except grpc.RpcError as exc:
        raise _from_grpc(exc) from None


def _from_grpc(exc: grpc.RpcError) -> RpcError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    return RpcError(StatusCode[name], details or "")


class RpcClient:
    """Calls other peers. One per daemon; channels are cached per address."""

    def __init__(
        self,
        identity: Identity | None,
        config: TransportConfig | None = None,
        observer: RpcObserver | None = None,
    ) -> None:
        self._identity = identity
        self._cfg = config or TransportConfig()
        self._observer: RpcObserver = observer or NullObserver()
        self._limiter = trio.CapacityLimiter(self._cfg.max_inflight_calls)
        self._channels: OrderedDict[str, grpc.Channel] = OrderedDict()
        self._faults = faults.from_env()
        #: Per peer address: its bulk listener's port (None: it has none, or it could not be
        #: reached) and until when that answer is trusted.
        self._bulk_ports: OrderedDict[str, tuple[int | None, float]] = OrderedDict()

    async def _inject(self, address: str, nbytes: int) -> None:
        """Applies injected faults (chaos tests) to an outgoing call: delay, or UNAVAILABLE."""
        assert self._faults is not None
        why = await self._faults.outgoing(address, nbytes)
        if why:
            raise RpcError(StatusCode.UNAVAILABLE, why)

    async def _bulk_target(self, address: str, timeout: float | None) -> tuple[str, int] | None:
        """Where to reach ``address``'s bulk listener, or None to use gRPC for this call."""
        if not self._cfg.bulk or self._identity is None:
            return None
        now = time.monotonic()
        cached = self._bulk_ports.get(address)
        if cached is not None and cached[1] > now:
            port = cached[0]
        else:
            try:
                info = await self.unary(
                    address,
                    GET_BULK_INFO,
                    pb.BulkInfoRequest(),
                    pb.BulkInfo,
                    timeout=min(BULK_INFO_TIMEOUT_S, self._timeout(timeout)),
                )
            except RpcError as exc:
                if exc.code is not StatusCode.UNIMPLEMENTED:
                    # The call itself will say what is wrong with the peer; meanwhile its
                    # other calls do not each pay for asking again.
                    self._remember_bulk(address, None, BULK_INFO_RETRY_S)
                    return None
                info = pb.BulkInfo(port=0)  # a peer without the bulk plane
            port = info.port if 0 < info.port <= 65535 else None
            self._remember_bulk(address, port, BULK_INFO_TTL_S)
        if port is None:
            return None
        return parse_address(address).host, port

    def bulk_port(self, address: str) -> int | None:
        """The bulk port this client uses for ``address`` now (None: gRPC, or not asked yet)."""
        cached = self._bulk_ports.get(address)
        return cached[0] if cached is not None and cached[1] > time.monotonic() else None

    def _remember_bulk(self, address: str, port: int | None, ttl: float) -> None:
        self._bulk_ports[address] = (port, time.monotonic() + ttl)
        self._bulk_ports.move_to_end(address)
        while len(self._bulk_ports) > self._cfg.max_channels:
            self._bulk_ports.popitem(last=False)

    async def _bulk_call(
        self,
        address: str,
        target: tuple[str, int],
        kind: int,
        path: str,
        first: bytes,
        timeout: float | None,
        exchange: Callable[[trio.SocketStream, bytes], Awaitable[T]],
    ) -> T | None:
        """One bulk call: connect, send the signed request, let ``exchange`` do the rest.
        None if the listener cannot be reached (the caller then uses gRPC)."""
        assert self._identity is not None
        if len(first) > bulk.MAX_BODY_BYTES or len(path.encode()) > bulk.MAX_PATH_BYTES:
            return None
        # Bounded by the caller's _deadline scope, which also covers a gRPC fallback.
        if self._faults is not None:
            await self._inject(address, len(first))
        async with self._limiter:
            stream = await bulk.connect(*target)
            if stream is None:
                self._remember_bulk(address, None, BULK_RETRY_S)
                return None
            async with stream:
                now = self._faults.wall_clock() if self._faults is not None else None
                signed = self._identity.sign_request(path, first, now=now)
                request = bulk.encode_request(kind, path, signed, first, self._timeout(timeout))
                return await exchange(stream, request)

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

    def _metadata(self, path: str, body: bytes) -> list[tuple[str, str | bytes]]:
        """The signed request headers; their bytes (and the path's) count as sent, so byte
        counters include what a call costs beyond its body, not only tensor payloads."""
        metadata: list[tuple[str, str | bytes]] = []
        if self._identity is not None:
            now = self._faults.wall_clock() if self._faults is not None else None
            metadata = self._identity.sign_request(path, body, now=now).to_metadata()
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
    ) -> M:
        body = request.SerializeToString()
        if self._faults is not None:
            await self._inject(address, len(body))
        async with self._limiter:
            call = self._channel(address).unary_unary(path)
            fut = call.future(
                body, timeout=self._timeout(timeout), metadata=self._metadata(path, body)
            )
            raw: bytes = await _await_future(fut)
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
    ) -> M:
        """Streams a tensor to ``path``; the server's handler gets it whole, already validated."""
        with self._deadline(timeout):
            return await self._put_tensor(address, path, meta, payload, response_type, timeout)

    async def _put_tensor(
        self,
        address: str,
        path: str,
        meta: TensorMeta,
        payload: Payload,
        response_type: type[M],
        timeout: float | None,
    ) -> M:
        target = await self._bulk_target(address, timeout)
        if target is not None:
            segments = payload_segments(payload)
            if sum(v.nbytes for v in segments) != meta.nbytes:
                raise FramingError(f"payload does not match its header's {meta.nbytes} B")

            async def exchange(stream: trio.SocketStream, request: bytes) -> bytes:
                data, sent, received = await bulk.put(stream, request, segments, self._faults)
                self._observer.on_bytes(path, sent, received)
                return data

            answer = await self._bulk_call(
                address, target, bulk.KIND_PUT, path, header_frame(meta), timeout, exchange
            )
            if answer is not None:
                return _parse_response(response_type, answer, address)
        frames = iter_frames(meta, payload, self._cfg.chunk_bytes)
        first = next(frames)

        def all_frames() -> Iterator[bytes]:
            yield first
            for frame in frames:
                if self._faults is not None:
                    self._faults.pace(len(frame))
                yield frame

        if self._faults is not None:
            await self._inject(address, len(first))
        async with self._limiter:
            call = self._channel(address).stream_unary(path)
            fut = call.future(
                all_frames(), timeout=self._timeout(timeout), metadata=self._metadata(path, first)
            )
            raw: bytes = await _await_future(fut)
        self._observer.on_bytes(path, meta.nbytes + len(first), len(raw))
        return _parse_response(response_type, raw, address)

    async def get_tensor(
        self,
        address: str,
        path: str,
        request: Message,
        *,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> tuple[TensorMeta, bytearray]:
        """Fetches a tensor stream; raises FramingError if the peer's stream is malformed."""
        with self._deadline(timeout):
            return await self._get_tensor(address, path, request, timeout, max_bytes)

    async def _get_tensor(
        self,
        address: str,
        path: str,
        request: Message,
        timeout: float | None,
        max_bytes: int | None,
    ) -> tuple[TensorMeta, bytearray]:
        body = request.SerializeToString()
        limit = self._cfg.max_tensor_bytes if max_bytes is None else max_bytes
        target = await self._bulk_target(address, timeout)
        if target is not None:

            async def exchange(
                stream: trio.SocketStream, raw_request: bytes
            ) -> tuple[TensorMeta, bytearray]:
                meta, data, received = await bulk.get(stream, raw_request, limit)
                self._observer.on_bytes(path, len(raw_request), received)
                return meta, data

            got = await self._bulk_call(
                address, target, bulk.KIND_GET, path, body, timeout, exchange
            )
            if got is not None:
                return got
        if self._faults is not None:
            await self._inject(address, len(body))
        async with self._limiter:
            call = self._channel(address).unary_stream(path)
            stream = call(body, timeout=self._timeout(timeout), metadata=self._metadata(path, body))

            def read() -> tuple[TensorMeta, bytearray]:
                try:
                    return assemble(stream, limit)
                except grpc.RpcError as exc:
                    raise _from_grpc(exc) from None
                except ProtocolError:
                    stream.cancel()
                    raise

            try:
                meta, data = await trio.to_thread.run_sync(read, abandon_on_cancel=True)
            except trio.Cancelled:
                stream.cancel()
                raise
        self._observer.on_bytes(path, len(body), meta.nbytes)
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
            resp = await _await_future(fut)
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
