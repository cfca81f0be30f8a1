"""The DHT's gRPC service: bulk Ping, Store and Find, answered from local state only.

Handlers never call other peers, so a request costs the callee a bounded amount of work: at
most ``max_batch`` records or targets per call, each checked for size before its signature.
A caller that says where it listens is offered to the routing table under the IP address its
call came from (the port is its claim), which is how a swarm learns about new nodes; it
enters only once it has answered a ping there (admission.py), so that identities that claim
an address where nothing listens cannot fill our buckets. Stored records are charged to the
call's source address (storage.py's per-address and per-network quotas).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.dht.admission import Admission
from swarmd.node.dht.caller import SERVICE, make_proof
from swarmd.node.dht.ids import ID_BYTES, id_from_bytes
from swarmd.node.dht.records import Record, RecordError, fingerprint
from swarmd.node.dht.routing import RoutingTable
from swarmd.node.dht.storage import Outcome, Storage
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.address import Address, peer_ip
from swarmd.protocol.identity import Identity, PeerId

#: Known-record fingerprints a Find may list (8 bytes each); readers send at most this many.
MAX_KNOWN = 1024


@dataclass(frozen=True)
class ServiceLimits:
    #: Records per Store call and targets per Find call.
    max_batch: int = 256
    #: Known-record fingerprints per Find call (8 bytes each).
    max_known: int = MAX_KNOWN

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_known < 0:
            raise ValueError("ServiceLimits needs max_batch >= 1 and max_known >= 0")


def source_ip(transport_peer: str) -> str | None:
    """The IP a call came from (address.peer_ip), as text; None if the transport named no IP
    (a Unix socket)."""
    ip = peer_ip(transport_peer)
    return None if ip is None else str(ip)


def caller_address(transport_peer: str, port: int) -> str | None:
    """HOST:PORT where a caller listens: the IP its call came from, the port it claims."""
    if port == 0 or port > 65535:
        return None
    host = source_ip(transport_peer)
    return None if host is None else str(Address(host, port))


_OUTCOME = {
    Outcome.STORED: pb.StoreResponse.STORED,
    Outcome.SUPERSEDED: pb.StoreResponse.SUPERSEDED,
}


class DHTService:
    def __init__(
        self,
        identity: Identity,
        table: RoutingTable,
        storage: Storage,
        admission: Admission,
        limits: ServiceLimits | None = None,
    ) -> None:
        self.identity = identity
        self.table = table
        self.storage = storage
        self.admission = admission
        self.limits = limits or ServiceLimits()

    def service(self) -> rpc.Service:
        return rpc.Service(
            SERVICE,
            [
                rpc.unary("Ping", pb.PingRequest, self.ping),
                rpc.unary("Store", pb.StoreRequest, self.store),
                rpc.unary("Find", pb.FindRequest, self.find),
            ],
        )

    def _note_caller(self, ctx: rpc.CallContext, port: int) -> None:
        if ctx.peer_id is None:
            return
        address = caller_address(ctx.peer, port)
        if address is not None:
            self.admission.offer(ctx.peer_id, address)

    async def ping(self, req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        self._note_caller(ctx, req.sender_port)
        resp = pb.PingResponse(peer_id=self.identity.peer_id.raw)
        if req.challenge:
            resp.proof.CopyFrom(make_proof(self.identity, req.challenge))
        return resp

    async def store(self, req: pb.StoreRequest, ctx: rpc.CallContext) -> pb.StoreResponse:
        if len(req.records) > self.limits.max_batch:
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT,
                f"{len(req.records)} records in one Store; the limit is {self.limits.max_batch}",
            )
        self._note_caller(ctx, req.sender_port)
        resp = pb.StoreResponse()
        source = source_ip(ctx.peer)
        for msg in req.records:
            try:
                outcome = _OUTCOME[self.storage.put(Record.from_pb(msg), source)]
                reason = ""
            except RecordError as exc:
                outcome, reason = pb.StoreResponse.REFUSED, str(exc)
            resp.outcomes.append(outcome)
            resp.reasons.append(reason)
        return resp

    async def find(self, req: pb.FindRequest, ctx: rpc.CallContext) -> pb.FindResponse:
        if len(req.targets) > self.limits.max_batch or len(req.keys) > len(req.targets):
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT,
                f"a Find takes at most {self.limits.max_batch} targets, and no more keys",
            )
        if len(req.known) > self.limits.max_known:
            raise rpc.RpcError(
                rpc.StatusCode.INVALID_ARGUMENT,
                f"a Find lists at most {self.limits.max_known} known records",
            )
        known = set(req.known)
        self._note_caller(ctx, req.sender_port)
        exclude: tuple[PeerId, ...] = (ctx.peer_id,) if ctx.peer_id is not None else ()
        resp = pb.FindResponse(peer_id=self.identity.peer_id.raw)
        k = self.table.config.k
        for i, raw in enumerate(req.targets):
            if len(raw) != ID_BYTES:
                raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "a target has 32 bytes")
            result = resp.results.add()
            key = req.keys[i] if i < len(req.keys) else b""
            if key:
                for record in self.storage.get(key):
                    if known and fingerprint(record) in known:
                        result.omitted += 1
                    else:
                        result.records.append(record.to_pb())
            if req.nodes_only_if_empty and (result.records or result.omitted):
                continue
            for contact in self.table.closest(id_from_bytes(raw), k, exclude):
                result.nodes.add(peer_id=contact.peer_id.raw, address=contact.address)
        if req.challenge:
            resp.proof.CopyFrom(make_proof(self.identity, req.challenge))
        return resp
