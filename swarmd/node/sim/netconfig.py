"""The simulated network's model: link round trips, loss, bandwidth, default deadline,
clock skew and servers' rate limits (sim/network.py carries the calls under it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.protocol import rpc


@dataclass(frozen=True)
class NetworkConfig:
    """The network model: every link's round-trip time is drawn once per (pair, seed) from a
    log-uniform distribution between ``rtt_min_s`` and ``rtt_max_s`` (the spread of home links
    across continents); each message is lost with probability ``loss``."""

    rtt_min_s: float = 0.010
    rtt_max_s: float = 0.300
    loss: float = 0.0
    #: Every host's uplink and downlink, bytes/s (a host may be given its own).
    up_bytes_s: float = 12.5e6
    down_bytes_s: float = 12.5e6
    #: The longest a call waits when no deadline is given (RpcClient's default).
    default_deadline_s: float = 30.0
    #: Each host's wall clock is off by a draw from [-clock_skew_s, clock_skew_s] (per host
    #: and seed): request timestamps and record expiry read it, virtual time does not.
    clock_skew_s: float = 0.0
    #: Every host's server-side rate limits (a daemon's defaults; a table in a scenario file).
    rate_limits: rpc.RateLimits = field(default_factory=rpc.RateLimits)

    def __post_init__(self) -> None:
        if isinstance(self.rate_limits, dict):
            object.__setattr__(self, "rate_limits", rpc.RateLimits(**self.rate_limits))
        if not 0 < self.rtt_min_s <= self.rtt_max_s:
            raise ValueError("NetworkConfig needs 0 < rtt_min_s <= rtt_max_s")
        if not 0 <= self.loss < 1:
            raise ValueError("NetworkConfig.loss is a probability below 1")
        if not (self.up_bytes_s > 0 and self.down_bytes_s > 0):
            raise ValueError("NetworkConfig bandwidths must be positive")
        if not self.default_deadline_s > 0:
            raise ValueError("NetworkConfig.default_deadline_s must be positive")
        if not self.clock_skew_s >= 0:
            raise ValueError("NetworkConfig.clock_skew_s must be >= 0")
