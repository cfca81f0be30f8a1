"""DHTNode: the DHT a daemon runs: bootstrap, store/get, announce/watch, upkeep.

Construct it with the daemon's identity and RpcClient, add ``node.service()`` to the daemon's
rpc.serve, then ``await nursery.start(node.run, server.address.port, bootstrap)``: ``run``
returns control once the node has joined (or raises BootstrapError) and keeps refreshing
buckets and re-publishing this node's records until its nursery is cancelled.
Tools, tests and `swarmd dht` use ``open_dht`` instead: a node with its own server and client.

Keys and sub-keys are strings (UTF-8 on the wire), values are bytes; expiry is absolute
wall-clock seconds (``time.time()`` scale, or the injected clock's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from swarmd.node.dht.admission import Admission
from swarmd.node.dht.caller import Caller
from swarmd.node.dht.config import DHTConfig as DHTConfig
from swarmd.node.dht.dialback import DialBacker
from swarmd.node.dht.ids import key_id, random_id_in_bucket
from swarmd.node.dht.lookup import LookupParams, LookupResult, lookup
from swarmd.node.dht.reader import KeyReader as KeyReader
from swarmd.node.dht.records import (
    Record,
    RecordError,
    Verifier,
    check_shape,
    fingerprint,
    sign_record,
)
from swarmd.node.dht.replication import WHOLE_NETWORK_S as WHOLE_NETWORK_S
from swarmd.node.dht.replication import Replicator
from swarmd.node.dht.routing import RoutingTable
from swarmd.node.dht.service import DHTService
from swarmd.node.dht.storage import Storage
from swarmd.node.dht.values import Value as Value
from swarmd.node.dht.values import announced_peers as announced_peers
from swarmd.node.dht.values import key_bytes
from swarmd.node.dht.values import merge as merge
from swarmd.protocol import rpc, swarmd_pb2
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import Identity, PeerId

log = logging.getLogger("swarmd.dht")

#: Longest a leaving peer spends withdrawing an announcement (see DHTNode.announce).
WITHDRAW_TIMEOUT_S = 3.0


class BootstrapError(Exception):
    """No bootstrap peer answered; the message lists each one and why."""


class DHTNode:
    def __init__(
        self,
        identity: Identity,
        client: rpc.UnaryCaller,
        config: DHTConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.config = config or DHTConfig()
        #: Intervals (contacts' staleness, refresh): the simulator passes trio's clock.
        self._timer = timer
        #: Jitter and refresh targets; the simulator passes its seeded source so that one seed
        #: replays a run, a node draws from the OS's.
        self._rng = rng or random.SystemRandom()
        self.identity = identity
        self.peer_id = identity.peer_id
        self._clock = clock
        #: Shared by the simulator's nodes: one process, and a signature checks the same anywhere.
        self.verifier = verifier or Verifier()
        self.table = RoutingTable(identity.peer_id, self.config.routing_config(), clock=timer)
        self.storage = Storage(self.config.storage, clock=clock, verifier=self.verifier)
        self.caller = Caller(identity, client, self.table, self.config.timeouts)
        self.admission = Admission(self.caller, self.table)
        self.dial_back = DialBacker(self.caller)
        self._service = DHTService(
            identity, self.table, self.storage, self.admission, self.config.service
        )
        self._replicator = Replicator(
            self.config, self.caller, self.table, self.storage, self._find_nodes
        )
        #: This node's own records, re-published until they expire.
        self._own: dict[tuple[bytes, bytes | None], Record] = {}
        #: When each own record is next re-published (this node's clock).
        self._due: dict[tuple[bytes, bytes | None], float] = {}
        self._own_changed = trio.Event()
        self._bootstrap: list[str] = []
        #: (key, signer) -> whether reads of sub-key maps show the signer's entry (None: all).
        self.owner_filter: Callable[[bytes, PeerId], bool] | None = None

    def service(self) -> rpc.Service:
        """The gRPC service to add to the daemon's rpc.serve (with the reachability check
        every DHT node answers, dialback.py)."""
        svc = self._service.service()
        dial_back = rpc.unary("DialBack", swarmd_pb2.DialBackRequest, self.dial_back.handle)
        return dataclasses.replace(svc, methods=[*svc.methods, dial_back])

    def now(self) -> float:
        return self._clock()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(
        self,
        port: int,
        bootstrap: Sequence[str] = (),
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Joins through ``bootstrap`` (HOST:PORT), then keeps the node healthy forever.

        ``port`` is where this node's rpc server listens (0: a client-only node that others
        will not enter in their tables). With no bootstrap peers this node starts a new DHT.
        """
        self.caller.port = port
        self._bootstrap = list(bootstrap)
        if self._bootstrap:
            await self.bootstrap(self._bootstrap)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.admission.run)
            nursery.start_soon(self._refresh_loop)
            nursery.start_soon(self._republish_loop)

    async def bootstrap(self, peers: Sequence[str]) -> None:
        errors: dict[str, str] = {}

        async def ping(address: str) -> None:
            try:
                # The whole budget, not the round-trip estimate: nothing is measured yet, so
                # that would be its 250 ms floor, a loopback figure. A first call also opens
                # the connection, and a bootstrap peer may be far away or busy; seen failing
                # between network-namespace hosts on a loaded machine, and against a peer
                # paused for a second.
                await self.caller.ping(address, timeout=self.config.bootstrap_timeout_s)
            except (rpc.RpcError, ProtocolError) as exc:
                errors[address] = str(exc)

        with trio.move_on_after(self.config.bootstrap_timeout_s):
            async with trio.open_nursery() as nursery:
                for address in peers:
                    nursery.start_soon(ping, address)
        if len(self.table) == 0:
            detail = "; ".join(f"{a}: {errors.get(a, 'no answer in time')}" for a in peers)
            raise BootstrapError(f"no bootstrap peer answered ({detail})")
        await self._lookup(self.table.own_id, None, quorum=None)
        log.info("joined the DHT: %d peers in the routing table", len(self.table))

    async def _refresh_loop(self) -> None:
        cfg = self.config
        while True:
            with trio.move_on_after(cfg.refresh_interval_s * self._rng.uniform(0.5, 1.0)):
                # A node that lost every contact (a partition evicts them all) cannot heal
                # through lookups, which need contacts: it rejoins within seconds, not a minute.
                while len(self.table) or not self._bootstrap:
                    await trio.sleep(cfg.bootstrap_timeout_s)
            if len(self.table) == 0 and self._bootstrap:
                try:
                    await self.bootstrap(self._bootstrap)
                except BootstrapError as exc:
                    log.warning("routing table is empty and rejoining failed: %s", exc)
                    # A bootstrap peer still in back-off answers at once yet is not taken:
                    # without this pause that is a tight loop of pings and warnings.
                    await trio.sleep(cfg.bootstrap_timeout_s)
                continue
            now = self._timer()
            async with trio.open_nursery() as nursery:
                for contact in self.table.stale(now - cfg.stale_after_s)[: cfg.k]:
                    nursery.start_soon(self._ping_quietly, contact.address, contact.peer_id)
                for index in self.table.refresh_targets(now - cfg.refresh_interval_s):
                    target = random_id_in_bucket(self.table.own_id, index, self._rng)
                    nursery.start_soon(self._lookup, target, None, None)

    async def _ping_quietly(self, address: str, peer_id: PeerId) -> None:
        with contextlib.suppress(rpc.RpcError, ProtocolError):  # the caller evicts it
            await self.caller.ping(address, peer_id)

    def _next_due(self, record: Record, now: float) -> float:
        """Re-publish every interval, or at half the remaining lifetime if that comes first,
        so that a record reaches nodes that joined near its key before it expires."""
        wait = min(self.config.republish_interval_s, max(1.0, (record.expires - now) / 2))
        return now + wait * self._rng.uniform(0.8, 1.0)

    async def _republish_loop(self) -> None:
        while True:
            now = self._clock()
            for slot in [s for s, r in self._own.items() if r.expires <= now]:
                del self._own[slot]
                del self._due[slot]
            due = [slot for slot, when in self._due.items() if when <= now]
            if due:
                await self._replicator.replicate([self._own[slot] for slot in due])
                now = self._clock()
                for slot in due:
                    if slot in self._own:
                        self._due[slot] = self._next_due(self._own[slot], now)
            self._own_changed = trio.Event()
            wait = min(self._due.values(), default=now + self.config.republish_interval_s) - now
            with trio.move_on_after(max(0.0, wait)):
                await self._own_changed.wait()

    # -- store -----------------------------------------------------------------------------

    async def _lookup(
        self,
        target: int,
        key: bytes | None,
        quorum: int | None,
        *,
        alpha: int | None = None,
        known: Sequence[bytes] = (),
        light: bool = False,
        k: int | None = None,
    ) -> LookupResult:
        cfg = self.config
        params = LookupParams(k or cfg.k, alpha or cfg.alpha, cfg.lookup_timeout_s, quorum, light)
        near = self._replicator.near(target) if key is not None else ()
        limits, clock = cfg.storage.records, self._clock
        return await lookup(
            self.caller, target, key, params, verifier=self.verifier, limits=limits,
            clock=clock, known=known, near=near,
        )  # fmt: skip

    async def _find_nodes(self, target: int, k: int) -> LookupResult:
        return await self._lookup(target, None, None, k=k)

    async def store(
        self,
        key: str | bytes,
        value: bytes,
        expires: float,
        subkey: str | bytes | None = None,
        *,
        republish: bool = True,
    ) -> int:
        """Signs and stores ``value`` until ``expires``, on the `replicas` nodes closest to
        ``key``.

        With ``subkey``, adds or updates one entry of the key's sub-key map (other owners'
        entries stay). Returns how many nodes (this one included) now hold it; 0 means nobody
        accepted it. Raises RecordError if the record breaks the size or expiry limits.

        ``republish=False`` stores it once: for records whose use is over in seconds (a
        matchmaking round's announcement), re-storing them later only costs bandwidth.
        """
        record = sign_record(
            self.identity,
            key_bytes(key),
            value,
            expires,
            None if subkey is None else key_bytes(subkey),
        )
        check_shape(record, self.config.storage.records, self._clock())
        if republish:
            slot = (record.key, record.subkey)
            self._own[slot] = record
            self._due[slot] = self._next_due(record, self._clock())
            self._own_changed.set()
        return (await self._replicator.replicate([record]))[0]

    # -- get -------------------------------------------------------------------------------

    async def get_records(
        self,
        key: str | bytes,
        *,
        exhaustive: bool = False,
        light: bool = False,
        local: bool = False,
        known: Sequence[bytes] = (),
    ) -> list[Record]:
        """Every valid record found under ``key`` (this node's and the closest nodes'), less
        those whose fingerprint is in ``known``.

        ``light=True`` asks one node at a time and stops at the first that holds records:
        for a poll that will be repeated anyway, not for a read whose answer must be complete.
        ``local=True`` asks nobody: this node's own records only (after Storage.next_store
        said one arrived).
        """
        raw = key_bytes(key)
        held = self.storage.get(raw)
        if local:
            skip = set(known)
            return [r for r in held if fingerprint(r) not in skip]
        if exhaustive:
            result = await self._lookup(key_id(raw), raw, None, known=known)
        elif light:
            result = await self._lookup(key_id(raw), raw, 1, alpha=1, known=known, light=True)
        else:
            result = await self._lookup(key_id(raw), raw, self.config.get_quorum, known=known)
        return held + result.records

    async def find_value(self, key: str | bytes) -> LookupResult:
        """A default ``get``'s lookup with its figures (hops, asked, failed): for the simulator."""
        raw = key_bytes(key)
        return await self._lookup(key_id(raw), raw, self.config.get_quorum)

    def reader(self, key: str | bytes) -> KeyReader:
        """Repeated reads of ``key`` that transfer only records not read before."""
        return KeyReader(self, key)

    async def get(
        self, key: str | bytes, *, exhaustive: bool = False
    ) -> Value | dict[str, Value] | None:
        """The key's value (newest expiry wins), or its merged sub-key map, or None.

        By default the lookup stops once records were found and ``get_quorum`` of the closest
        nodes answered; ``exhaustive=True`` asks all k closest (slower, most complete).
        """
        return merge(await self.get_records(key, exhaustive=exhaustive), self._clock())

    async def get_value(self, key: str | bytes) -> Value | None:
        found = await self.get(key)
        return found if isinstance(found, Value) else None

    async def get_map(self, key: str | bytes, *, exhaustive: bool = False) -> dict[str, Value]:
        found = await self.get(key, exhaustive=exhaustive)
        return self.admitted(key_bytes(key), found) if isinstance(found, dict) else {}

    def admitted(self, key: bytes, entries: dict[str, Value]) -> dict[str, Value]:
        """The sub-key map's entries whose signers ``owner_filter`` admits under ``key``: a
        run with access rules (node/access.py) reads none of an outsider's announcements,
        adverts or heartbeats, so no outsider enters its groups or serves it a state."""
        keep = self.owner_filter
        if keep is None:
            return entries
        return {k: v for k, v in entries.items() if keep(key, v.owner)}

    # -- announce / watch ------------------------------------------------------------------

    async def peers(self, key: str | bytes, *, exhaustive: bool = False) -> dict[PeerId, Value]:
        """Peers announced under ``key``: sub-keys that name their own signer."""
        return announced_peers(await self.get_map(key, exhaustive=exhaustive))

    @asynccontextmanager
    async def announce(
        self, key: str | bytes, value: bytes, ttl: float = 30.0
    ) -> AsyncIterator[None]:
        """Announces this peer under ``key`` (sub-key = its peer id) while the block runs.

        The entry is stored before the block starts and re-stored with a fresh expiry every
        ttl/3, so it outlives a missed refresh. When the block ends, however it ends, an empty
        value replaces it (a withdrawal: ``peers`` leaves it out), so that others stop counting
        this peer at once rather than ``ttl`` later (seen: the last rounds of a run each sat
        out their whole gather deadline waiting for a peer that had already left). A peer
        that dies without leaving still lapses within ``ttl``.
        """
        if not ttl > 0:
            raise ValueError("ttl must be positive")
        if not value:
            raise ValueError("an announcement needs a non-empty value (empty withdraws it)")
        subkey = str(self.peer_id)
        expires = self._clock() + ttl
        await self.store(key, value, expires, subkey)

        async def refresh() -> None:
            nonlocal expires
            while True:
                await trio.sleep(ttl / 3)
                expires = self._clock() + ttl
                await self.store(key, value, expires, subkey)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(refresh)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            # Shielded, for the block usually ends by cancellation; bounded, for a peer that
            # is leaving must not hang on an unreachable DHT. A later expiry than any refresh
            # stored replaces the announcement on every node that held it.
            with trio.CancelScope(shield=True), trio.move_on_after(WITHDRAW_TIMEOUT_S):
                try:
                    await self.store(key, b"", max(expires, self._clock()) + 0.01, subkey)
                except RecordError as exc:
                    log.info("could not withdraw the announcement under %r: %s", key, exc)

    async def watch(
        self, key: str | bytes, interval: float = 1.0
    ) -> AsyncIterator[dict[PeerId, Value]]:
        """Yields the peers announced under ``key`` now, then whenever that set changes."""
        if not interval > 0:
            raise ValueError("interval must be positive")
        last: set[PeerId] | None = None
        while True:
            current = await self.peers(key)
            if last is None or set(current) != last:
                last = set(current)
                yield current
            await trio.sleep(interval)

    def stats(self) -> dict[str, float]:
        return {
            "routing_table": len(self.table),
            "records": len(self.storage),
            "record_bytes": self.storage.nbytes,
            "own_records": len(self._own),
            "rtt_ms": round(self.caller.rtt.srtt * 1000, 2),
            "timeout_ms": round(self.caller.rtt.timeout() * 1000, 2),
        }


#: A DHT-only node's transport: small messages, fewer of them at once than a training peer.
DHT_TRANSPORT = rpc.TransportConfig(max_concurrent_rpcs=16, max_inflight_calls=64)


@asynccontextmanager
async def open_dht(
    identity: Identity,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    bootstrap: Sequence[str] = (),
    config: DHTConfig | None = None,
    transport: rpc.TransportConfig | None = None,
    clock: Callable[[], float] = time.time,
    extra_services: Sequence[rpc.Service] = (),
) -> AsyncIterator[tuple[DHTNode, rpc.RpcServer]]:
    """A DHT-only node with its own server and client, joined and running in the block."""
    transport = transport or DHT_TRANSPORT
    client = rpc.RpcClient(identity, transport)
    node = DHTNode(identity, client, config, clock=clock)
    try:
        async with (
            rpc.serve(
                [node.service(), *extra_services], host, port, config=transport, identity=identity
            ) as server,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(node.run, server.address.port, list(bootstrap))
            yield node, server
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nurseries wrap a failed join; callers want to catch BootstrapError itself.
        leaf = _single_leaf(group)
        if isinstance(leaf, BootstrapError):
            raise leaf from None
        raise
    finally:
        client.close()


def _single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
