"""Who is in the run: this peer's heartbeat, and how many peers' heartbeats are live.

Every strategy needs both: the heartbeat makes the peer count in others' groups, and the live
count is the group size a round waits for (a small run must not sit out the whole gather
deadline waiting for a configured maximum that will never come).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass

import trio

from swarmd.node.averaging.attendance import Attendance, Gathered
from swarmd.node.dht import DHTNode, KeyReader
from swarmd.node.peer.runconfig import RunConfig, peers_key
from swarmd.node.runkeys import CLIENT_MARK
from swarmd.protocol.identity import PeerId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MembershipTimings:
    """The heartbeat's timings (part of node/timing.py's profile)."""

    #: A heartbeat record's lifetime: a peer that stops refreshing it is gone after this long.
    heartbeat_ttl_s: float = 30.0
    #: How stale the count of live peers may be once it reaches the run's target group size.
    live_max_age_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.live_max_age_s < self.heartbeat_ttl_s:
            raise ValueError(
                "need 0 < live_max_age_s < heartbeat_ttl_s: a count older than a heartbeat's "
                f"life counts peers gone since (got {self.live_max_age_s}, "
                f"{self.heartbeat_ttl_s})"
            )


async def heartbeat(
    dht: DHTNode,
    config: RunConfig,
    address: str,
    client: bool = False,
    timings: MembershipTimings = MembershipTimings(),
) -> None:
    """Announces this peer under the run's peers key until cancelled (the record then lapses).
    A client-mode peer says so: others cannot probe it, and must not take it for dead."""
    value = address + CLIENT_MARK * client
    async with dht.announce(peers_key(config.name), value.encode(), ttl=timings.heartbeat_ttl_s):
        await trio.sleep_forever()


class LivePeers:
    """The count of the run's live heartbeats, re-read only when it could matter."""

    def __init__(
        self, dht: DHTNode, config: RunConfig, timings: MembershipTimings = MembershipTimings()
    ) -> None:
        self._dht = dht
        self._config = config
        self._timings = timings
        #: (trio time, live peer -> the address its heartbeat names) at the last read.
        self._last: tuple[float, dict[PeerId, str]] = (-math.inf, {})
        self._reader: KeyReader | None = None
        #: Live peers that did not come to rounds that counted them: not waited for a while.
        self.attendance = Attendance()
        self._counted: Collection[PeerId] = ()

    async def count(self) -> int:
        return len(await self.addresses())

    async def addresses(self, fresh: bool = False) -> dict[PeerId, str]:
        """The run's live heartbeats: peer -> the address it names (`is_client` tells a
        client-mode peer's). Their count is the group size a round waits for.

        Read before every round while it is below the run's target group size (a joiner must
        be waited for at once), but at most every `live_max_age_s` once it reaches it:
        more peers cannot raise the target then, and a departure shows within the heartbeat's
        30 s anyway. Each read is a few KB (every heartbeat record, from three nodes), paid
        in every streaming fragment round's peak otherwise. ``fresh``: read now whatever
        the count (a grid round plans its groups from the roster: peers holding views of
        different ages plan different grids, and their round forks).
        """
        at, ids = self._last
        # trio's clock, not the OS's: under the simulator's virtual time the count ages as
        # the simulated run does.
        recent = trio.current_time() - at < self._timings.live_max_age_s
        if fresh or not (recent and len(ids) >= self._config.target_group_size):
            if self._reader is None:
                # Re-reads transfer only heartbeats (refreshes, withdrawals) not read before.
                self._reader = self._dht.reader(peers_key(self._config.name))
            ids = {
                p: v.value.decode(errors="replace") for p, v in (await self._reader.peers()).items()
            }
            self._last = (trio.current_time(), ids)
        return ids

    async def group_target(
        self, gone: Collection[PeerId] = (), fresh: bool = False
    ) -> tuple[int, int]:
        """(live peers, the group size to wait for): as many as are alive and not absent
        (attendance.py), within the run's min and target group sizes. ``gone``: peers known
        dead although their heartbeat has not lapsed yet (dropped from a group for not
        answering), not waited for. ``fresh``: see `addresses`."""
        ids = (await self.addresses(fresh)).keys() - set(gone)
        self._counted = ids
        config = self._config
        return len(ids), self.attendance.target(
            ids, config.min_group_size, config.target_group_size
        )

    def expected(self) -> int:
        """How many of the peers the last group_target counted are waited for (attendance.py),
        uncapped: a grid round's roll call waits for all of them."""
        return self.attendance.expected(self._counted)

    def gathering(self) -> Gathered:
        """What the coming round's gathering is told: the peers the last group_target
        counted but excused (each that comes anyway is waited for with the others)."""
        return self.attendance.gathering(self._counted, self._config.target_group_size)

    def came(self, key: str, gathered: Gathered) -> None:
        """Accounts a round's gathering against the peers the last group_target counted."""
        newly = self.attendance.record(self._counted, gathered)
        if newly:
            log.info(
                "round %s: not waiting again for %d live peer(s) that never came: %s",
                key,
                len(newly),
                ", ".join(sorted(p.short() for p in newly)),
            )
