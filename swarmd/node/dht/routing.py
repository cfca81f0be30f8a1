"""The routing table: k-buckets by XOR distance, with limits that make eclipsing expensive.

Kademlia keeps, for each distance range 2^i..2^(i+1), up to k contacts, preferring those seen
longest (old contacts are likelier to stay). Three additions against hostile or flaky peers:

- one /24 (IPv4) or /48 (IPv6) network may hold only a few entries per bucket and in the table,
  so one host (or one cheap VPS block) cannot fill the buckets around a key or around us;
  loopback is exempt so that tests and single-machine swarms work;
- a contact whose RPC failed is evicted at once and barred from re-entry for a back-off period
  that doubles with each consecutive failure (capped), so dead peers stop costing timeouts but
  a peer that was only briefly unreachable comes back;
- a full bucket keeps a small replacement cache, promoted when an entry is evicted.

Nothing here checks that a contact answers at its address: callers of ``seen`` do (an answer
to our own call, caller.py; a verification ping for an incoming call, admission.py).
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from swarmd.node.dht.ids import ID_BITS, bucket_index, node_id
from swarmd.protocol.address import parse_address
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class RoutingConfig:
    k: int = 20
    max_per_subnet_bucket: int = 2
    max_per_subnet_table: int = 10
    #: Networks whose addresses are not subnet-limited.
    subnet_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    backoff_base_s: float = 2.0
    backoff_max_s: float = 300.0
    replacement_cache: int = 8
    #: Incoming callers being pinged back before they may enter (admission.py); more are
    #: dropped, so a flood of fresh identities costs at most this many pings in flight.
    max_pending: int = 32
    #: A full bucket's oldest contact heard from this recently is kept without a ping when a
    #: newcomer would take its place (each ping would prove what we just saw). At 5 s, in a
    #: simulated 200-peer run where every peer stores to the nodes nearest each round's key,
    #: these challenges were 25 pings a peer-round, about one in eight calls.
    recheck_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("RoutingConfig.k must be >= 1")
        if self.max_per_subnet_bucket < 1 or self.max_per_subnet_table < 1:
            raise ValueError("RoutingConfig subnet limits must be >= 1")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("RoutingConfig needs 0 < backoff_base_s <= backoff_max_s")
        if self.replacement_cache < 0:
            raise ValueError("RoutingConfig.replacement_cache must be >= 0")
        if self.max_pending < 1 or self.recheck_after_s < 0:
            raise ValueError("RoutingConfig needs max_pending >= 1 and recheck_after_s >= 0")
        for net in self.subnet_exempt:
            try:
                ipaddress.ip_network(net)
            except ValueError:
                raise ValueError(f"RoutingConfig.subnet_exempt: {net!r} is not a network") from None


@dataclass
class Contact:
    peer_id: PeerId
    address: str
    id: int = field(init=False)
    last_seen: float = 0.0

    def __post_init__(self) -> None:
        self.id = node_id(self.peer_id)


@dataclass
class _Failure:
    count: int
    until: float


class RoutingTable:
    """Not thread-safe: used from the trio loop only."""

    def __init__(
        self,
        own: PeerId,
        config: RoutingConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.own = own
        self.own_id = node_id(own)
        self.config = config or RoutingConfig()
        self._clock = clock
        # Each bucket is ordered least- to most-recently seen.
        self._buckets: list[OrderedDict[PeerId, Contact]] = [OrderedDict() for _ in range(ID_BITS)]
        self._replacements: list[OrderedDict[PeerId, Contact]] = [
            OrderedDict() for _ in range(ID_BITS)
        ]
        self._subnet_count: dict[str, int] = {}
        self._failures: dict[PeerId, _Failure] = {}
        self.touched: list[float] = [0.0] * ID_BITS

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets)

    def __contains__(self, peer_id: PeerId) -> bool:
        return self.get(peer_id) is not None

    def contacts(self) -> list[Contact]:
        return [c for b in self._buckets for c in b.values()]

    def get(self, peer_id: PeerId) -> Contact | None:
        if peer_id == self.own:
            return None
        return self._buckets[bucket_index(self.own_id, node_id(peer_id))].get(peer_id)

    def subnet(self, address: str) -> str | None:
        """The /24 or /48 an address belongs to; None if unlimited (exempt, or a hostname)."""
        return _subnet(address, tuple(self.config.subnet_exempt))

    def in_backoff(self, peer_id: PeerId) -> bool:
        failure = self._failures.get(peer_id)
        return failure is not None and self._clock() < failure.until

    def seen(self, peer_id: PeerId, address: str) -> bool:
        """Records that ``peer_id`` answered (or called) from ``address``; False if not kept."""
        if peer_id == self.own or self.in_backoff(peer_id):
            return False
        self._failures.pop(peer_id, None)
        now = self._clock()
        index = bucket_index(self.own_id, node_id(peer_id))
        bucket = self._buckets[index]
        current = bucket.get(peer_id)
        if current is not None:
            if current.address != address:
                # A known peer moved: take the new address if its network has room.
                if not self._subnet_room(index, address, leaving=current.address):
                    return False
                self._count(current.address, -1)
                current.address = address
                self._count(address, +1)
            current.last_seen = now
            bucket.move_to_end(peer_id)
            return True
        contact = Contact(peer_id, address, last_seen=now)
        if len(bucket) < self.config.k and self._subnet_room(index, address):
            bucket[peer_id] = contact
            self._count(address, +1)
            return True
        cache = self._replacements[index]
        if self.config.replacement_cache and self._subnet_room(index, address):
            cache.pop(peer_id, None)
            cache[peer_id] = contact
            while len(cache) > self.config.replacement_cache:
                cache.popitem(last=False)
        return False

    def failed(self, peer_id: PeerId) -> None:
        """Evicts ``peer_id`` after a failed RPC and bars it for a growing back-off period.

        Failures while it is already barred (calls that were in flight together, or a
        lookup's parallel probes) count as the same outage: counting each one would turn a
        short partition into minutes of refusing a peer that answers again.
        """
        previous = self._failures.get(peer_id)
        now = self._clock()
        if previous is None or previous.until <= now:
            count = previous.count + 1 if previous else 1
            delay = min(self.config.backoff_base_s * 2 ** (count - 1), self.config.backoff_max_s)
            self._failures[peer_id] = _Failure(count, now + delay)
        if len(self._failures) > 16 * self.config.k * 8:
            # Failed verifications of callers that never entered land here too (a flood of
            # fresh ids): forget the ones whose back-off is over.
            for pid in [p for p, f in self._failures.items() if f.until <= now]:
                del self._failures[pid]
        if peer_id == self.own:
            return
        index = bucket_index(self.own_id, node_id(peer_id))
        self._replacements[index].pop(peer_id, None)
        contact = self._buckets[index].pop(peer_id, None)
        if contact is None:
            return
        self._count(contact.address, -1)
        self._promote(index)

    def would_admit(self, newcomer: PeerId) -> bool:
        """Whether ``newcomer``, once verified, could enter its bucket: the bucket has room or
        holds it, or its oldest contact is stale enough to be challenged."""
        bucket = self._buckets[bucket_index(self.own_id, node_id(newcomer))]
        if len(bucket) < self.config.k or newcomer in bucket:
            return True
        return self.oldest_rival(newcomer) is not None

    def oldest_rival(self, newcomer: PeerId) -> Contact | None:
        """The least-recently-seen contact of the full bucket ``newcomer`` belongs in, if it has
        not been heard from for ``recheck_after_s``: the one to ping before giving up on the
        newcomer. None if the bucket has room, already holds it, or its oldest is fresh."""
        if newcomer == self.own:
            return None
        bucket = self._buckets[bucket_index(self.own_id, node_id(newcomer))]
        if len(bucket) < self.config.k or newcomer in bucket:
            return None
        oldest = next(iter(bucket.values()))
        if oldest.last_seen > self._clock() - self.config.recheck_after_s:
            return None
        return oldest

    def _promote(self, index: int) -> None:
        cache, bucket = self._replacements[index], self._buckets[index]
        while cache and len(bucket) < self.config.k:
            peer_id, contact = cache.popitem(last=True)  # the most recently seen first
            if self.in_backoff(peer_id) or not self._subnet_room(index, contact.address):
                continue
            bucket[peer_id] = contact
            bucket.move_to_end(peer_id, last=False)  # unproven since it was cached
            self._count(contact.address, +1)

    def _subnet_room(self, index: int, address: str, leaving: str | None = None) -> bool:
        net = self.subnet(address)
        if net is None or (leaving is not None and self.subnet(leaving) == net):
            return True
        in_bucket = sum(1 for c in self._buckets[index].values() if self.subnet(c.address) == net)
        return (
            in_bucket < self.config.max_per_subnet_bucket
            and self._subnet_count.get(net, 0) < self.config.max_per_subnet_table
        )

    def _count(self, address: str, delta: int) -> None:
        net = self.subnet(address)
        if net is None:
            return
        n = self._subnet_count.get(net, 0) + delta
        if n:
            self._subnet_count[net] = n
        else:
            self._subnet_count.pop(net, None)

    def closest(self, target: int, count: int, exclude: Iterable[PeerId] = ()) -> list[Contact]:
        # Every Find a node answers asks this: skipping the 256 buckets' empty ones, hashing
        # no peer id when nothing is excluded and keeping the `count` nearest instead of
        # sorting all took it from a fifth of a simulated DHT's CPU to a few percent.
        excluded = set(exclude)
        contacts = (c for b in self._buckets if b for c in b.values())
        if excluded:
            contacts = (c for c in contacts if c.peer_id not in excluded)
        return heapq.nsmallest(count, contacts, key=lambda c: c.id ^ target)

    def stale(self, older_than: float) -> list[Contact]:
        """Contacts not heard from since ``older_than`` (monotonic), least recent first."""
        found = [c for b in self._buckets for c in b.values() if c.last_seen < older_than]
        found.sort(key=lambda c: c.last_seen)
        return found

    def refresh_targets(self, older_than: float) -> list[int]:
        """Bucket indices worth a refresh lookup: from our nearest neighbour's bucket outward."""
        nonempty = [i for i, b in enumerate(self._buckets) if b]
        if not nonempty:
            return []
        return [i for i in range(nonempty[0], ID_BITS) if self.touched[i] < older_than]

    def touch(self, target: int) -> None:
        if target != self.own_id:
            self.touched[bucket_index(self.own_id, target)] = self._clock()


@functools.lru_cache(maxsize=1 << 16)
def _subnet(address: str, exempt: tuple[str, ...]) -> str | None:
    """RoutingTable.subnet, parsed once per address: every contact seen, offered or evicted
    asks it, and parsing was a fifth of a simulated 100-node DHT's CPU."""
    try:
        host = parse_address(address).host
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if any(ip in ipaddress.ip_network(net) for net in exempt):
        return None
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
