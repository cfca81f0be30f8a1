"""Publishing this peer's progress record to the DHT, for `swarmd dashboard`.

A separate loop from the progress line (progress.py) so that a slow DHT store never delays
what the user reads; it keeps the same pace (--progress-interval). Each record is stored once
(no republishing) with a short lifetime: a peer that stops publishing drops off the dashboard
by itself, and one that keeps training overwrites its record every interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import trio

from swarmd.node.dht import DHTNode, RecordError
from swarmd.node.metrics import Metrics
from swarmd.node.peer.progress import TrainStats
from swarmd.node.peer.progress_record import (
    MAX_NOTICES,
    Notice,
    ProgressRecord,
    optional_loss,
)
from swarmd.node.runkeys import progress_key

log = logging.getLogger(__name__)

#: The shortest lifetime of a record: a few missed refreshes must not blank the dashboard.
MIN_PROGRESS_TTL_S = 15.0


def progress_ttl(interval_s: float) -> float:
    """A record's lifetime: three refresh intervals, at least MIN_PROGRESS_TTL_S."""
    return max(MIN_PROGRESS_TTL_S, 3.0 * interval_s)


@dataclass(frozen=True)
class PeerFacts:
    """What a peer says about itself that does not change while it runs."""

    run: str
    algo: str
    device: str
    #: --public-name, "" when the user gave none.
    name: str


def make_record(
    facts: PeerFacts,
    stats: TrainStats,
    metrics: Metrics,
    tokens_per_s: float,
    notices: Iterable[Notice] = (),
) -> ProgressRecord:
    return ProgressRecord(
        step=stats.step,
        round=stats.round,
        loss=optional_loss(stats.loss),
        val_loss=optional_loss(stats.val_loss),
        tokens_per_s=round(max(tokens_per_s, 0.0), 1),
        device=facts.device,
        name=facts.name,
        sent_bytes=metrics.sent_total,
        received_bytes=metrics.received_total,
        group_size=stats.peers,
        last_outer=stats.last_outer[:64],
        algo=facts.algo,
        params=stats.params,
        in_flight=stats.in_flight,
        notices=tuple(notices)[-MAX_NOTICES:],
    )


async def publish_progress(
    dht: DHTNode,
    facts: PeerFacts,
    stats: TrainStats,
    metrics: Metrics,
    interval_s: float,
    notices: Iterable[Notice] = (),
) -> None:
    """Stores this peer's record now and every ``interval_s`` until cancelled."""
    ttl = progress_ttl(interval_s)
    last_tokens, last_time = stats.tokens, time.monotonic()
    while True:
        now = time.monotonic()
        rate = (stats.tokens - last_tokens) / max(now - last_time, 1e-9)
        last_tokens, last_time = stats.tokens, now
        record = make_record(facts, stats, metrics, rate, notices)
        # Bounded: a store that hangs on unreachable nodes is skipped, not queued behind.
        with trio.move_on_after(max(interval_s, 5.0)):
            try:
                await dht.store(
                    progress_key(facts.run),
                    record.to_bytes(),
                    dht.now() + ttl,
                    str(dht.peer_id),
                    republish=False,
                )
            except RecordError as exc:
                log.info("could not publish the progress record: %s", exc)
        await trio.sleep(interval_s)
