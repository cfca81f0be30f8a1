"""Who enters the routing table from an incoming call: only a contact that answered us.

A call's signature proves the caller holds its key, but the port it claims is only a claim:
before this, every caller entered our buckets at once, and of 300 fresh identities that
pinged from one host claiming a port where nothing listens, about 100 did (issue 31), each
later costing lookups a timeout. As in S/Kademlia (Baumgart & Mies 2007), an unknown caller
is now pinged back at its claimed address with a challenge it must sign, and offered to its
bucket only if that succeeds. Contacts learned from lookups' answers already enter only
after answering our own calls (caller.py).

The pings are bounded: at most ``RoutingConfig.max_pending`` verifications at once (one per
node id); offers beyond that are dropped, which costs an honest caller nothing lasting, since
it calls again and a node it calls learns of it from its answers. An id whose verification
failed is not pinged again for a minute (remembered here, not in the routing table).

A full bucket keeps its long-lived contacts (Kademlia: they are the likeliest to stay): a
verified newcomer goes to the bucket's replacement cache and its least-recently-seen contact
is pinged; only if that fails is it evicted, and the newcomer promoted in its place.
"""

from __future__ import annotations

import contextlib
import math

import trio

from swarmd.node.dht.caller import Caller
from swarmd.node.dht.routing import RoutingTable
from swarmd.protocol import rpc
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId

#: How long an id whose claimed address did not answer is not pinged again.
RETRY_AFTER_S = 60.0
#: Failed ids remembered at most (the oldest forgotten first).
FAILED_KEPT = 4096


class Admission:
    """Not thread-safe: used from the trio loop only."""

    def __init__(self, caller: Caller, table: RoutingTable) -> None:
        self.caller = caller
        self.table = table
        self.max_pending = table.config.max_pending
        self._pending: set[PeerId] = set()
        # Unbounded only in type: at most max_pending items are ever in it (see offer).
        self._send, self._receive = trio.open_memory_channel[tuple[PeerId, str]](math.inf)
        #: Offers dropped because max_pending verifications were already running.
        self.dropped = 0
        #: Ids whose verification failed, until when they are not pinged again. Kept here,
        #: not in the routing table: a failed dial-back says the *claimed* address does not
        #: answer, not that the peer is gone. Held against its table entry, it evicted peers
        #: whose calls leave from another address than they listen on (a multi-homed host;
        #: `swarmd chaos`, whose peers listen on 127.0.0.10+ and call from 127.0.0.1), and
        #: barred them from the table even after they answered our own calls.
        self._failed_until: dict[PeerId, float] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def offer(self, peer_id: PeerId, address: str) -> None:
        """A caller that signed a request and says it listens at ``address``."""
        if peer_id == self.table.own or self.table.in_backoff(peer_id):
            return
        if self._failed_until.get(peer_id, -math.inf) > trio.current_time():
            return
        current = self.table.get(peer_id)
        if current is not None and current.address == address:
            self.table.seen(peer_id, address)  # verified there when it entered
            return
        if peer_id in self._pending:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.add(peer_id)
        self._send.send_nowait((peer_id, address))

    async def run(self) -> None:
        """Verifies offered contacts until cancelled (in the node's nursery)."""
        async with trio.open_nursery() as nursery:
            async for peer_id, address in self._receive:
                nursery.start_soon(self._verify, peer_id, address)

    async def _verify(self, peer_id: PeerId, address: str) -> None:
        try:
            if self.caller.is_verified(peer_id, address):
                self.table.seen(peer_id, address)
            elif not self.table.would_admit(peer_id):
                # Its bucket is full of contacts heard from lately: proven, it could only wait
                # in the replacement cache. The dial-back was skipped there: in a simulated
                # 200-peer run, dial-backs were 30 pings a peer-round, most of them to callers
                # of full buckets (the nodes near a round's key are called by every peer).
                return
            else:
                try:
                    # Enters the table on success (Caller._accept).
                    await self.caller.ping(address, peer_id, record_failure=False)
                except (rpc.RpcError, ProtocolError):
                    self._remember_failure(peer_id)
                    return
            if peer_id not in self.table:
                await self._challenge_oldest(peer_id)
        finally:
            self._pending.discard(peer_id)

    def _remember_failure(self, peer_id: PeerId) -> None:
        now = trio.current_time()
        if len(self._failed_until) >= FAILED_KEPT:  # a flood of fresh ids: forget the expired
            self._failed_until = {p: t for p, t in self._failed_until.items() if t > now}
            while len(self._failed_until) >= FAILED_KEPT:
                del self._failed_until[next(iter(self._failed_until))]
        self._failed_until[peer_id] = now + RETRY_AFTER_S

    async def _challenge_oldest(self, newcomer: PeerId) -> None:
        """Pings the full bucket's least-recently-seen contact unless it was heard from lately;
        a failure evicts it (RoutingTable.failed), which promotes the newcomer from the cache."""
        oldest = self.table.oldest_rival(newcomer)
        if oldest is None:
            return
        with contextlib.suppress(rpc.RpcError, ProtocolError):
            await self.caller.ping(oldest.address, oldest.peer_id)
