"""The records one node holds for the swarm: expiry, newest-wins merging, per-owner quotas.

A key holds a plain record, a map of sub-key entries, or both (readers prefer whichever
expires last). Each slot (key, or key + sub-key) keeps one record:

- newer expiry wins, so re-publishing with a later expiry updates every replica, and an old
  record replayed later is ignored;
- a live slot can only be replaced by its own owner, so nobody can overwrite (or delete by
  overwriting) another peer's record; a slot is free again once its record expires;
- expired records are dropped and never returned.

Quotas bound what one owner key can make this node hold (count and bytes), and a global cap
bounds everything. Keys cost nothing to make, so an owner quota alone let one host fill the
whole cap with fresh keys (issue 31: 66 keys from one address filled 256 MiB in 4.8 s, and
honest stores failed after that). So the records a caller delivered also count against the
address the call came from and against its /24 (IPv4) or /48 (IPv6) network: filling the node
takes many hosts in many networks, not many keys. A record is charged to whoever delivered its
current version; records this node stores itself (its own, or ones it fetched) are charged to
no address.

Within an address's share, identities are served fairly: volunteers behind one home router
share an address, and first come, first served let one identity that filled the share lock
out the next (issue 47: a new honest identity stored 3 of 20 records). When the share is
full, a record from an owner that holds less there than the address's largest holder
replaces that holder's record that expires first. So a flood from one identity leaves a
newcomer at its address half the share, and a flood of identities that each filled their
owner quota (issue 31's) leaves a newcomer with small records all it asks for. The address's
total stays at its share. What it cannot do: tell a volunteer from fresh identities made to
look like many (owner keys are free); a flood of one-record identities from the same
address drives every holder there, honest ones too, toward one record.
"""

from __future__ import annotations

import enum
import heapq
import ipaddress
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from swarmd.node.dht.records import Record, RecordError, RecordLimits, Verifier, check_shape


class Outcome(enum.Enum):
    STORED = "stored"
    #: The node already held this record or a newer one; not an error.
    SUPERSEDED = "superseded"


@dataclass(frozen=True)
class StorageLimits:
    """What a node agrees to hold for others.

    ``address_share`` and ``block_share`` are the fractions of ``max_records`` and
    ``max_bytes`` that one source address and one /24 (/48) network may fill. 1/16 and 1/8:
    a single host then holds at most 16 MiB (four whole owner quotas, far above what a run
    stores on a node: a few hundred small records), and filling a node takes 8 networks; the
    block's share is twice the address's so that an honest peer sharing a /24 with one
    flooding host still has as much room as the flooder.
    """

    records: RecordLimits = field(default_factory=RecordLimits)
    max_records_per_owner: int = 1024
    max_bytes_per_owner: int = 4 << 20
    max_records: int = 200_000
    max_bytes: int = 256 << 20
    address_share: float = 1 / 16
    block_share: float = 1 / 8

    def __post_init__(self) -> None:
        for name in ("max_records_per_owner", "max_bytes_per_owner", "max_records", "max_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StorageLimits.{name} must be positive")
        if not 0 < self.address_share <= self.block_share <= 1:
            raise ValueError("StorageLimits needs 0 < address_share <= block_share <= 1")

    def _share(self, fraction: float) -> tuple[int, int]:
        return max(1, int(self.max_records * fraction)), max(1, int(self.max_bytes * fraction))

    @property
    def per_address(self) -> tuple[int, int]:
        """(records, bytes) that calls from one source address may make this node hold."""
        return self._share(self.address_share)

    @property
    def per_block(self) -> tuple[int, int]:
        """(records, bytes) that calls from one /24 (IPv4) or /48 (IPv6) may make it hold."""
        return self._share(self.block_share)


def source_block(host: str) -> str:
    """The /24 (IPv4) or /48 (IPv6) network of a source IP, as a quota key."""
    ip = ipaddress.ip_address(host)
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass
class _Usage:
    count: int = 0
    nbytes: int = 0


#: A record's place: (key, sub-key or None).
Slot = tuple[bytes, bytes | None]


