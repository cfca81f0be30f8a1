"""An in-memory network for the simulator: unary calls between hosts of one trio run, in
virtual time (trio's MockClock), with per-link latency, loss, dead hosts, partitions and hosts
nobody can dial (NAT).

The bytes are the real bytes: a call's request is serialised and signed by the caller's
identity exactly as `RpcClient.unary` signs it, the callee verifies the signature, recipient
and replay window with a real `ReplayGuard`, runs the service's own handler with the same
`CallContext` gRPC would give it, and the answer is serialised back. What is left out, and
why: gRPC's framing and the bulk data plane (a later step brings tensor calls onto this
network); rate limits (a simulated stranger's flood is a scenario of its own).

A dead or unreachable host does not answer (a call waits out its deadline, as a dial to a
vanished home router does); a lost message fails its call after the one-way delay.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import trio
from google.protobuf.message import DecodeError, Message

from swarmd.protocol import rpc
from swarmd.protocol.calls import M
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import Identity, PeerId, ReplayGuard, SignedHeader

#: A simulated run's wall clock starts here (seconds since the epoch), so that record expiry and
#: request timestamps read like today's, whatever the machine's clock says.
SIM_EPOCH_S = 1.8e9


@dataclass(frozen=True)
class NetworkConfig:
    """The network model: every link's round-trip time is drawn once per (pair, seed) from a
    log-uniform distribution between ``rtt_min_s`` and ``rtt_max_s`` (the spread of home links
    across continents); each message is lost with probability ``loss``."""

    rtt_min_s: float = 0.010
    rtt_max_s: float = 0.300
    loss: float = 0.0
    #: The longest a call waits when no deadline is given (RpcClient's default).
    default_deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.rtt_min_s <= self.rtt_max_s:
            raise ValueError("NetworkConfig needs 0 < rtt_min_s <= rtt_max_s")
        if not 0 <= self.loss < 1:
            raise ValueError("NetworkConfig.loss is a probability below 1")
        if not self.default_deadline_s > 0:
            raise ValueError("NetworkConfig.default_deadline_s must be positive")


@dataclass
class Host:
    """One simulated machine: who it is, what it serves, whether it is up."""

    address: str
    identity: Identity
    guard: ReplayGuard
    methods: dict[str, rpc.Method] = field(default_factory=dict)
    gates: dict[str, rpc.Gate] = field(default_factory=dict)
    up: bool = True
    #: Behind NAT: it can call out, nobody can call it.
    dialable: bool = True
    sent_bytes: int = 0
    received_bytes: int = 0


class SimNetwork:
    """Hosts on one virtual network. Addresses are A.B.C.1:4000 from 10.0.1.1, in order."""

    def __init__(self, config: NetworkConfig | None = None, seed: int = 0) -> None:
        self.config = config or NetworkConfig()
        self.seed = seed
        self.rng = random.Random(seed)
        self.hosts: dict[str, Host] = {}
        #: Partition sides: a call between hosts on different sides is not delivered.
        self._side: dict[str, int] = {}
        self.calls = 0
        #: Digest of every call delivered (virtual time, caller, callee, method, size): two runs
        #: of one seed must end with the same one.
        self.trace = hashlib.blake2b(digest_size=16)

    def wall(self) -> float:
        """The simulated wall clock (record expiry, request timestamps)."""
        return SIM_EPOCH_S + trio.current_time()

    def add_host(self, identity: Identity, *, dialable: bool = True) -> Host:
        """A new machine on the network; it serves nothing until `serve`."""
        n = len(self.hosts) + 1
        # Each host in its own /24, as volunteers' home routers are: the routing table limits
        # contacts per subnet, and a shared one would distort every figure.
        address = f"{10 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}.1:4000"
        guard = ReplayGuard(clock=self.wall, own=identity.peer_id)
        host = Host(address, identity, guard, dialable=dialable)
        self.hosts[address] = host
        return host

    @staticmethod
    def serve(host: Host, services: Sequence[rpc.Service]) -> None:
        """Adds ``services``' unary methods to what ``host`` answers."""
        for service in services:
            for method in service.methods:
                path = rpc.method_path(service.name, method.name)
                host.methods[path] = method
                if service.gate is not None:
                    host.gates[path] = service.gate

    def client(self, host: Host) -> SimClient:
        return SimClient(self, host)

    def kill(self, address: str) -> None:
        self.hosts[address].up = False

    def partition(self, sides: Iterable[Iterable[str]]) -> None:
        """Cuts the network into ``sides`` (addresses); hosts on no side are on side 0."""
        self._side = {a: i + 1 for i, side in enumerate(sides) for a in side}

    def heal(self) -> None:
        self._side = {}

    def rtt(self, a: str, b: str) -> float:
        """The link's round trip, the same both ways and on every run of this seed."""
        lo, hi = sorted((a, b))
        digest = hashlib.blake2b(f"{self.seed}|{lo}|{hi}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2.0**64
        cfg = self.config
        return math.exp(math.log(cfg.rtt_min_s) + u * math.log(cfg.rtt_max_s / cfg.rtt_min_s))

    def same_side(self, a: str, b: str) -> bool:
        return self._side.get(a, 0) == self._side.get(b, 0)

    def reachable(self, src: str, dst: str) -> bool:
        """Whether a call from ``src`` reaches ``dst``: up, dialable, same side."""
        host = self.hosts.get(dst)
        return host is not None and host.up and host.dialable and self.same_side(src, dst)

    def lost(self) -> bool:
        return self.config.loss > 0 and self.rng.random() < self.config.loss


class SimClient:
    """`rpc.UnaryCaller` over a SimNetwork: what one host's RpcClient would do."""

    def __init__(self, network: SimNetwork, host: Host) -> None:
        self.network = network
        self.host = host
        self.identity = host.identity

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
        net = self.network
        deadline = net.config.default_deadline_s if timeout is None else timeout
        if deadline <= 0:
            raise rpc.RpcError(rpc.StatusCode.DEADLINE_EXCEEDED, "no time left for the call")
        try:
            with trio.fail_after(deadline):
                raw = await self._deliver(address, path, request.SerializeToString(), recipient)
        except trio.TooSlowError:
            raise rpc.RpcError(rpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None
        try:
            return response_type.FromString(raw)
        except DecodeError as exc:
            raise rpc.RpcError(rpc.StatusCode.INTERNAL, f"bad response: {exc}") from None

    async def _deliver(
        self, address: str, path: str, body: bytes, recipient: PeerId | None
    ) -> bytes:
        net, me = self.network, self.host
        if not me.up:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "this host is down")
        one_way = net.rtt(me.address, address) / 2
        if not net.reachable(me.address, address):
            await trio.sleep_forever()  # nobody answers: the caller's deadline ends it
        host = net.hosts[address]
        if recipient is None:
            # RpcClient first asks who listens there (its signed hello, cached per address).
            recipient = host.identity.peer_id
        signed = me.identity.sign_request(path, body, recipient=recipient, now=net.wall())
        net.calls += 1
        net.trace.update(
            f"{trio.current_time():.9f}|{me.address}|{address}|{path}|{len(body)}\n".encode()
        )
        me.sent_bytes += len(body) + len(signed.signature) + len(path)
        await trio.sleep(one_way)
        if not net.reachable(me.address, address):
            await trio.sleep_forever()
        if net.lost():
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "simulated loss: connection lost")
        host.received_bytes += len(body)
        raw = await _serve(host, me.address, path, body, signed)
        await trio.sleep(one_way)
        if not (me.up and net.same_side(address, me.address)):
            await trio.sleep_forever()  # the answer never arrives
        me.received_bytes += len(raw)
        host.sent_bytes += len(raw)
        return raw


async def _serve(host: Host, caller: str, path: str, body: bytes, signed: SignedHeader) -> bytes:
    """The callee's side: authenticate as RpcServer does, then run the handler."""
    try:
        peer_id = host.guard.verify(path, signed, body)
    except ProtocolError as exc:
        raise rpc.RpcError(rpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
    ctx = rpc.CallContext(path, peer_id, f"ipv4:{caller}", signed.signature, signed.access)
    gate = host.gates.get(path)
    if gate is not None:
        gate(ctx)
    method = host.methods.get(path)
    if method is None or method.kind != "unary" or method.request_type is None:
        raise rpc.RpcError(rpc.StatusCode.UNIMPLEMENTED, f"no unary method {path}")
    try:
        request = method.request_type.FromString(body)
    except DecodeError as exc:
        raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}") from None
    response: Message = await method.handler(request, ctx)
    return response.SerializeToString()
