"""An in-memory network for the simulator: unary calls between hosts of one trio run, in
virtual time (trio's MockClock), with per-link latency, loss, dead hosts, partitions and hosts
nobody can dial (NAT).

The bytes are the real bytes: a call's request is serialised and signed by the caller's
identity exactly as `RpcClient.unary` signs it, the callee verifies the signature, recipient
and replay window with a real `ReplayGuard`, runs the service's own handler with the same
`CallContext` gRPC would give it, and the answer is serialised back. What is left out, and
why: the per-frame authentication tags (GMAC) of tensor streams and the bulk plane's
socket protocol (tensor calls carry the real frames, header signed, through the real
`iter_frames`/`assemble`); receive budgets (a simulated stranger's flood is a scenario of its
own). Rate limits are the server's own (`RateLimiter` on virtual time, the address's bucket
before the signature is checked and the peer's after, as `RpcServer` does), and a refused
caller waits out the refusal's named wait and calls again (`rpc.paced`), as `RpcClient` does:
a simulated run meets the limits a daemon would.

Bandwidth: each host has an uplink and a downlink; a transfer occupies the sender's uplink and
the receiver's downlink for ``nbytes / min(up, down)`` seconds, first come first served.

A dead or unreachable host does not answer (a call waits out its deadline, as a dial to a
vanished home router does); a lost message fails its call after the one-way delay.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import trio
from google.protobuf.message import DecodeError, Message

from swarmd.node.sim.host import Host as Host
from swarmd.node.sim.host import current_host as current_host
from swarmd.node.sim.host import on_host
from swarmd.node.sim.netconfig import NetworkConfig as NetworkConfig
from swarmd.protocol import rpc
from swarmd.protocol.calls import M
from swarmd.protocol.errors import FramingError, ProtocolError
from swarmd.protocol.framing import (
    DEFAULT_CHUNK_BYTES,
    Payload,
    TensorMeta,
    assemble,
    iter_frames,
    payload_segments,
)
from swarmd.protocol.identity import Identity, PeerId, ReplayGuard, SignedHeader

#: A simulated run's wall clock starts here (seconds since the epoch), so that record expiry and
#: request timestamps read like today's, whatever the machine's clock says.
SIM_EPOCH_S = 1.8e9

T = TypeVar("T")


class SimNetwork:
    """Hosts on one virtual network. Addresses are A.B.C.1:4000 from 10.0.1.1, in order."""

    def __init__(self, config: NetworkConfig | None = None, seed: int = 0) -> None:
        self.config = config or NetworkConfig()
        self.seed = seed
        self.rng = random.Random(seed)
        self.hosts: dict[str, Host] = {}
        #: Partition sides: a call between hosts on different sides is not delivered.
        self._side: dict[str, int] = {}
        #: Called with (caller, callee, method path) as each call is made.
        self.watchers: list[Callable[[str, str, str], None]] = []
        #: Cut sides (`cut`): calls between two of them are not delivered.
        self._cut: dict[str, int] = {}
        self.calls = 0
        #: Calls a host's rate limit refused (each made again after its wait, in time).
        self.limited = 0
        #: Digest of every call delivered (virtual time, caller, callee, method, size): two runs
        #: of one seed must end with the same one.
        self.trace = hashlib.blake2b(digest_size=16)

    def wall(self, host: Host | None = None) -> float:
        """The simulated wall clock (record expiry, request timestamps), as ``host`` reads
        it (its skew added; None: the true time)."""
        return SIM_EPOCH_S + trio.current_time() + (host.skew_s if host is not None else 0.0)

    def _uniform(self, label: str) -> float:
        """A draw from [0, 1) fixed by the seed and ``label`` (a link, a host's clock), the
        same on every run of the seed whatever order the draws are made in."""
        digest = hashlib.blake2b(f"{self.seed}|{label}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64

    def _skew(self, address: str) -> float:
        span = self.config.clock_skew_s
        return span * (2 * self._uniform(f"{address}|skew") - 1) if span else 0.0

    def add_host(self, identity: Identity, *, dialable: bool = True) -> Host:
        """A new machine on the network; it serves nothing until `serve`."""
        n = len(self.hosts) + 1
        # Each host in its own /24, as volunteers' home routers are: the routing table limits
        # contacts per subnet, and a shared one would distort every figure.
        address = f"{10 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}.1:4000"
        guard = ReplayGuard(clock=lambda: self.wall(self.hosts[address]), own=identity.peer_id)
        cfg = self.config
        host = Host(
            address,
            identity,
            guard,
            dialable=dialable,
            up_bytes_s=cfg.up_bytes_s,
            down_bytes_s=cfg.down_bytes_s,
            skew_s=self._skew(address),
            limiter=rpc.RateLimiter(cfg.rate_limits, clock=trio.current_time),
        )
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

    def client(self, host: Host) -> SimTensorClient:
        return SimTensorClient(self, host)

    def kill(self, address: str) -> None:
        self.hosts[address].up = False

    def pause(self, address: str) -> None:
        """As SIGSTOP: the host stops talking and computing. Its calls out and the answers to
        them wait, calls to it wait before its handler runs (a stopped process's kernel holds
        their bytes), each within its caller's deadline, and its peer's inner steps wait; all
        go on at `resume`. Unlike a stopped process, its own timers still fire meanwhile (a
        stopped one's fire at SIGCONT): a round it was in may end on its deadlines, alone."""
        host = self.hosts[address]
        if host.resume is None:
            host.resume = trio.Event()

    def resume(self, address: str) -> None:
        """As SIGCONT: what the paused host was doing goes on."""
        host = self.hosts[address]
        event, host.resume = host.resume, None
        if event is not None:
            event.set()

    def partition(self, sides: Iterable[Iterable[str]]) -> None:
        """Cuts the network into ``sides`` (addresses); hosts on no side are on side 0."""
        self._side = {a: i + 1 for i, side in enumerate(sides) for a in side}

    def cut(self, sides: Iterable[Iterable[str]]) -> None:
        """Cuts calls between ``sides`` (addresses) only: hosts on no side still reach and
        are reached by every host (a bootstrap node both halves of a split can see)."""
        self._cut = {a: i for i, side in enumerate(sides) for a in side}

    def heal(self) -> None:
        self._side = {}
        self._cut = {}

    def rtt(self, a: str, b: str) -> float:
        """The link's round trip, the same both ways and on every run of this seed."""
        lo, hi = sorted((a, b))
        u = self._uniform(f"{lo}|{hi}")
        cfg = self.config
        return math.exp(math.log(cfg.rtt_min_s) + u * math.log(cfg.rtt_max_s / cfg.rtt_min_s))

    def same_side(self, a: str, b: str) -> bool:
        if self._side.get(a, 0) != self._side.get(b, 0):
            return False
        cut_a, cut_b = self._cut.get(a), self._cut.get(b)
        return cut_a is None or cut_b is None or cut_a == cut_b

    def reachable(self, src: str, dst: str) -> bool:
        """Whether a call from ``src`` reaches ``dst``: up, dialable, same side."""
        host = self.hosts.get(dst)
        return host is not None and host.up and host.dialable and self.same_side(src, dst)

    async def transfer(
        self, src: Host, dst: Host, nbytes: int, *, after: float = 0.0, latency: float = 0.0
    ) -> None:
        """Waits while ``nbytes`` cross from ``src`` to ``dst`` behind earlier transfers.

        Each uplink and each downlink sends one transfer at a time, in order of arrival: the
        bytes leave when the sender's uplink is free and arrive once the receiver's downlink
        has taken them, no sooner than they left. A transfer waiting for a busy receiver does
        not hold its sender's uplink meanwhile (one reservation of both links idled the
        uplink of a trainer calling many servers: a SWARM run of 40 servers computed half the
        time it could, all of it waiting on links that sent nothing).

        ``after``: the bytes are ready to leave that much later (a request still on its way);
        ``latency``: they arrive that much after the receiver took them (propagation). The
        links are booked now, in order of booking: one wait instead of three (the SWARM
        simulation's scheduler spent a third of its time on the sleeps of its calls)."""
        now = trio.current_time()
        start = max(now + after, src.up_free)
        sent = start + nbytes / src.up_bytes_s
        src.up_free = sent
        end = max(max(start, dst.down_free) + nbytes / dst.down_bytes_s, sent)
        dst.down_free = end
        src.sent_bytes += nbytes
        dst.received_bytes += nbytes
        await trio.sleep(end + latency - now)

    def record(self, src: str, dst: str, path: str, nbytes: int) -> None:
        """Counts a call and adds it to the run's trace (its `log_hash`); tells the watchers
        (a fault that strikes at a given call: a peer killed as it sends its first part)."""
        for watch in self.watchers:
            watch(src, dst, path)
        self.calls += 1
        self.trace.update(f"{trio.current_time():.9f}|{src}|{dst}|{path}|{nbytes}\n".encode())

    def lost(self) -> bool:
        return self.config.loss > 0 and self.rng.random() < self.config.loss


class SimClient:
    """`rpc.UnaryCaller` over a SimNetwork: what one host's RpcClient would do."""

    def __init__(self, network: SimNetwork, host: Host) -> None:
        self.network = network
        self.host = host
        #: Who this client speaks as (RpcClient's attribute: a reducer signs its proofs).
        self.identity: Identity | None = host.identity
        #: How a refusal by a rate limit is met (RpcClient's defaults).
        self.transport = rpc.TransportConfig()
        #: RpcClient's: tags each request with the run's access proof (access.py).
        self.access_tag: Callable[[str, bytes], bytes] | None = None

    def close(self) -> None:
        """RpcClient's: nothing is held open here."""

    def _sign(self, path: str, body: bytes, recipient: PeerId) -> SignedHeader:
        """The request's signed header, as RpcClient makes it (with the access tag)."""
        signed = self.host.identity.sign_request(
            path, body, recipient=recipient, now=self.network.wall(self.host)
        )
        if self.access_tag is not None and (tag := self.access_tag(path, signed.signature)):
            signed = dataclasses.replace(signed, access=tag)
        return signed

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
        body = request.SerializeToString()
        raw = await self._paced(timeout, lambda: self._deliver(address, path, body, recipient))
        try:
            return response_type.FromString(raw)
        except DecodeError as exc:
            raise rpc.RpcError(rpc.StatusCode.INTERNAL, f"bad response: {exc}") from None

    async def _paced(self, timeout: float | None, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` within the call's one deadline (the network's default if None), made
        again after each wait a rate limit names, as RpcClient's calls are (`rpc.paced`)."""
        deadline = self.network.config.default_deadline_s if timeout is None else timeout
        if deadline <= 0:
            raise rpc.RpcError(rpc.StatusCode.DEADLINE_EXCEEDED, "no time left for the call")

        async def once(left: float) -> T:
            try:
                with trio.fail_after(left):
                    return await call()
            except trio.TooSlowError:
                raise rpc.RpcError(rpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None

        return await rpc.paced(deadline, self.transport, once)

    async def _deliver(
        self, address: str, path: str, body: bytes, recipient: PeerId | None
    ) -> bytes:
        net, me = self.network, self.host
        if not me.up:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "this host is down")
        await me.unpaused()
        one_way = net.rtt(me.address, address) / 2
        if not net.reachable(me.address, address):
            await trio.sleep_forever()  # nobody answers: the caller's deadline ends it
        host = net.hosts[address]
        if recipient is None:
            # RpcClient first asks who listens there (its signed hello, cached per address).
            recipient = host.identity.peer_id
        signed = self._sign(path, body, recipient)
        net.record(me.address, address, path, len(body))
        me.sent_bytes += len(body) + len(signed.signature) + len(path)
        await trio.sleep(one_way)
        if not net.reachable(me.address, address):
            await trio.sleep_forever()
        if net.lost():
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "simulated loss: connection lost")
        if not host.listening:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "connection refused")
        host.received_bytes += len(body)
        await host.unpaused()
        raw = await _serve(net, host, me.address, path, body, signed)
        await trio.sleep(one_way)
        if not (me.up and net.same_side(address, me.address)):
            await trio.sleep_forever()  # the answer never arrives
        await me.unpaused()
        me.received_bytes += len(raw)
        host.sent_bytes += len(raw)
        return raw


class SimTensorClient(SimClient):
    """SimClient with RpcClient's tensor calls: the real frames (`iter_frames` and
    `assemble`), the header or request signed and verified, the bytes charged to both hosts'
    links."""

    chunk_bytes = DEFAULT_CHUNK_BYTES

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
        segments = payload_segments(payload)
        if sum(v.nbytes for v in segments) != meta.nbytes:
            raise FramingError(f"payload does not match its header's {meta.nbytes} B")
        frames = list(iter_frames(meta, segments, self.chunk_bytes))
        raw = await self._paced(
            timeout,
            lambda: self._tensor_once(address, path, frames[0], expect, "in", frames, None),
        )
        assert isinstance(raw, bytes)
        try:
            return response_type.FromString(raw)
        except DecodeError as exc:
            raise rpc.RpcError(rpc.StatusCode.INTERNAL, f"bad response: {exc}") from None

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
        body = request.SerializeToString()
        got = await self._paced(
            timeout, lambda: self._tensor_once(address, path, body, expect, "out", [], max_bytes)
        )
        assert isinstance(got, tuple)
        return got

    async def _tensor_once(
        self,
        address: str,
        path: str,
        signed_bytes: bytes,
        expect: PeerId | None,
        kind: str,
        frames: list[bytes],
        max_bytes: int | None,
    ) -> bytes | tuple[TensorMeta, bytearray]:
        net, me = self.network, self.host
        if not me.up or not net.reachable(me.address, address):
            await trio.sleep_forever()
        await me.unpaused()
        host = net.hosts[address]
        signed = self._sign(path, signed_bytes, expect or host.identity.peer_id)
        net.record(me.address, address, path, sum(map(len, frames)) or len(signed_bytes))
        one_way = net.rtt(me.address, address) / 2
        await trio.sleep(one_way)
        if net.lost():
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "simulated loss")
        if not host.listening:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "connection refused")
        await host.unpaused()
        ctx = _authenticate(net, host, me.address, path, signed_bytes, signed)
        method = host.methods.get(path)
        if method is None or method.kind != f"tensor_{kind}":
            raise rpc.RpcError(rpc.StatusCode.UNIMPLEMENTED, f"no tensor method {path}")
        if kind == "in":
            await net.transfer(me, host, sum(map(len, frames)))
            meta, data = assemble(frames, 2 << 30)
            with on_host(host):
                if method.admit is not None:
                    await method.admit(meta, ctx)
                response: Message = await method.handler(meta, data, ctx)
            await trio.sleep(one_way)
            await me.unpaused()
            return response.SerializeToString()
        assert method.request_type is not None
        request = method.request_type.FromString(signed_bytes)
        with on_host(host):
            meta, payload = await method.handler(request, ctx)
        out = list(iter_frames(meta, payload_segments(payload), self.chunk_bytes))
        await trio.sleep(one_way)
        await net.transfer(host, me, sum(map(len, out)))
        await me.unpaused()
        limit = (2 << 30) if max_bytes is None else max_bytes
        return assemble(out, limit)


def _authenticate(
    net: SimNetwork, host: Host, caller: str, path: str, body: bytes, signed: SignedHeader
) -> rpc.CallContext:
    """What RpcServer checks before a handler runs: the address's rate limit, signature,
    recipient, replay, the peer's rate limit, gate."""
    peer = f"ipv4:{caller}"
    _check_rate(net, "address", host.limiter.address_wait(peer))
    try:
        peer_id = host.guard.verify(path, signed, body)
    except ProtocolError as exc:
        raise rpc.RpcError(rpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
    _check_rate(net, "peer", host.limiter.peer_wait(str(peer_id)))
    ctx = rpc.CallContext(path, peer_id, peer, signed.signature, signed.access)
    gate = host.gates.get(path)
    if gate is not None:
        gate(ctx)
    return ctx


def _check_rate(net: SimNetwork, scope: str, wait: float) -> None:
    if wait:
        net.limited += 1
        raise rpc.rate_limited(scope, wait)


async def _serve(
    net: SimNetwork, host: Host, caller: str, path: str, body: bytes, signed: SignedHeader
) -> bytes:
    """The callee's side of a unary call: authenticate as RpcServer does, run the handler."""
    ctx = _authenticate(net, host, caller, path, body, signed)
    method = host.methods.get(path)
    if method is None or method.kind != "unary" or method.request_type is None:
        raise rpc.RpcError(rpc.StatusCode.UNIMPLEMENTED, f"no unary method {path}")
    try:
        request = method.request_type.FromString(body)
    except DecodeError as exc:
        raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}") from None
    with on_host(host):
        response: Message = await method.handler(request, ctx)
    return response.SerializeToString()
