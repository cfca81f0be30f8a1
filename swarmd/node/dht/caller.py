"""Outgoing DHT calls: deadlines from measured round trips, peer-id proofs, failure marking.

Each call's timeout adapts to the round trips this node measures (an EWMA, the way TCP sets
its retransmission timer), so nobody hand-tunes timeouts for their network, and a dead peer
costs a few round trips rather than a fixed second.

A response is not authenticated by the transport (only requests are signed), so a peer's
claim to be a given peer id at a given address is checked once with a challenge: the callee
signs our random nonce. Until that succeeds the contact never enters the routing table, which
keeps forged ids (chosen to sit next to a key) out of it.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio
from google.protobuf.message import Message

from swarmd.node.dht.routing import RoutingTable
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import Identity, PeerId, verify_signature

SERVICE = "swarmd.dht.v1.DHT"
PING = rpc.method_path(SERVICE, "Ping")
STORE = rpc.method_path(SERVICE, "Store")
FIND = rpc.method_path(SERVICE, "Find")

_PROOF_DOMAIN = b"swarmd/dht-proof/v1\0"
CHALLENGE_BYTES = 16

R = TypeVar("R", bound=Message)


def proof_message(challenge: bytes) -> bytes:
    return _PROOF_DOMAIN + challenge


def make_proof(identity: Identity, challenge: bytes) -> pb.Proof:
    signature = identity.sign(proof_message(challenge))
    return pb.Proof(public_key=identity.public_key, signature=signature)


def check_proof(proof: pb.Proof, challenge: bytes, claimed: PeerId | None) -> PeerId:
    """The proven peer id; raises ProtocolError if the proof is missing, forged or mismatched."""
    if not proof.public_key or not verify_signature(
        proof.public_key, proof.signature, proof_message(challenge)
    ):
        raise ProtocolError("peer did not prove its identity")
    proven = PeerId.from_public_key(proof.public_key)
    if claimed is not None and proven != claimed:
        raise ProtocolError(f"peer at this address is {proven.short()}, not {claimed.short()}")
    return proven


@dataclass(frozen=True)
class TimeoutPolicy:
    """Per-call timeout = clamp(multiplier × smoothed RTT, min_s, max_s)."""

    min_s: float = 0.25
    max_s: float = 3.0
    multiplier: float = 4.0
    #: Weight of a new sample in the moving average.
    alpha: float = 0.125
    #: RTT assumed before anything has been measured.
    initial_s: float = 0.05
    #: The least timeout of a call to a node this one has no round trip of yet (RFC 6298's
    #: initial RTO): the node-wide estimate is an average over links of 10-300 ms, and a
    #: node at the far end timed out under it, was evicted and barred, and missed every
    #: store and republish while barred (the simulator: 1 of 7 replicas, seed 2).
    unmeasured_s: float = 1.0
    #: Nodes whose own round-trip estimate is kept (least recently used dropped).
    per_node: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError("TimeoutPolicy needs 0 < min_s <= max_s")
        if self.multiplier < 1 or not 0 < self.alpha <= 1 or self.initial_s <= 0:
            raise ValueError("TimeoutPolicy: multiplier >= 1, 0 < alpha <= 1, initial_s > 0")
        if not 0 < self.unmeasured_s <= self.max_s or self.per_node < 1:
            raise ValueError("TimeoutPolicy: 0 < unmeasured_s <= max_s, per_node >= 1")


class RttEstimator:
    """Smoothed RTT and its mean deviation (Jacobson/Karels, as TCP's RTO): a timeout from the
    mean alone fires on every load spike, which on a busy machine dropped live nodes from
    lookups (a store reached 14 of 20 replicas in CI); the deviation term widens it exactly
    when round trips become erratic, and shrinks back when they settle."""

    def __init__(self, policy: TimeoutPolicy, first: float | None = None) -> None:
        self.policy = policy
        # RFC 6298: the first measurement R sets SRTT = R and RTTVAR = R/2.
        self.srtt = policy.initial_s if first is None else first
        self.rttvar = self.srtt / 2

    def sample(self, rtt: float) -> None:
        a = self.policy.alpha
        self.rttvar += (a * 2) * (abs(rtt - self.srtt) - self.rttvar)
        self.srtt += a * (rtt - self.srtt)

    def timeout(self) -> float:
        p = self.policy
        wanted = max(p.multiplier * self.srtt, self.srtt + 4 * self.rttvar)
        return min(p.max_s, max(p.min_s, wanted))

    def stall(self) -> float:
        """How long a lookup waits on one reply before it asks another node in parallel."""
        return min(self.timeout(), max(0.005, 2.0 * self.srtt))


class Caller:
    """Wraps the daemon's RpcClient for DHT calls; keeps the routing table up to date."""

    def __init__(
        self,
        identity: Identity,
        client: rpc.UnaryCaller,
        table: RoutingTable,
        policy: TimeoutPolicy,
    ) -> None:
        self.identity = identity
        self.client = client
        self.table = table
        #: This node's round trips to anyone: what a lookup's stall timer waits.
        self.rtt = RttEstimator(policy)
        #: Each node's own round trips (a link's RTT, not the average over links): what a
        #: call's timeout is made of.
        self._rtts: OrderedDict[PeerId, RttEstimator] = OrderedDict()
        #: The port we listen on, told to callees; 0 = not reachable (client-only node).
        self.port = 0
        self._verified: OrderedDict[tuple[PeerId, str], None] = OrderedDict()

    def is_verified(self, peer_id: PeerId, address: str) -> bool:
        return (peer_id, address) in self._verified

    def _mark_verified(self, peer_id: PeerId, address: str) -> None:
        self._verified[(peer_id, address)] = None
        self._verified.move_to_end((peer_id, address))
        while len(self._verified) > 4096:
            self._verified.popitem(last=False)

    async def _call(
        self,
        address: str,
        path: str,
        request: Message,
        response_type: type[R],
        *,
        peer_id: PeerId | None,
        timeout: float | None = None,
    ) -> R:
        start = trio.current_time()
        response = await self.client.unary(
            address, path, request, response_type,
            timeout=self.timeout(peer_id) if timeout is None else timeout,
            recipient=peer_id,  # known: no need to ask the server who it is first
        )  # fmt: skip
        # An answer is a measurement even under a longer deadline: the bootstrap ping's is the
        # first one, and without it the join's self-lookup ran on the initial estimate (its
        # slow stall timer left some nodes of a 64-node swarm with 5 contacts instead of 10+).
        rtt = trio.current_time() - start
        self.rtt.sample(rtt)
        if peer_id is not None:
            own = self._rtts.get(peer_id)
            if own is None:
                own = self._rtts[peer_id] = RttEstimator(self.rtt.policy, first=rtt)
                while len(self._rtts) > self.rtt.policy.per_node:
                    self._rtts.popitem(last=False)
            else:
                own.sample(rtt)
                self._rtts.move_to_end(peer_id)
        return response

    def timeout(self, peer_id: PeerId | None) -> float:
        """A call's deadline: from the node's own round trips once measured, else the larger
        of the node-wide estimate's and `unmeasured_s`."""
        own = self._rtts.get(peer_id) if peer_id is not None else None
        if own is not None:
            return own.timeout()
        return max(self.rtt.timeout(), self.rtt.policy.unmeasured_s)

    def _accept(
        self,
        address: str,
        claimed: PeerId | None,
        peer_id_raw: bytes,
        proof: pb.Proof,
        challenge: bytes,
    ) -> PeerId:
        """Checks who answered; enters it into the routing table. Raises ProtocolError."""
        if challenge:
            peer_id = check_proof(proof, challenge, claimed)
            self._mark_verified(peer_id, address)
        else:
            assert claimed is not None
            if peer_id_raw != claimed.raw:
                raise ProtocolError(f"peer at {address} changed its identity")
            peer_id = claimed
        self.table.seen(peer_id, address)
        return peer_id

    def _challenge(self, peer_id: PeerId | None, address: str) -> bytes:
        if peer_id is not None and self.is_verified(peer_id, address):
            return b""
        return secrets.token_bytes(CHALLENGE_BYTES)

    def _failed(self, peer_id: PeerId | None) -> None:
        if peer_id is not None:
            self.table.failed(peer_id)

    async def ping(
        self,
        address: str,
        peer_id: PeerId | None = None,
        *,
        timeout: float | None = None,
        record_failure: bool = True,
    ) -> PeerId:
        """Pings ``address`` (whose peer id may be unknown, e.g. a bootstrap peer). ``timeout``
        overrides the round-trip-based deadline. ``record_failure=False``: a failure says
        nothing about the peer itself (an address only claimed, admission.py), so it is not
        held against the peer's routing-table entry."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        req = pb.PingRequest(sender_port=self.port, challenge=challenge)
        try:
            resp = await self._call(
                address, PING, req, pb.PingResponse, peer_id=peer_id, timeout=timeout
            )
            return self._accept(address, peer_id, resp.peer_id, resp.proof, challenge)
        except (rpc.RpcError, ProtocolError):
            if record_failure:
                self._failed(peer_id)
            raise

    async def find(
        self,
        peer_id: PeerId,
        address: str,
        targets: list[bytes],
        keys: list[bytes],
        known: Sequence[bytes] = (),
        *,
        nodes_only_if_empty: bool = False,
    ) -> pb.FindResponse:
        challenge = self._challenge(peer_id, address)
        req = pb.FindRequest(
            sender_port=self.port,
            targets=targets,
            keys=keys,
            challenge=challenge,
            known=known,
            nodes_only_if_empty=nodes_only_if_empty,
        )
        try:
            resp = await self._call(address, FIND, req, pb.FindResponse, peer_id=peer_id)
            self._accept(address, peer_id, resp.peer_id, resp.proof, challenge)
            if len(resp.results) != len(targets):
                raise ProtocolError(f"{address} answered {len(resp.results)} of {len(targets)}")
        except (rpc.RpcError, ProtocolError):
            self._failed(peer_id)
            raise
        return resp

    async def store(
        self, peer_id: PeerId, address: str, records: list[pb.Record]
    ) -> pb.StoreResponse:
        req = pb.StoreRequest(sender_port=self.port, records=records)
        try:
            # Stores go out k at a time and verify signatures on arrival: they take longer than
            # a find and nobody waits on them interactively, so they get the longest timeout
            # and stay out of the round-trip estimate that paces lookups.
            resp = await self._call(
                address,
                STORE,
                req,
                pb.StoreResponse,
                peer_id=peer_id,
                timeout=self.rtt.policy.max_s,
            )
            if len(resp.outcomes) != len(records):
                raise ProtocolError(f"{address} answered {len(resp.outcomes)} of {len(records)}")
            if self.is_verified(peer_id, address):
                self.table.seen(peer_id, address)
        except (rpc.RpcError, ProtocolError):
            self._failed(peer_id)
            raise
        return resp
