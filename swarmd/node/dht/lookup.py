"""Kademlia's iterative lookup: ask the closest known nodes for closer ones, α at a time.

The lookup keeps a shortlist of the k closest nodes it has heard of, keeps α requests in
flight to the closest it has not asked yet, and stops when the k closest have all answered
(a node lookup; for a store's, k is its `replicas`) or, for gets, as soon as records were
found and either the ``quorum`` closest nodes have answered or ``quorum`` nodes returned
records. Stores replicate
to the `replicas` closest nodes, so the nodes nearest the key hold its newest version.

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
    #: Answers between the caller and this node: 1 for its own contacts.
    hops: int = 1
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
    #: Hops to the first node that held a record (key lookups), else to the closest node
    #: that answered; 0 when nobody answered.
    hops: int = 0


#: A light read (``LookupParams.light``) also ends once this many nodes held only records
#: the reader already has: one could be a replica the latest store had not reached.
STALE_HOLDERS = 2


@dataclass(frozen=True)
class LookupParams:
    k: int
    alpha: int
    timeout_s: float
    quorum: int | None = None
    #: A poll for news (DHTNode.get_records(light=True)): a holder is a node with records
    #: the reader does not hold yet. Counting a node that held only the reader's own
    #: announcement ended every poll at a replica the other peer's store had not reached,
    #: and a matchmaking peer waited out its whole gather window (a CI failure: 10 s).
    light: bool = False


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
    near: Sequence[tuple[PeerId, str]] = (),
) -> LookupResult:
    """``known``: fingerprints of records the caller holds; nodes leave those out. ``near``:
    nodes a recent lookup found closest to the target (Replicator.near), asked first."""
    job = _Lookup(caller, target, key, params, verifier, limits, clock, known)
    for peer_id, address in near:
        job.consider(peer_id, address)
    return await job.run()


class _Lookup:
    """One iterative lookup: its candidates (closest first), what they answered, the result."""

    def __init__(
        self,
        caller: Caller,
        target: int,
        key: bytes | None,
        params: LookupParams,
        verifier: Verifier,
        limits: RecordLimits,
        clock: Callable[[], float],
        known: Sequence[bytes],
    ) -> None:
        self.caller, self.target, self.key, self.params = caller, target, key, params
        self.verifier, self.limits, self.clock, self.known = verifier, limits, clock, known
        self.own = caller.identity.peer_id
        self.table = caller.table
        self.candidates: dict[PeerId, _Candidate] = {}
        self.result = LookupResult(closest=[])
        #: Light reads: nodes that held only records the reader has.
        self.stale = 0
        self.send, self.receive = trio.open_memory_channel[
            tuple[_Candidate, pb.FindResponse | None]
        ](math.inf)

    async def run(self) -> LookupResult:
        self.table.touch(self.target)
        for contact in self.table.closest(self.target, self.params.k):
            self.consider(contact.peer_id, contact.address)
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(self.params.timeout_s):
                while not self.finished(self.shortlist()):
                    self.launch(nursery)
                    if not any(c.state == "asked" for c in self.candidates.values()):
                        break  # nothing in flight and nobody left to ask
                    await self.next_answer()
            nursery.cancel_scope.cancel()
        answered = [c for c in self.candidates.values() if c.state == "answered"]
        answered.sort(key=lambda c: c.distance)
        self.result.closest = [(c.peer_id, c.address) for c in answered[: self.params.k]]
        if not self.result.hops and answered:
            self.result.hops = answered[0].hops
        return self.result

    def consider(self, peer_id: PeerId, address: str, hops: int = 1) -> None:
        if peer_id == self.own or peer_id in self.candidates or self.table.in_backoff(peer_id):
            return
        self.candidates[peer_id] = _Candidate(
            peer_id, address, node_id(peer_id) ^ self.target, hops=hops
        )

    def shortlist(self) -> list[_Candidate]:
        live = [c for c in self.candidates.values() if c.state != "failed"]
        live.sort(key=lambda c: c.distance)
        return live[: self.params.k]

    def finished(self, short: list[_Candidate]) -> bool:
        if all(c.state == "answered" for c in short):
            return True
        quorum, holders = self.params.quorum, self.result.holders
        if quorum is not None and self.params.light and self.stale >= STALE_HOLDERS:
            return True
        if quorum is None or not holders:
            return False
        if holders >= quorum:
            return True
        return all(c.state == "answered" for c in short[:quorum])

    def launch(self, nursery: trio.Nursery) -> None:
        """Asks the closest unasked candidates, α in flight at a time."""
        short = self.shortlist()
        active = sum(1 for c in self.candidates.values() if c.state == "asked" and not c.stalled)
        # Once the α closest have answered, the lookup has found the key's neighbourhood: ask
        # the rest of the k closest at once (Kademlia's final round) instead of α at a time.
        # A light read stays one node at a time: it stops at the first with news.
        converged = all(c.state == "answered" for c in short[: self.params.alpha])
        limit = self.params.k if converged and not self.params.light else self.params.alpha
        for c in short:
            if active >= limit:
                break
            if c.state == "new":
                c.state, c.asked_at = "asked", trio.current_time()
                self.result.queried += 1
                nursery.start_soon(self.ask, c)
                active += 1

    async def next_answer(self) -> None:
        """Takes one answer; if none comes in time, stops counting the oldest request
        against α."""
        with trio.move_on_after(self.caller.rtt.stall()):
            c, resp = await self.receive.receive()
            if resp is None:
                c.state = "failed"
                self.result.failed += 1
            else:
                c.state = "answered"
                self.absorb(resp, c.hops)
            return
        waiting = [c for c in self.candidates.values() if c.state == "asked" and not c.stalled]
        if waiting:
            min(waiting, key=lambda c: c.asked_at).stalled = True

    async def ask(self, c: _Candidate) -> None:
        key = self.key
        try:
            resp = await self.caller.find(
                c.peer_id,
                c.address,
                [id_to_bytes(self.target)],
                [key] if key else [],
                self.known if key else (),
                # A holder ends a quorum-1 lookup: the nodes it would list go unused.
                nodes_only_if_empty=key is not None and self.params.quorum == 1,
            )
        except (rpc.RpcError, ProtocolError):
            self.send.send_nowait((c, None))
            return
        self.send.send_nowait((c, resp))

    def absorb(self, resp: pb.FindResponse, hops: int) -> None:
        found = resp.results[0]
        for node in found.nodes[: self.params.k]:
            try:
                peer_id = PeerId(node.peer_id)
                parse_address(node.address)
            except ValueError:
                continue
            self.consider(peer_id, node.address, hops + 1)
        if self.key is None or not (found.records or found.omitted):
            return
        now = self.clock()
        held = found.omitted > 0
        count = len(self.result.records)
        for msg in found.records:
            record = Record.from_pb(msg)
            if record.key != self.key:
                continue
            try:
                self.verifier.check(record, self.limits, now)
            except RecordError:
                continue  # a node serving forged or expired records gains nothing
            self.result.records.append(record)
            held = True
        if self.params.light and held and len(self.result.records) == count:
            self.stale += 1
            return
        self.result.holders += held
        if held and not self.result.hops:
            self.result.hops = hops
