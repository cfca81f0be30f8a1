"""A SWARM peer's protocol timings (part of node/timing.py's TimingProfile): the stage
directory's record lifetimes and refreshes, the trainer's directory reads and waits, a
contested move's wait, a stopping trainer's drain, CheckFree's recovery lease and waits, and
CheckFree+'s copy fetch. Peer-local, unlike the run's `SwarmConfig`: two peers of one run may
hold different ones, within the relations checked here."""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.runtime.seconds import check_seconds


@dataclass(frozen=True)
class SwarmTimings:
    #: A stage record's lifetime without a refresh (directory.py): a dead server leaves the
    #: directory this long after its last refresh.
    record_ttl_s: float = 12.0
    #: How often a server refreshes its record (and reads its stage's others).
    refresh_s: float = 3.0
    #: How old a trainer's read of the directory may be before it reads again.
    directory_ttl_s: float = 2.0
    #: How often a trainer looks again for a stage with no live server.
    wait_poll_s: float = 1.0
    #: How long a trainer waits after a server refused a call for load or rate.
    busy_s: float = 0.05
    #: How long a contested mover waits for its rival to yield (its read and publish, a DHT
    #: round trip each) before reading again.
    contest_wait_s: float = 2.0
    #: How long a trainer's in-flight micro-batches may take to finish once the peer is told
    #: to stop (a stage with no server would hold them forever).
    drain_s: float = 10.0
    #: How long a rebuilder's lease holds a lost stage (a rebuild downloads two stages'
    #: states).
    lease_s: float = 120.0
    #: How long an asker waits for rival askers' lease entries before reading who holds it.
    lease_settle_s: float = 2.0
    #: How long a racer that lost the lease waits for the rebuilt state to be advertised.
    recovery_wait_s: float = 90.0
    #: How often it looks for that state.
    recovery_poll_s: float = 1.0
    #: Longest one server may take to answer a fetch of its copy of an end stage's edge
    #: layers (CheckFree+).
    copy_fetch_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        check_seconds(self, "swarm timing")
        if not self.record_ttl_s >= 2 * self.refresh_s:
            raise ValueError(
                f"record_ttl_s ({self.record_ttl_s}) must be at least two refreshes "
                f"({2 * self.refresh_s} s): one late refresh must not drop a live server"
            )
        if not self.lease_settle_s < self.lease_s:
            raise ValueError("lease_settle_s must be shorter than lease_s")
        if not self.recovery_poll_s <= self.recovery_wait_s:
            raise ValueError("recovery_poll_s must not exceed recovery_wait_s")