class Storage:
    """Not thread-safe: used from the trio loop only."""

    def __init__(
        self,
        limits: StorageLimits | None = None,
        *,
        clock: Callable[[], float] = time.time,
        verifier: Verifier | None = None,
    ) -> None:
        self.limits = limits or StorageLimits()
        self._clock = clock
        self._verifier = verifier or Verifier()
        self._plain: dict[bytes, Record] = {}
        self._subs: dict[bytes, dict[bytes, Record]] = {}
        self._usage: dict[bytes, _Usage] = {}
        #: Usage per source address and per source network (their strings never collide: a
        #: network's has a "/"), and the two keys each delivered record is charged to.
        self._by_source: dict[str, _Usage] = {}
        self._sources: dict[Slot, tuple[str, str]] = {}
        #: Per source address, each owner's usage there and the slots it holds (the fair
        #: share's bookkeeping: who holds most, and which of its records go first).
        self._held: dict[str, dict[bytes, tuple[_Usage, set[Slot]]]] = {}
        self._total = _Usage()
        # (expires_ms, key, has_subkey, subkey) of every stored record, so that tuples always
        # compare; entries whose slot has changed since are skipped when popped.
        self._expiries: list[tuple[int, bytes, bool, bytes]] = []
        # One event per key that somebody waits on; weak, so a key nobody watches any more
        # (a matchmaking round that ended) leaves nothing behind.
        self._watched: weakref.WeakValueDictionary[bytes, trio.Event] = (
            weakref.WeakValueDictionary()
        )

    def next_store(self, key: bytes) -> trio.Event:
        """An event set when this node next stores a record under ``key``.

        A waiter takes it *before* it reads the key, so a record that lands during the read
        still wakes it. Matchmaking sleeps on it between its DHT polls: in a network smaller
        than k every node holds every record, so the announcement that fills a group, or the
        leader's commitment, is pushed to the waiting peers' own nodes by the store itself,
        and they see it at once instead of at their next poll.
        """
        event = self._watched.get(key)
        if event is None:
            event = self._watched[key] = trio.Event()
        return event

    def __len__(self) -> int:
        return self._total.count

    @property
    def nbytes(self) -> int:
        return self._total.nbytes

    def usage(self, owner_key: bytes) -> tuple[int, int]:
        u = self._usage.get(owner_key)
        return (u.count, u.nbytes) if u else (0, 0)

    def source_usage(self, source: str) -> tuple[int, int]:
        """(records, bytes) charged to a source address, or to a network ("10.0.0.0/24")."""
        u = self._by_source.get(source)
        return (u.count, u.nbytes) if u else (0, 0)

    def _slot(self, key: bytes, subkey: bytes | None) -> Record | None:
        if subkey is None:
            return self._plain.get(key)
        return self._subs.get(key, {}).get(subkey)

    def put(self, record: Record, source: str | None = None) -> Outcome:
        """Stores ``record`` or says why not (RecordError); verifies the signature last.

        ``source``: the IP address the record came from (the transport's, not a claim), to
        charge it to; None for records this node stores itself.
        """
        now = self._clock()
        self.purge(now)
        check_shape(record, self.limits.records, now)
        slot = (record.key, record.subkey)
        old = self._slot(*slot)
        if old is not None and old.owner_key != record.owner_key:
            raise RecordError("slot is held by another owner until its record expires")
        keys = (source, source_block(source)) if source is not None else None
        evict: list[Slot] = []
        if keys is not None and (old is None or record.supersedes(old)):
            evict = self._check_source_quota(record, old, keys)
        self._check_quota(record, old, evict)
        self._verifier.verify(record)  # cheap for records seen before (republishes)
        if old is not None and not record.supersedes(old):
            return Outcome.SUPERSEDED
        for gone in evict:  # only once the record that takes their room is verified
            self._drop(gone)
        if old is not None:
            self._account(old, -1, self._sources.pop(slot, None))
        if record.subkey is None:
            self._plain[record.key] = record
        else:
            self._subs.setdefault(record.key, {})[record.subkey] = record
        self._account(record, +1, keys)
        if keys is not None:
            self._sources[slot] = keys
        entry = (record.expires_ms, record.key, record.subkey is not None, record.subkey or b"")
        heapq.heappush(self._expiries, entry)
        event = self._watched.pop(record.key, None)
        if event is not None:
            event.set()
        return Outcome.STORED

    def _check_quota(self, record: Record, old: Record | None, evict: list[Slot]) -> None:
        lim = self.limits
        usage = self._usage.get(record.owner_key, _Usage())
        count = usage.count + (0 if old else 1)
        nbytes = usage.nbytes + record.size - (old.size if old else 0)
        if count > lim.max_records_per_owner or nbytes > lim.max_bytes_per_owner:
            raise RecordError(
                f"owner quota exceeded ({lim.max_records_per_owner} records, "
                f"{lim.max_bytes_per_owner} B per owner)"
            )
        freed_count, freed_bytes = self._freed(evict)
        total_count = self._total.count + (0 if old else 1) - freed_count
        total_bytes = self._total.nbytes + record.size - (old.size if old else 0) - freed_bytes
        if total_count > lim.max_records or total_bytes > lim.max_bytes:
            raise RecordError("this node's storage is full")

    def _check_source_quota(
        self, record: Record, old: Record | None, keys: tuple[str, str]
    ) -> list[Slot]:
        """Raises if the record does not fit the source's shares; returns the slots of the
        address's largest holder it replaces to fit (see the module's docstring)."""
        lim = self.limits
        held_by = self._sources.get((record.key, record.subkey)) if old is not None else None
        evict: list[Slot] = []
        for key, (max_count, max_bytes), what in zip(
            keys, (lim.per_address, lim.per_block), ("address", "network"), strict=True
        ):
            usage = self._by_source.get(key, _Usage())
            same = old is not None and held_by is not None and key in held_by
            count = usage.count + (0 if same else 1)
            nbytes = usage.nbytes + record.size - (old.size if same and old else 0)
            if what == "address" and (count > max_count or nbytes > max_bytes):
                evict = self._fair_room(key, record, count - max_count, nbytes - max_bytes)
            freed_count, freed_bytes = self._freed(evict)
            count, nbytes = count - freed_count, nbytes - freed_bytes
            if count > max_count or nbytes > max_bytes:
                raise RecordError(
                    f"source {what} quota exceeded: {key} may store {max_count} records, "
                    f"{max_bytes} B on this node"
                )
        return evict

    def _fair_room(self, address: str, record: Record, count: int, nbytes: int) -> list[Slot]:
        """The records of `address`'s largest holder that `record`'s owner may replace to
        free `count` records and `nbytes` bytes there: its soonest-expiring ones, each while
        that holder still holds more than the owner will. Empty when it may not (the caller
        then refuses the record)."""
        owners = self._held.get(address, {})
        mine, _ = owners.get(record.owner_key, (_Usage(), set()))
        my_count, my_bytes = mine.count + 1, mine.nbytes + record.size
        others = {o: u for o, (u, _) in owners.items() if o != record.owner_key}
        if not others:
            return []
        top = max(others, key=lambda o: (others[o].count, others[o].nbytes))
        top_count, top_bytes = others[top].count, others[top].nbytes
        slots = sorted(owners[top][1], key=lambda slot: self._expiry_of(slot))
        evict: list[Slot] = []
        for slot in slots:
            if count <= 0 and nbytes <= 0:
                break
            gone = self._slot(*slot)
            if gone is None:
                return []
            if (count > 0 and top_count <= my_count) or (nbytes > 0 and top_bytes <= my_bytes):
                return []
            evict.append(slot)
            top_count, top_bytes = top_count - 1, top_bytes - gone.size
            count, nbytes = count - 1, nbytes - gone.size
        return evict if count <= 0 and nbytes <= 0 else []

    def _freed(self, evict: list[Slot]) -> tuple[int, int]:
        """(records, bytes) that dropping `evict` frees."""
        gone = [r for r in (self._slot(*slot) for slot in evict) if r is not None]
        return len(gone), sum(r.size for r in gone)

    def _expiry_of(self, slot: Slot) -> int:
        found = self._slot(*slot)
        return found.expires_ms if found is not None else 0

    def _drop(self, slot: Slot) -> None:
        """Removes a live record (its expiry heap entry is skipped when popped)."""
        key, subkey = slot
        current = self._slot(key, subkey)
        if current is None:
            return
        self._account(current, -1, self._sources.pop(slot, None))
        if subkey is None:
            del self._plain[key]
        else:
            subs = self._subs[key]
            del subs[subkey]
            if not subs:
                del self._subs[key]

    def _account(self, record: Record, sign: int, sources: tuple[str, str] | None) -> None:
        if sources is not None:
            self._hold(sources[0], record, sign)
        usage = self._usage.setdefault(record.owner_key, _Usage())
        usage.count += sign
        usage.nbytes += sign * record.size
        self._total.count += sign
        self._total.nbytes += sign * record.size
        if usage.count == 0:
            del self._usage[record.owner_key]
        for key in sources or ():
            by = self._by_source.setdefault(key, _Usage())
            by.count += sign
            by.nbytes += sign * record.size
            if by.count == 0:
                del self._by_source[key]

    def _hold(self, address: str, record: Record, sign: int) -> None:
        owners = self._held.setdefault(address, {})
        usage, slots = owners.setdefault(record.owner_key, (_Usage(), set()))
        usage.count += sign
        usage.nbytes += sign * record.size
        slot = (record.key, record.subkey)
        if sign > 0:
            slots.add(slot)
        else:
            slots.discard(slot)
        if usage.count == 0:
            del owners[record.owner_key]
            if not owners:
                del self._held[address]

    def get(self, key: bytes) -> list[Record]:
        """Live records under ``key``: the plain one (if any) then sub-key entries."""
        now = self._clock()
        self.purge(now)
        now_ms = int(now * 1000)
        found: list[Record] = []
        plain = self._plain.get(key)
        if plain is not None and plain.expires_ms > now_ms:
            found.append(plain)
        found.extend(r for r in self._subs.get(key, {}).values() if r.expires_ms > now_ms)
        return found

    def records(self) -> list[Record]:
        """Every live record (for hand-over to new neighbours)."""
        self.purge(self._clock())
        out = list(self._plain.values())
        for subs in self._subs.values():
            out.extend(subs.values())
        return out

    def purge(self, now: float) -> None:
        now_ms = int(now * 1000)
        while self._expiries and self._expiries[0][0] <= now_ms:
            expires_ms, key, has_subkey, raw_subkey = heapq.heappop(self._expiries)
            subkey = raw_subkey if has_subkey else None
            current = self._slot(key, subkey)
            if current is None or current.expires_ms != expires_ms:
                continue  # replaced or dropped since; a newer record has its own entry
            self._drop((key, subkey))
