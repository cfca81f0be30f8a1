"""What a DHT node is tuned by: replication, parallelism, timeouts, upkeep periods, limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.node.dht.caller import TimeoutPolicy
from swarmd.node.dht.routing import RoutingConfig
from swarmd.node.dht.service import ServiceLimits
from swarmd.node.dht.storage import StorageLimits


@dataclass(frozen=True)
class DHTConfig:
    #: Bucket size, and how many nodes a read's lookup keeps in its shortlist.
    k: int = 20
    #: How many of the nodes closest to a key a store puts a record on (and its node lookup
    #: waits to hear from, in a network larger than k). A store waits for the slowest of them
    #: twice (its lookup, then its Stores), so on a loaded machine its time follows this
    #: count: on 64 processes of this 2-core machine, 20 replicas took 61 ms, 8 took 52-64 ms
    #: against hivemind's 47-55 ms for its 5, and 5 took 38-41 ms against hivemind's 66-76 ms
    #: alternating later that hour (`benchmarks/dht.py`, 2026-11-30; the VM's speed drifts
    #: within an hour, so only alternating runs compare). Five, as hivemind: 1,000 simulated
    #: nodes with 30% killed at once still found 999 and 996 of 1,000 keys (seeds 0, 1; with
    #: 8: 999 and 1,000), with 8% fewer calls. At most k (a larger value stores on k).
    replicas: int = 5
    #: Requests in flight per lookup.
    alpha: int = 3
    #: A get may stop once this many of the closest nodes answered and records were found.
    get_quorum: int = 3
    lookup_timeout_s: float = 5.0
    bootstrap_timeout_s: float = 5.0
    #: Buckets not used by a lookup for this long are refreshed with a random lookup. Ten
    #: minutes, as libp2p's Kademlia (the paper: an hour; BitTorrent's BEP 5: 15 minutes): at
    #: one minute, refreshes were over half of a simulated 64-peer DiLoCo run's DHT calls
    #: (76 Finds a peer-round of 117), for contacts that calls keep fresh anyway. A node with
    #: an empty table rejoins within seconds whatever this is.
    refresh_interval_s: float = 600.0
    #: Own records are re-stored to the (current) closest nodes this often while live.
    republish_interval_s: float = 60.0
    #: Contacts not heard from for this long are pinged (and evicted if dead).
    stale_after_s: float = 120.0
    timeouts: TimeoutPolicy = field(default_factory=TimeoutPolicy)
    routing: RoutingConfig | None = None
    storage: StorageLimits = field(default_factory=StorageLimits)
    service: ServiceLimits = field(default_factory=ServiceLimits)

    def __post_init__(self) -> None:
        if self.k < 1 or self.alpha < 1 or not 1 <= self.get_quorum <= self.k:
            raise ValueError("DHTConfig needs k >= 1, alpha >= 1 and 1 <= get_quorum <= k")
        if self.replicas < 1:
            raise ValueError("DHTConfig.replicas must be positive")
        for name in (
            "lookup_timeout_s",
            "bootstrap_timeout_s",
            "refresh_interval_s",
            "republish_interval_s",
            "stale_after_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"DHTConfig.{name} must be positive")
        if self.routing is not None and self.routing.k != self.k:
            raise ValueError("DHTConfig.routing.k must equal DHTConfig.k")

    def routing_config(self) -> RoutingConfig:
        return self.routing or RoutingConfig(k=self.k)
