"""A DeMo peer's protocol timings (part of node/timing.py's TimingProfile): how long its
regrouping waits after a group loses members, and how it probes and forgives the gone."""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.runtime.seconds import check_seconds


@dataclass(frozen=True)
class DemoTimings:
    #: How long a live heartbeat's peer has to answer a boundary's probe.
    probe_s: float = 1.0
    #: A peer with no group retries matchmaking with this gather window: shorter than the
    #: group's, so that it comes round again within the window of a group forming meanwhile.
    retry_gather_s: float = 3.0
    #: How long a peer that has been in groups looks for one at a boundary, while others are
    #: live, before it steps alone (a peer that never had one looks until it finds one).
    regroup_wait_s: float = 60.0
    #: A peer taken for gone (it did not answer a probe, or the exchange dropped it) is probed
    #: again after this long: a peer that was only paused or busy (its heartbeat never
    #: lapsed) must be able to come back. Seen under `swarmd chaos`: a peer that missed one
    #: probe was left out of every group for the rest of the run although it kept asking to
    #: join.
    gone_recheck_s: float = 10.0

    def __post_init__(self) -> None:
        check_seconds(self, "DeMo timing")
        if not self.retry_gather_s < self.regroup_wait_s:
            raise ValueError("retry_gather_s must be shorter than regroup_wait_s")
