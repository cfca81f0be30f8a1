"""What a simulated SWARM run is given and what it reports (sim/swarm.py runs it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.sim.network import NetworkConfig


@dataclass(frozen=True)
class SwarmScenario:
    servers: int = 400
    trainers: int = 100
    #: Virtual seconds the run lasts; the first `warmup_s` are not measured.
    duration_s: float = 1800.0
    warmup_s: float = 300.0
    #: Server speeds are log-normal around 1 with this sigma (0.5: the fastest of 400 about
    #: 8x the slowest, as a T4 against a consumer card); trainers have no compute of their own.
    speed_sigma: float = 0.5
    #: Seconds a speed-1 server takes for one stage's forward and backward of a micro-batch.
    stage_s: float = 1.0
    #: Bytes of one hidden state or its gradient on the wire (compressed activations).
    activation_bytes: int = 1 << 20
    #: Bytes a server downloads to take a stage (its parameters and optimiser state).
    stage_bytes: int = 200 << 20
    #: Servers are preempted after an exponential lifetime with this mean (inf: never), and
    #: replaced `downtime_s` later by a new server of a new speed.
    lifetime_s: float = 3600.0
    downtime_s: float = 60.0
    #: Of the run's first servers, this many answer every call x(-20) (never preempted).
    liars: int = 0
    swarm: SwarmConfig = field(default_factory=lambda: SwarmConfig(stages=8, inflight=8))
    network: NetworkConfig = field(default_factory=NetworkConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.servers < self.swarm.stages:
            raise ValueError("a SWARM scenario needs at least one server per stage")
        if self.trainers < 1:
            raise ValueError("a SWARM scenario needs at least one trainer")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("warmup_s must be in [0, duration_s)")
        for name in ("stage_s", "lifetime_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not (self.speed_sigma >= 0 and self.downtime_s >= 0):
            raise ValueError("speed_sigma and downtime_s must be >= 0")
        if not 0 <= self.liars < self.servers:
            raise ValueError("liars must be in [0, servers)")
        if self.activation_bytes < 1 or self.stage_bytes < 0:
            raise ValueError("activation_bytes must be >= 1 and stage_bytes >= 0")


@dataclass(frozen=True)
class SwarmReport:
    stages: int
    servers: int
    trainers: int
    #: Micro-batches completed in the measured window, and the ideal's over the same window.
    done: int
    ideal: float
    #: Micro-batches a trainer gave up (every server of a hop failed it).
    failed: int
    retries: int
    moves: int
    preempted: int
    liars: int
    #: Forward hops repeated on a second server, servers caught by them (each trainer's
    #: catches counted), and measured micro-batches a liar answered a call of.
    audits: int
    caught: int
    poisoned: int
    #: Median seconds from a micro-batch's start to its last backward.
    latency_s: float
    #: The servers' busy time over their speed-weighted live time after the warm-up, per stage
    #: they ended on (1: always computing).
    busy: list[float]
    #: Each stage's total rate at the end, over the mean of them (1: balanced).
    stage_balance: list[float]
    log_hash: str
    wall_s: float

    @property
    def efficiency(self) -> float:
        return self.done / self.ideal if self.ideal > 0 else math.nan


def without_rebalancing(scenario: SwarmScenario) -> SwarmScenario:
    """The same scenario (seed, speeds, preemptions) with servers that never move."""
    return dataclasses.replace(scenario, swarm=dataclasses.replace(scenario.swarm, rebalance_s=0))
