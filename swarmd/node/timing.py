"""Every protocol timing of a peer in one typed profile (issue 45's seam, with the clock,
the transport and the executor): heartbeat and record lifetimes, gather windows, polls,
waits and deadlines.

Each part is the dataclass of the component that owns it, validated there (membership.py,
state_timings.py, matchmaking.py, dht/config.py, algorithms/swarm/timings.py,
algorithms/demo/timings.py); the profile checks the relations between
parts that no one part can see. The peer holds one (`PeerContext.timings`) and each component
reads its part from it, so a simulated or a tuned run changes timings in one place, and a
profile whose timings contradict each other fails when it is made, not as a stall in some
later round.

Not in it: the socket transport's own timeouts (protocol/bulk.py's header, stall and connect
deadlines, the RPC client's bulk-port lookups), which the simulated transport replaces whole,
and SWARM's routing policy (router.py's ban lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.node.algorithms.demo.timings import DemoTimings
from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.dht.config import DHTConfig
from swarmd.node.peer.membership import MembershipTimings
from swarmd.node.peer.state_timings import StateTimings


def _matchmaking() -> MatchmakingConfig:
    # A DiLoCo-family round's gather: 10 s (a peer that finished its inner steps late still
    # makes the round; the group forms as soon as it is whole).
    return MatchmakingConfig(gather_s=10.0)


@dataclass(frozen=True)
class TimingProfile:
    membership: MembershipTimings = field(default_factory=MembershipTimings)
    state: StateTimings = field(default_factory=StateTimings)
    #: The matchmaking's timing fields (gather, commit wait, polls, record lifetime, probe);
    #: its group sizes are the run's (`loop.matchmaking_config`).
    matchmaking: MatchmakingConfig = field(default_factory=_matchmaking)
    #: The DHT's timeouts and upkeep periods (lookups, bootstrap, bucket refresh, republish,
    #: stale contacts), with its routing parameters.
    dht: DHTConfig = field(default_factory=DHTConfig)
    #: SWARM's directory, trainer, move, drain and recovery timings.
    swarm: SwarmTimings = field(default_factory=SwarmTimings)
    #: DeMo's regrouping waits and probes.
    demo: DemoTimings = field(default_factory=DemoTimings)

    def __post_init__(self) -> None:
        mm = self.matchmaking
        formed = mm.gather_s + mm.max_poll_s + mm.probe_s + mm.commit_wait_s
        if not mm.ttl_s > formed:
            raise ValueError(
                f"matchmaking ttl_s ({mm.ttl_s}) must outlast a group's formation (gather, "
                f"last poll, probe and commit wait: {formed} s): announcements that lapse "
                "mid-round drop their peers from it"
            )
