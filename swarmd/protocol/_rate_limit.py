"""Request rates a server answers: token buckets per source address and per verified peer.

Why two keys: a peer id is free to mint, so a bucket per identity alone lets one machine
cycling fresh keys through it go unbounded; a bucket per address alone puts every volunteer
behind one home router (or every test process on 127.0.0.1) in one bucket. So both: the
address's bucket is large (a household of peers, a machine running many), the peer's small
(one honest peer's busiest pattern with room to spare: measured in docs/architecture.md).

The address's bucket is drawn before the signature is checked (verifying costs CPU a flood
should not get for free); the peer's only after it, so nobody can drain an honest peer's
bucket by naming it. IPv6 addresses count by their /64, which one subscriber usually holds
whole. Buckets are kept for at most ``max_tracked`` keys (least recently used dropped): a
flood of identities must not become a flood of buckets.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from swarmd.protocol.address import address_key


@dataclass(frozen=True)
class RateLimits:
    """Requests per second a server answers, and the bursts it allows, per key."""

    per_peer_rate: float = 100.0
    per_peer_burst: float = 200.0
    per_address_rate: float = 500.0
    per_address_burst: float = 2000.0
    #: Keys (peers and addresses together) whose buckets are remembered.
    max_tracked: int = 65536
    #: False turns the limits off (a benchmark of the transport itself).
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("per_peer_rate", "per_peer_burst", "per_address_rate", "per_address_burst"):
            value = getattr(self, name)
            if not value >= 1:  # also refuses NaN
                raise ValueError(f"RateLimits.{name} must be >= 1, got {value}")
        if self.per_peer_rate > self.per_address_rate:
            raise ValueError("RateLimits: a peer's rate cannot exceed its address's")
        if self.max_tracked < 1:
            raise ValueError("RateLimits.max_tracked must be positive")


class _Bucket:
    __slots__ = ("low", "stamp", "tokens")

    def __init__(self, burst: float, now: float) -> None:
        self.tokens, self.stamp, self.low = burst, now, burst


class RateLimiter:
    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        #: The most of a burst any one key has used (0..1): how near honest traffic comes.
        self.peak_use: dict[str, float] = {"peer": 0.0, "address": 0.0}

    def allow_address(self, peer: str) -> bool:
        return self.address_wait(peer) == 0.0

    def allow_peer(self, peer_id: str) -> bool:
        return self.peer_wait(peer_id) == 0.0

    def address_wait(self, peer: str) -> float:
        """Takes a token from the address's bucket: 0.0, or the seconds until it holds one
        (the refused call's wait, which an honest client honours before calling again)."""
        limits = self.limits
        key = "a:" + address_key(peer)
        return self._take(key, "address", limits.per_address_rate, limits.per_address_burst)

    def peer_wait(self, peer_id: str) -> float:
        """As `address_wait`, from the verified peer's bucket."""
        limits = self.limits
        return self._take("p:" + peer_id, "peer", limits.per_peer_rate, limits.per_peer_burst)

    def _take(self, key: str, scope: str, rate: float, burst: float) -> float:
        if not self.limits.enabled:
            return 0.0
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(burst, now)
                if len(self._buckets) > self.limits.max_tracked:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
                bucket.tokens = min(burst, bucket.tokens + (now - bucket.stamp) * rate)
                bucket.stamp = now
            if bucket.tokens < 1:
                self.peak_use[scope] = 1.0
                return (1 - bucket.tokens) / rate
            bucket.tokens -= 1
            if bucket.tokens < bucket.low:
                bucket.low = bucket.tokens
                self.peak_use[scope] = max(self.peak_use[scope], 1 - bucket.low / burst)
            return 0.0
