"""A bare peer: identity, the gRPC server with the Peer service, metrics, clean shutdown.

Later layers (DHT, averaging, training) add their services to the same server; this module is
what `swarmd serve` runs and what the transport tests talk to as a real process.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import trio

import swarmd
from swarmd.node.metrics import Metrics, MetricsServer
from swarmd.node.peer.progress import announce
from swarmd.node.runtime import offload
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.address import Address
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity

log = logging.getLogger("swarmd.peer")

PEER_SERVICE = "swarmd.v1.Peer"
PING = rpc.method_path(PEER_SERVICE, "Ping")
PUT_TENSOR = rpc.method_path(PEER_SERVICE, "PutTensor")
GET_TENSOR = rpc.method_path(PEER_SERVICE, "GetTensor")


@dataclass(frozen=True)
class PeerConfig:
    listen: Address = field(default_factory=lambda: Address("127.0.0.1", 0))
    state_dir: Path = Path(".")
    metrics: Address | None = None
    #: Bytes of received tensors kept for GetTensor; the oldest are dropped first.
    scratch_bytes: int = 1 << 30
    transport: rpc.TransportConfig = field(default_factory=rpc.TransportConfig)

    def __post_init__(self) -> None:
        if self.scratch_bytes < 0:
            raise ValueError("scratch_bytes must be >= 0")


class Scratch:
    """Named tensors received by PutTensor, bounded in total bytes (LRU)."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._items: OrderedDict[str, tuple[TensorMeta, bytearray]] = OrderedDict()
        self._bytes = 0

    def check_size(self, nbytes: int) -> None:
        """Refuses a tensor that could never be kept: asked before its buffer is allocated."""
        if nbytes > self._max:
            raise rpc.RpcError(
                rpc.StatusCode.RESOURCE_EXHAUSTED,
                f"tensor of {nbytes} B exceeds this peer's scratch space of {self._max} B",
            )

    def put(self, meta: TensorMeta, data: bytearray) -> None:
        self.check_size(len(data))
        old = self._items.pop(meta.name, None)
        if old is not None:
            self._bytes -= len(old[1])
        while self._items and self._bytes + len(data) > self._max:
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= len(dropped)
        self._items[meta.name] = (meta, data)
        self._bytes += len(data)

    def get(self, name: str) -> tuple[TensorMeta, bytearray]:
        try:
            return self._items[name]
        except KeyError:
            raise rpc.RpcError(rpc.StatusCode.NOT_FOUND, f"no tensor named {name!r}") from None


def digest(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def peer_service(identity: Identity, scratch: Scratch) -> rpc.Service:
    async def ping(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        return pb.PingResponse(
            payload=req.payload,
            version=swarmd.__version__,
            peer_id=str(identity.peer_id),
            server_time_ms=int(time.time() * 1000),
        )

    async def put_tensor(meta: TensorMeta, data: bytearray, ctx: rpc.CallContext) -> pb.TensorAck:
        # Hashing hundreds of MB takes a while: keep it off the event loop.
        d = await offload.run_sync(digest, data)
        scratch.put(meta, data)
        return pb.TensorAck(received_bytes=len(data), digest=d)

    async def admit_tensor(meta: TensorMeta, ctx: rpc.CallContext) -> None:
        scratch.check_size(meta.nbytes)

    async def get_tensor(
        req: pb.TensorRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, memoryview]:
        meta, data = scratch.get(req.name)
        return meta, memoryview(data)

    return rpc.Service(
        PEER_SERVICE,
        [
            rpc.unary("Ping", pb.PingRequest, ping),
            rpc.tensor_in("PutTensor", put_tensor, admit=admit_tensor),
            rpc.tensor_out("GetTensor", pb.TensorRequest, get_tensor),
        ],
    )


async def run_peer(
    config: PeerConfig, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serves until SIGINT/SIGTERM (or cancellation), then shuts down within the grace period."""
    identity = Identity.load_or_create(config.state_dir)
    metrics = Metrics()
    metrics_server = (
        MetricsServer(metrics, config.metrics.host, config.metrics.port) if config.metrics else None
    )
    try:
        async with rpc.serve(
            [peer_service(identity, Scratch(config.scratch_bytes))],
            config.listen.host,
            config.listen.port,
            config=config.transport,
            observer=metrics,
            identity=identity,
        ) as server:
            announce(
                "listening",
                address=str(server.address),
                peer_id=str(identity.peer_id),
                metrics_port=metrics_server.port if metrics_server else None,
            )
            log.info("peer %s listening on %s", identity.peer_id, server.address)
            task_status.started(server.address)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    break
    finally:
        if metrics_server:
            metrics_server.close()
    announce("stopped")
    sys.stdout.flush()
