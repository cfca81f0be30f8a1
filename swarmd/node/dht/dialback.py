"""Reachability checks (issue 27): "can others dial me?", answered by dialling back.

A peer behind a home router can call out but nobody can call in, and it cannot tell from
inside: its own address is a private one either way. So on join it asks DHT nodes it already
reaches to dial it back (``DialBack``) on the ports it listens on, and takes client mode when
they cannot.

A dial-back must not become a way to make DHT nodes dial arbitrary addresses for a stranger:
the callee dials only the IP the call came from (never an address the caller names), checks
that the caller's own key answers there (the DHT ping's challenge), and answers each peer id
once per ``per_peer_s`` and each source address ``per_address`` times per ``window_s``, with
at most ``concurrent`` dials at a time. What a caller can make a node do is therefore one
ping and one TCP connect to its own address, a few times a minute (on an address it shares
with others, as behind carrier-grade NAT, that address's open ports are what it learns).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import trio

from swarmd.node.dht.caller import SERVICE, Caller
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.address import Address, IPAddress, address_key, peer_ip
from swarmd.protocol.errors import ProtocolError

log = logging.getLogger("swarmd.reachability")

DIAL_BACK = rpc.method_path(SERVICE, "DialBack")

Verdict = Literal["reachable", "unreachable", "unknown"]


@dataclass(frozen=True)
class DialBackLimits:
    #: One check per peer id per this many seconds (a restarted peer asks again after it).
    per_peer_s: float = 10.0
    #: Checks per source address per window (several volunteers may share one home IP).
    per_address: int = 16
    window_s: float = 60.0
    concurrent: int = 8
    #: How long each dial (the ping, the TCP connect) may take.
    dial_timeout_s: float = 5.0
    #: Callers remembered for the limits (oldest forgotten first).
    remembered: int = 4096

    def __post_init__(self) -> None:
        if not (self.per_peer_s >= 0 and self.window_s > 0 and self.dial_timeout_s > 0):
            raise ValueError("DialBackLimits needs per_peer_s >= 0, window_s > 0, timeout > 0")
        if self.per_address < 1 or self.concurrent < 1 or self.remembered < 1:
            raise ValueError("DialBackLimits needs per_address, concurrent, remembered >= 1")


class DialBacker:
    """The callee's side: the ``DialBack`` handler a DHT node serves."""

    def __init__(self, caller: Caller, limits: DialBackLimits | None = None) -> None:
        self._caller = caller
        self.limits = limits or DialBackLimits()
        self._by_peer: OrderedDict[str, float] = OrderedDict()
        self._by_address: OrderedDict[str, list[float]] = OrderedDict()
        self._slots = trio.CapacityLimiter(self.limits.concurrent)

    def _admit(self, peer: str, address: str) -> None:
        lim, now = self.limits, time.monotonic()
        last = self._by_peer.get(peer)
        if last is not None and now - last < lim.per_peer_s:
            raise rpc.RpcError(
                rpc.StatusCode.RESOURCE_EXHAUSTED,
                f"one reachability check per {lim.per_peer_s:g} s per peer",
            )
        recent = [t for t in self._by_address.get(address, []) if now - t < lim.window_s]
        if len(recent) >= lim.per_address:
            raise rpc.RpcError(
                rpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{lim.per_address} reachability checks per {lim.window_s:g} s per address",
            )
        self._by_peer[peer] = now
        self._by_peer.move_to_end(peer)
        self._by_address[address] = [*recent, now]
        self._by_address.move_to_end(address)
        for table in (self._by_peer, self._by_address):
            while len(table) > lim.remembered:
                table.popitem(last=False)

    async def handle(self, req: pb.DialBackRequest, ctx: rpc.CallContext) -> pb.DialBackResponse:
        ip = peer_ip(ctx.peer)
        if ctx.peer_id is None or ip is None:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "an unsigned or non-IP call")
        if not 0 < req.port <= 65535 or req.bulk_port > 65535:
            raise rpc.RpcError(rpc.StatusCode.INVALID_ARGUMENT, "ports must be 1..65535")
        self._admit(str(ctx.peer_id), address_key(ctx.peer))
        ip = _local_alias(ip, req.host)
        timeout = self.limits.dial_timeout_s
        resp = pb.DialBackResponse(observed=str(Address(str(ip), req.port)))
        details: list[str] = []
        async with self._slots:
            try:
                await self._caller.ping(
                    resp.observed, ctx.peer_id, timeout=timeout, record_failure=False
                )
                resp.reachable = True
            except (rpc.RpcError, ProtocolError, OSError) as exc:
                details.append(f"gRPC port: {exc}")
            if req.bulk_port:
                with trio.move_on_after(timeout) as scope:
                    try:
                        stream = await trio.open_tcp_stream(str(ip), req.bulk_port)
                        await stream.aclose()
                        resp.bulk_reachable = True
                    except OSError as exc:
                        details.append(f"bulk port: {exc}")
                if scope.cancelled_caught:
                    details.append(f"bulk port: no answer in {timeout:g} s")
        resp.detail = "; ".join(details)[:400]
        return resp


