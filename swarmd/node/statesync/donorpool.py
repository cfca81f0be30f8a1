"""A state download's donors as the joiner sees them: which one fetches a chunk, how long to
wait for it, and when to stop asking one.

Kept apart from the download (download.py), which owns the chunks: this is the part that
decides who is asked and for how long, from each donor's measured throughput, round trip and
recent failures. A stalled or lying donor is backed off, then dropped, so it costs a bounded
number of chunk timeouts and never the download.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import trio

from swarmd.node.statesync.config import SyncConfig

log = logging.getLogger("swarmd.statesync")


@dataclass(eq=False)
class Donor:
    address: str
    rtt_s: float = 0.0
    #: Exponential moving average of one stream's throughput from this donor, bytes/s.
    rate: float | None = None
    inflight: int = 0
    failures: int = 0
    busy: int = 0
    backoff_until: float = 0.0
    #: Why this donor is no longer used for this download; None while it is.
    out: str | None = None


class DonorPool:
    """The donors of one download, with their stream slots, throughput and health."""

    def __init__(self, config: SyncConfig) -> None:
        self.cfg = config
        self.donors: list[Donor] = []
        #: Donors each chunk failed on: a refetch goes to another donor when one can take it.
        self.failed_on: dict[int, set[str]] = {}
        self.changed = trio.Event()

    def add(self, address: str, rtt_s: float) -> None:
        self.donors.append(Donor(address, rtt_s=rtt_s))

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _backoff(self, donor: Donor, streak: int) -> None:
        delay = min(self.cfg.backoff_base_s * 2 ** (streak - 1), self.cfg.backoff_max_s)
        donor.backoff_until = trio.current_time() + delay * random.uniform(0.5, 1.0)

    async def pick(self, index: int) -> Donor | None:
        """The donor expected to deliver ``index`` soonest, holding one of its stream slots
        until `release`; waits (bounded) while all are busy. None: no donor is left."""
        while True:
            live = [d for d in self.donors if d.out is None]
            if not live:
                return None
            now = trio.current_time()
            ready = [d for d in live if d.inflight < self.cfg.per_donor and d.backoff_until <= now]
            # A donor that failed is used only while no healthy donor could take the chunk
            # soon: waiting for a busy healthy stream beats another timeout on a stalled donor.
            healthy = [d for d in ready if d.failures == 0]
            healthy_busy = any(
                d.failures == 0 and d.backoff_until <= now and d not in ready for d in live
            )
            pool = healthy or ([] if healthy_busy else ready)
            if pool:
                tried = self.failed_on.get(index, set())
                untried = [d for d in pool if d.address not in tried] or pool
                known = [d.rate for d in self.donors if d.rate]
                default_rate = max(known) if known else 1.0
                best = min(
                    untried,
                    key=lambda d: (d.failures, (d.inflight + 1) / (d.rate or default_rate)),
                )
                best.inflight += 1
                return best
            # Wake when a donor frees a stream slot or when the earliest backoff ends.
            wake = min((d.backoff_until for d in live if d.backoff_until > now), default=math.inf)
            with trio.move_on_at(wake):
                await self.changed.wait()

    def release(self, donor: Donor) -> None:
        """Frees the stream slot `pick` took, waking a `pick` that waits for one."""
        donor.inflight -= 1
        self._notify()

    def timeout(self, donor: Donor, nbytes: int) -> float:
        """How long a chunk of ``nbytes`` from ``donor`` may take: its measured throughput
        (or the best donor's) with slack, before any is measured a fixed bound."""
        rate = donor.rate or max((d.rate for d in self.donors if d.rate), default=None)
        if rate is None:
            return self.cfg.first_chunk_timeout_s
        predicted = nbytes / rate + 2 * donor.rtt_s
        return max(self.cfg.min_chunk_timeout_s, self.cfg.timeout_slack * predicted)

    def delivered(self, donor: Donor, nbytes: int, elapsed_s: float) -> None:
        """A verified chunk: updates the donor's throughput and clears its failure streak."""
        sample = nbytes / max(elapsed_s, 1e-6)
        donor.rate = sample if donor.rate is None else 0.7 * donor.rate + 0.3 * sample
        donor.failures = donor.busy = 0

    def refused(self, donor: Donor) -> None:
        """The donor was busy (serving others): not a failure, but ask it later."""
        donor.busy += 1
        self._backoff(donor, donor.busy)

    def failed(self, donor: Donor, index: int, reason: str, *, drop: bool) -> None:
        """A fetch of ``index`` failed: back the donor off, or drop it when it misbehaved
        (``drop``) or failed too often in a row."""
        self.failed_on.setdefault(index, set()).add(donor.address)
        donor.failures += 1
        if drop or donor.failures >= self.cfg.max_donor_failures:
            if donor.out is None:
                donor.out = reason
                log.warning("state sync: dropping donor %s: %s", donor.address, reason)
        else:
            self._backoff(donor, donor.failures)
