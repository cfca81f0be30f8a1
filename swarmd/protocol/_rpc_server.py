"""The server half of the transport: gRPC's worker threads hand each call to the trio loop.

gRPC's sync server runs handlers on a bounded thread pool; each handler hops into the daemon's
trio loop, where the application's async handler runs under a cancel scope whose deadline is the
client's, and which the client's cancellation cancels.

Requests are authenticated by a signed header in the metadata (see identity.py); the server
verifies it in the gRPC thread, before trio or the application sees the request, and refuses
requests addressed to another peer. Every server has an identity (its node's, or a throwaway
one for a bare server) and answers GetBulkInfo, the one unaddressed method, with who it is and
its key-exchange share, so that callers can address it and key each tensor call's frames
(session.py). Tensor methods are also served over the bulk data plane (bulk.py) where the
config enables it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import grpc
import trio
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarmd.protocol import bulk, faults
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol._rate_limit import RateLimiter
from swarmd.protocol._receive_budget import ReceiveBudget, Reservation
from swarmd.protocol._rpc_config import TransportConfig
from swarmd.protocol._rpc_service import (
    GET_BULK_INFO,
    TRANSPORT_SERVICE,
    Method,
    Service,
    method_path,
    unary,
)
from swarmd.protocol.address import Address, address_key
from swarmd.protocol.calls import (
    CallContext,
    NullObserver,
    RpcError,
    RpcObserver,
    StatusCode,
    rate_limited,
    to_rpc_error,
)
from swarmd.protocol.errors import ListenError
from swarmd.protocol.framing import StreamAssembler, TensorMeta, iter_frames, parse_header_frame
from swarmd.protocol.identity import Identity, PeerId, ReplayGuard, SignedHeader
from swarmd.protocol.session import CALLER, SERVER, ServerKey, StreamMac, open_frames, seal_frames

log = logging.getLogger("swarmd.rpc")

M = TypeVar("M", bound=Message)
T = TypeVar("T")


def _parse(request_type: type[M], raw: bytes) -> M:
    msg = request_type()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise RpcError(
            StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}"
        ) from None
    return msg


class _CancelHandle:
    """Lets a gRPC thread cancel a trio task that may not have started yet (trio thread only)."""

    def __init__(self) -> None:
        self.cancelled = False
        self._scope: trio.CancelScope | None = None

    def attach(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self.cancelled:
            scope.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()


class RpcServer:
    """A gRPC server whose handlers run in the caller's trio loop. Create with ``serve()``."""

    def __init__(
        self,
        services: Sequence[Service],
        config: TransportConfig,
        observer: RpcObserver | None,
        guard: ReplayGuard | None,
        identity: Identity | None,
    ) -> None:
        self._services = services
        self._cfg = config
        self._observer: RpcObserver = observer or NullObserver()
        #: Injected faults (SWARMD_FAULTS, chaos tests); None in normal operation.
        self._faults = faults.from_env()
        self._key = ServerKey(identity or Identity.generate())
        self._guard = guard or ReplayGuard(
            max_skew_s=config.max_clock_skew_s,
            clock=self._faults.wall_clock if self._faults else time.time,
        )
        self._guard.own = self._key.peer_id
        self._guard.unaddressed = frozenset({GET_BULK_INFO})
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._grpc: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.address = Address("", 0)
        self._bulk: bulk.BulkServer | None = None
        paths = {method_path(sv.name, m.name): m for sv in services for m in sv.methods}
        self._gates = {
            method_path(sv.name, m.name): sv.gate
            for sv in services
            if sv.gate is not None
            for m in sv.methods
        }
        self._tensor_in = {p: m for p, m in paths.items() if m.kind == "tensor_in"}
        self.rate_limiter = RateLimiter(config.rate_limits)
        self._limited_logged = -1e9
        self.receive_budget = ReceiveBudget(
            config.max_receive_bytes, config.max_receive_bytes_per_peer, config.receive_wait_s
        )
        if config.bulk and any(m.kind != "unary" for m in paths.values()):
            self._bulk = bulk.BulkServer(
                tensor_in={p: m.handler for p, m in self._tensor_in.items()},
                admit=self._admit_tensor,
                tensor_out={
                    p: (m.request_type, m.handler)
                    for p, m in paths.items()
                    if m.kind == "tensor_out" and m.request_type is not None
                },
                authenticate=self._authenticate_bulk,
                observer=self._observer,
                faults=self._faults,
                max_tensor_bytes=config.max_tensor_bytes,
                max_concurrent=config.max_concurrent_rpcs,
                max_per_address=config.bulk_max_per_address,
                default_deadline_s=config.default_deadline_s,
            )
        self._services = [*services, self._transport_service()]

    @property
    def bulk_port(self) -> int:
        """The bulk data plane's port, 0 if this server has none."""
        return self._bulk.port if self._bulk is not None else 0

    def _transport_service(self) -> Service:
        async def bulk_info(_: pb.BulkInfoRequest, ctx: CallContext) -> pb.BulkInfo:
            key = self._key
            return pb.BulkInfo(
                port=self.bulk_port,
                public_key=key.public_key,
                kx_public=key.kx_public,
                kx_signature=key.kx_signature,
            )

        return Service(TRANSPORT_SERVICE, [unary("GetBulkInfo", pb.BulkInfoRequest, bulk_info)])

    async def _start_bulk(self, nursery: trio.Nursery, host: str) -> None:
        if self._bulk is not None:
            await self._bulk.start(nursery, host, self._cfg.bulk_port)

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self, nursery: trio.Nursery, host: str, port: int) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery
        cfg = self._cfg
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(
                max_workers=cfg.max_concurrent_rpcs, thread_name_prefix="swarmd-rpc"
            ),
            options=cfg.grpc_options(),
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        for service in self._services:
            handlers = {m.name: self._rpc_handler(service.name, m) for m in service.methods}
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service.name, handlers),)
            )
            self._health.set(service.name, health_pb2.HealthCheckResponse.SERVING)
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {bind}: {exc}") from None
        if bound == 0:
            raise ListenError(f"cannot listen on {bind} (address in use or not local)")
        server.start()
        self._grpc = server
        self.address = Address(host, bound)

    async def _stop(self) -> None:
        if self._grpc is None:
            return
        self._health.enter_graceful_shutdown()
        server, grace = self._grpc, self._cfg.grace_s
        self._grpc = None
        await trio.to_thread.run_sync(lambda: server.stop(grace).wait())
        peak = self.rate_limiter.peak_use
        # How near this server's callers came to the rate limits: the figure that says
        # whether the defaults leave honest traffic room (docs/architecture.md).
        log.info(
            "rate limits: at most %.1f%% of a peer's burst and %.1f%% of an address's used",
            100 * peak["peer"],
            100 * peak["address"],
        )

    # -- request path ------------------------------------------------------------------------

    def _authenticate(
        self, path: str, context: grpc.ServicerContext, body: bytes, *, tensor: bool = False
    ) -> tuple[CallContext, StreamMac | None]:
        """The call's context, and for a signed tensor call the key of its frames."""
        if self._faults is not None and (why := self._faults.incoming()):
            raise RpcError(StatusCode.UNAVAILABLE, why)
        metadata = {k: v for k, v in context.invocation_metadata()}
        peer_id: PeerId | None = None
        mac: StreamMac | None = None
        self._check_rate(path, "address", context.peer())
        if self._cfg.require_auth or "swarmd-sig-bin" in metadata:
            signed = SignedHeader.from_metadata(metadata)
            peer_id = self._guard.verify(path, signed, body)
            self._check_rate(path, "peer", str(peer_id))
            if tensor:
                mac = self._key.stream_mac(signed)
            ctx = CallContext(path, peer_id, context.peer(), signed.signature, signed.access)
        else:
            ctx = CallContext(method=path, peer_id=peer_id, peer=context.peer())
        self._check_gate(ctx)
        return ctx, mac

    def _authenticate_bulk(
        self, path: str, signed: SignedHeader, body: bytes, peer: str
    ) -> tuple[CallContext, StreamMac]:
        """The bulk plane's requests pass the same checks as gRPC's (always signed there)."""
        if self._faults is not None and (why := self._faults.incoming()):
            raise RpcError(StatusCode.UNAVAILABLE, why)
        self._check_rate(path, "address", peer)
        peer_id = self._guard.verify(path, signed, body)
        self._check_rate(path, "peer", str(peer_id))
        ctx = CallContext(path, peer_id, peer, signed.signature, signed.access)
        self._check_gate(ctx)
        return ctx, self._key.stream_mac(signed)

    def _check_gate(self, ctx: CallContext) -> None:
        """The service's own admission (a run's access rules), after authentication."""
        gate = self._gates.get(ctx.method)
        if gate is not None:
            gate(ctx)

    def _check_rate(self, path: str, scope: Literal["address", "peer"], who: str) -> None:
        """The address's bucket before the signature is verified, the peer's after it."""
        limiter = self.rate_limiter
        wait = limiter.address_wait(who) if scope == "address" else limiter.peer_wait(who)
        if wait == 0.0:
            return
        self._observer.on_limited(scope)
        now = time.monotonic()
        if now - self._limited_logged >= 10.0:  # one line per 10 s, not one per refusal
            self._limited_logged = now
            log.warning("rate limit: refusing calls from %s %s (%s)", scope, who, path[:80])
        raise rate_limited(scope, wait)

    async def _admit_tensor(self, path: str, meta: TensorMeta, ctx: CallContext) -> Reservation:
        """Runs before a tensor_in call's buffer exists: the method's own check of what was
        declared, then room in the receive budget (per verified sender, else per address)."""
        method = self._tensor_in.get(path)
        if method is None:
            raise RpcError(StatusCode.UNIMPLEMENTED, f"no tensor method {path}")
        if method.admit is not None:
            await method.admit(meta, ctx)
        sender = str(ctx.peer_id) if ctx.peer_id is not None else address_key(ctx.peer)
        return await self.receive_budget.reserve(sender, meta.nbytes)

    def _run_in_trio(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], context: grpc.ServicerContext
    ) -> T:
        """Runs ``fn(*args)`` as a task of the server's nursery; blocks this gRPC thread on it."""
        assert self._token is not None and self._nursery is not None
        token = self._token
        remaining = context.time_remaining()
        timeout = self._cfg.default_deadline_s if remaining is None else max(0.0, remaining)
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        handle = _CancelHandle()

        def on_terminate() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(handle.cancel)

        try:
            trio.from_thread.run_sync(
                self._nursery.start_soon,
                self._task,
                fn,
                args,
                timeout,
                handle,
                done,
                trio_token=token,
            )
        except (trio.RunFinishedError, RuntimeError):
            raise RpcError(StatusCode.UNAVAILABLE, "server is shutting down") from None
        if not context.add_callback(on_terminate):
            on_terminate()
        return done.result()

    async def _task(
        self,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        timeout: float,
        handle: _CancelHandle,
        done: concurrent.futures.Future[T],
    ) -> None:
        try:
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                handle.attach(scope)
                result = await fn(*args)
            if scope.cancelled_caught:
                if handle.cancelled:
                    done.set_exception(RpcError(StatusCode.CANCELLED, "cancelled by the client"))
                else:
                    done.set_exception(RpcError(StatusCode.DEADLINE_EXCEEDED, "deadline passed"))
            else:
                done.set_result(result)
        except trio.Cancelled:
            done.set_exception(RpcError(StatusCode.UNAVAILABLE, "server is shutting down"))
            raise
        except Exception as exc:
            err = to_rpc_error(exc)
            if err.code is StatusCode.INTERNAL:
                log.exception("handler %s failed", getattr(fn, "__qualname__", fn))
            done.set_exception(err)

    def _rpc_handler(self, service: str, method: Method) -> grpc.RpcMethodHandler:
        path = method_path(service, method.name)
        if method.kind == "unary":
            return grpc.unary_unary_rpc_method_handler(self._unary_behavior(path, method))
        if method.kind == "tensor_in":
            return grpc.stream_unary_rpc_method_handler(self._tensor_in_behavior(path, method))
        return grpc.unary_stream_rpc_method_handler(self._tensor_out_behavior(path, method))

    def _finish(
        self, path: str, start: float, exc: BaseException | None, context: grpc.ServicerContext
    ) -> None:
        """Records the call and, on failure, aborts it with the right status (abort raises)."""
        if exc is None:
            self._observer.on_served(path, StatusCode.OK.name, time.perf_counter() - start)
            return
        if isinstance(exc, grpc.RpcError):
            err = RpcError(StatusCode.CANCELLED, "call ended by the client")
        else:
            err = to_rpc_error(exc)
        if err.code is StatusCode.UNAUTHENTICATED:  # forged, replayed, misaddressed or altered
            log.warning("refused call %s from %s: %s", path, context.peer(), err.details)
        self._observer.on_served(path, err.code.name, time.perf_counter() - start)
        context.abort(grpc.StatusCode[err.code.name], err.details)

    def _unary_behavior(self, path: str, method: Method) -> Callable[..., bytes]:
        assert method.request_type is not None
        request_type = method.request_type

        def behavior(request: bytes, context: grpc.ServicerContext) -> bytes:
            start = time.perf_counter()
            try:
                ctx, _ = self._authenticate(path, context, request)
                response = self._run_in_trio(
                    method.handler, (_parse(request_type, request), ctx), context
                )
                out: bytes = response.SerializeToString()
            except Exception as exc:
                self._finish(path, start, exc, context)
                raise  # unreachable: abort raised
            self._observer.on_bytes(path, len(out), len(request))
            self._finish(path, start, None, context)
            return out

        return behavior

    def _tensor_in_behavior(self, path: str, method: Method) -> Callable[..., bytes]:
        def behavior(frames: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            start = time.perf_counter()
            received = 0
            try:
                first = next(frames, None)
                if first is None:
                    raise RpcError(StatusCode.INVALID_ARGUMENT, "empty tensor stream")
                ctx, mac = self._authenticate(path, context, first, tensor=True)
                # Nothing is allocated before the declared size passed our limit, the
                # method's own check and the receive budget.
                meta = parse_header_frame(first, self._cfg.max_tensor_bytes)
                held = self._run_in_trio(self._admit_tensor, (path, meta, ctx), context)
                try:
                    asm = StreamAssembler(self._cfg.max_tensor_bytes)
                    asm.feed(first)
                    received = len(first)
                    # The first frame is signed; the others each carry their tag.
                    rest = frames if mac is None else open_frames(mac, CALLER, frames, 1)
                    for frame in rest:
                        asm.feed(frame)
                        received += len(frame)
                    meta, data = asm.finish()
                    response = self._run_in_trio(method.handler, (meta, data, ctx), context)
                finally:
                    held.release()
                out: bytes = response.SerializeToString()
            except Exception as exc:
                self._observer.on_bytes(path, 0, received)
                self._finish(path, start, exc, context)
                raise
            self._observer.on_bytes(path, len(out), received)
            self._finish(path, start, None, context)
            return out

        return behavior

    def _tensor_out_behavior(self, path: str, method: Method) -> Callable[..., Iterator[bytes]]:
        assert method.request_type is not None
        request_type = method.request_type

        def behavior(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            start = time.perf_counter()
            sent = 0
            try:
                ctx, mac = self._authenticate(path, context, request, tensor=True)
                meta, payload = self._run_in_trio(
                    method.handler, (_parse(request_type, request), ctx), context
                )
                frames = iter_frames(meta, payload, self._cfg.chunk_bytes)
                if mac is not None:
                    frames = seal_frames(mac, SERVER, frames, 0)
                for frame in frames:
                    if self._faults is not None:
                        self._faults.pace(len(frame))
                    sent += len(frame)
                    yield frame
            except Exception as exc:
                self._observer.on_bytes(path, sent, len(request))
                self._finish(path, start, exc, context)
                raise
            self._observer.on_bytes(path, sent, len(request))
            self._finish(path, start, None, context)

        return behavior


@asynccontextmanager
async def serve(
    services: Sequence[Service],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    config: TransportConfig | None = None,
    observer: RpcObserver | None = None,
    guard: ReplayGuard | None = None,
    identity: Identity | None = None,
) -> AsyncIterator[RpcServer]:
    """Serves ``services`` (plus grpc.health.v1) until the block exits; port 0 lets the OS pick.
    ``identity`` is who callers address (the node's own); None gives a throwaway one."""
    server = RpcServer(services, config or TransportConfig(), observer, guard, identity)
    async with trio.open_nursery() as nursery:
        await server._start_bulk(nursery, host)
        server._start(nursery, host, port)
        try:
            yield server
        finally:
            with trio.CancelScope(shield=True):
                await server._stop()
            nursery.cancel_scope.cancel()
