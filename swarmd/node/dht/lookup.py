"""Kademlia's iterative lookup: ask the closest known nodes for closer ones, α at a time.

The lookup keeps a shortlist of the k closest nodes it has heard of, keeps α requests in
flight to the closest it has not asked yet, and stops when the k closest have all answered
(a node lookup, for stores) or, for gets, as soon as records were found and either the
``quorum`` closest nodes have answered or ``quorum`` nodes returned records. Stores replicate
to the k closest nodes, so the nodes nearest the key hold its newest version.

Slow and dead nodes cost little: a node that fails is dropped from the shortlist (and evicted
from the routing table), and a reply that takes longer than twice the smoothed round trip
stops counting against α, so the lookup asks the next node instead of waiting for it. Once
the α closest nodes have answered, the rest of the k closest are asked at once (the paper's
final round). The whole lookup runs under one deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from swarmd.node.dht.caller import Caller
from swarmd.node.dht.ids import id_to_bytes, node_id
from swarmd.node.dht.records import Record, RecordError, RecordLimits, Verifier
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.address import parse_address
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId


@dataclass
class _Candidate:
    peer_id: PeerId
    address: str
    distance: int
    state: str = "new"  # new | asked | answered | failed
    stalled: bool = False
    asked_at: float = 0.0


@dataclass
class LookupResult:
    #: Nodes that answered, closest to the target first (at most k).
    closest: list[tuple[PeerId, str]]
    #: Valid records the answering nodes hold under the key (duplicates included), less
    #: those the caller listed as known.
    records: list[Record] = field(default_factory=list)
    #: How many answering nodes held at least one record (known ones included).
    holders: int = 0
    queried: int = 0
    failed: int = 0


@dataclass(frozen=True)
class LookupParams:
    k: int
    alpha: int
    timeout_s: float
    quorum: int | None = None


async def lookup(
    caller: Caller,
    target: int,
    key: bytes | None,
    params: LookupParams,
    *,
    verifier: Verifier,
    limits: RecordLimits,
    clock: Callable[[], float],
    known: Sequence[bytes] = (),
) -> LookupResult:
    """``known``: fingerprints of records the caller holds; nodes leave those out."""
    own = caller.identity.peer_id
    table = caller.table
    table.touch(target)
    candidates: dict[PeerId, _Candidate] = {}

    def consider(peer_id: PeerId, address: str) -> None:
        if peer_id == own or peer_id in candidates or table.in_backoff(peer_id):
            return
        candidates[peer_id] = _Candidate(peer_id, address, node_id(peer_id) ^ target)

    for contact in table.closest(target, params.k):
        consider(contact.peer_id, contact.address)
    result = LookupResult(closest=[])
    target_raw = id_to_bytes(target)
    send, receive = trio.open_memory_channel[tuple[_Candidate, pb.FindResponse | None]](math.inf)

    async def ask(c: _Candidate) -> None:
        try:
            resp = await caller.find(
                c.peer_id,
                c.address,
                [target_raw],
                [key] if key else [],
                known if key else (),
                # A holder ends a quorum-1 lookup: the nodes it would list go unused.
                nodes_only_if_empty=key is not None and params.quorum == 1,
            )
        except (rpc.RpcError, ProtocolError):
            send.send_nowait((c, None))
            return
        send.send_nowait((c, resp))

    def absorb(c: _Candidate, resp: pb.FindResponse) -> None:
        found = resp.results[0]
        for node in found.nodes[: params.k]:
            try:
                peer_id = PeerId(node.peer_id)
                parse_address(node.address)
            except ValueError:
                continue
            consider(peer_id, node.address)
        if key is None or not (found.records or found.omitted):
            return
        now = clock()
        held = found.omitted > 0
        for msg in found.records:
            record = Record.from_pb(msg)
            if record.key != key:
                continue
            try:
                verifier.check(record, limits, now)
            except RecordError:
                continue  # a node serving forged or expired records gains nothing
            result.records.append(record)
            held = True
        result.holders += held

    def shortlist() -> list[_Candidate]:
        live = [c for c in candidates.values() if c.state != "failed"]
        live.sort(key=lambda c: c.distance)
        return live[: params.k]

    def finished(short: list[_Candidate]) -> bool:
        if all(c.state == "answered" for c in short):
            return True
        if params.quorum is None or not result.holders:
            return False
        if result.holders >= params.quorum:
            return True
        return all(c.state == "answered" for c in short[: params.quorum])

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(params.timeout_s):
            while True:
                short = shortlist()
                if finished(short):
                    break
                active = sum(1 for c in candidates.values() if c.state == "asked" and not c.stalled)
                # Once the α closest have answered, the lookup has found the key's neighbourhood:
                # ask the rest of the k closest at once (Kademlia's final round) instead of α
                # at a time.
                converged = all(c.state == "answered" for c in short[: params.alpha])
                limit = params.k if converged else params.alpha
                for c in short:
                    if active >= limit:
                        break
                    if c.state == "new":
                        c.state, c.asked_at = "asked", trio.current_time()
                        result.queried += 1
                        nursery.start_soon(ask, c)
                        active += 1
                if not any(c.state == "asked" for c in candidates.values()):
                    break  # nothing in flight and nobody left to ask
                with trio.move_on_after(caller.rtt.stall()):
                    c, resp = await receive.receive()
                    if resp is None:
                        c.state = "failed"
                        result.failed += 1
                    else:
                        c.state = "answered"
                        absorb(c, resp)
                    continue
                # Nothing came back in time: stop counting the oldest request against α.
                waiting = [c for c in candidates.values() if c.state == "asked" and not c.stalled]
                if waiting:
                    min(waiting, key=lambda c: c.asked_at).stalled = True
        nursery.cancel_scope.cancel()
    answered = [c for c in candidates.values() if c.state == "answered"]
    answered.sort(key=lambda c: c.distance)
    result.closest = [(c.peer_id, c.address) for c in answered[: params.k]]
    return result