def _local_alias(source: IPAddress, host: str) -> IPAddress:
    """The address to dial: the call's source, except that a caller on this machine (a
    loopback source) may name another loopback address it listens on. Processes on 127.0.0.x
    call out from 127.0.0.1 (seen: every `swarmd chaos` peer judged itself unreachable and
    trained alone); a loopback address reaches only this machine, where the caller already is.
    """
    if not source.is_loopback or not host:
        return source
    try:
        named = ipaddress.ip_address(host)
    except ValueError:
        return source
    return named if named.is_loopback else source


@dataclass(frozen=True)
class Reachability:
    """What the dial-backs said."""

    verdict: Verdict
    #: HOST:PORT as the nodes saw this peer's calls come from ("" if nobody answered).
    observed: str = ""
    detail: str = ""

    @property
    def client_mode(self) -> bool:
        return self.verdict == "unreachable"


async def check_reachability(
    client: rpc.UnaryCaller,
    nodes: Sequence[str],
    port: int,
    bulk_port: int = 0,
    *,
    host: str = "",
    timeout: float = 15.0,
    asked: int = 3,
    retry_s: float = DialBackLimits.per_peer_s + 1.0,
) -> Reachability:
    """Asks up to `asked` of `nodes` (HOST:PORT of DHT nodes) to dial this peer back.
    Reachable when more than half of the answers got through on every port (one node on the
    same LAN gets through where the internet does not; a false "reachable" costs the run far
    more than a false "unreachable": every part this peer was given would wait out a
    deadline, every round); unreachable otherwise; unknown when none answered (then nothing
    is known, and the caller keeps its default). Refused for rate (a restart within
    `per_peer_s`): asked once more after `retry_s`."""
    answers: list[pb.DialBackResponse] = []
    errors: list[str] = []
    limited: list[str] = []
    req = pb.DialBackRequest(port=port, bulk_port=bulk_port, host=host)

    async def ask(node: str) -> None:
        try:
            answers.append(
                await client.unary(node, DIAL_BACK, req, pb.DialBackResponse, timeout=timeout)
            )
        except (rpc.RpcError, ProtocolError, OSError) as exc:
            if isinstance(exc, rpc.RpcError) and exc.code == rpc.StatusCode.RESOURCE_EXHAUSTED:
                limited.append(node)
            errors.append(f"{node}: {exc}")

    async def ask_all(targets: Sequence[str]) -> None:
        async with trio.open_nursery() as nursery:
            for node in targets:
                nursery.start_soon(ask, node)

    await ask_all(list(dict.fromkeys(nodes))[:asked])
    if not answers and limited:
        log.info("reachability check refused for rate; asking again in %.0f s", retry_s)
        await trio.sleep(retry_s)
        retry, errors[:], limited[:] = list(limited), [], []
        await ask_all(retry)
    if not answers:
        return Reachability("unknown", detail="; ".join(errors) or "no DHT node to ask")
    through = [a for a in answers if a.reachable and (a.bulk_reachable or not bulk_port)]
    if 2 * len(through) > len(answers):
        return Reachability("reachable", through[0].observed)
    failed = next(a for a in answers if a not in through)
    return Reachability("unreachable", failed.observed, failed.detail)


async def reachability_of(
    setting: str,
    client: rpc.UnaryCaller,
    nodes: Sequence[str],
    port: int,
    bulk_port: int = 0,
    host: str = "",
) -> Reachability:
    """What a joining peer takes itself to be: `setting` is --reachable (auto, yes, no). With
    auto and nobody to ask (the first peer of a swarm) or nobody answering, it stays
    reachable, as every peer was before the check existed."""
    if setting == "yes":
        return Reachability("reachable", detail="--reachable yes")
    if setting == "no":
        return Reachability("unreachable", detail="--reachable no")
    if not nodes:
        return Reachability("unknown", detail="no bootstrap peer to ask")
    found = await check_reachability(client, nodes, port, bulk_port, host=host)
    if found.verdict == "unknown":
        log.warning("could not check whether others can dial this peer: %s", found.detail)
    return found
