"""What a peer tells its user while it runs: one line per event, text or JSON.

Text goes to stderr for a person; JSON lines go to stdout for scripts, tests and the chaos
harness, which parse the `event` field (a contract: field names are not renamed lightly).
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from swarmd.node.metrics import Metrics, TrainingFigures
from swarmd.node.peer.progress_record import MAX_NOTICE_TEXT, MAX_NOTICES, Notice
from swarmd.node.runtime.jsonlines import print_event

#: Events a peer also publishes in its progress record, for the dashboard's event list (the
#: page's own readings show joins, leaves, moves and rounds; these only the peer knows).
NOTICE_KINDS = frozenset({"peer_banned", "stage_recovered"})


def announce(event: str, **fields: object) -> None:
    """One JSON line on stdout, whatever the log format: how tests and scripts learn
    OS-chosen ports."""
    print_event({"event": event, **fields})


class Progress:
    """Terminal or JSON-lines output of what the peer is doing."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        #: The latest events of NOTICE_KINDS, oldest first.
        self.notices: deque[Notice] = deque(maxlen=MAX_NOTICES)

    def announce(self, event: str, **fields: object) -> None:
        """`announce` (a line scripts wait for), or what stands in for it (the simulator)."""
        announce(event, **fields)

    def event(self, kind: str, text: str, **fields: Any) -> None:
        if kind in NOTICE_KINDS:
            self.notices.append(Notice(round(time.time(), 3), kind, text[:MAX_NOTICE_TEXT]))
        if self.fmt == "json":
            print_event({"event": kind, "time": round(time.time(), 3), **fields})
        else:
            print(f"[swarmd] {text}", file=sys.stderr, flush=True)


@dataclass
class TrainStats:
    """The trainer's latest figures, written by the strategy and read by the progress line."""

    step: int = 0
    round: int = 0
    loss: float = math.nan
    #: Validation loss at the last outer round (or at the start), NaN before it.
    val_loss: float = math.nan
    #: Size of the last outer round's group (1: alone).
    peers: int = 1
    tokens: int = 0
    #: The last outer step's status ("averaged", "local", ...), "-" before the first.
    last_outer: str = "-"
    #: Outer rounds finished, by status (the metrics' swarmd_training_outer_rounds_total).
    outcomes: dict[str, int] = field(default_factory=dict)
    #: The model's parameter count (0 until the strategy has built it): what data-parallel
    #: training would all-reduce every step, for the dashboard's bytes comparison.
    params: int = 0
    #: Streaming DiLoCo: the fragment whose round is on the wire now (None: none).
    in_flight: int | None = None

    def outer_done(self, round_no: int, group_size: int, status: str, val: float | None) -> None:
        """A finished outer round (or fragment round): its number, group, status and the
        validation loss after it (None: not validated this time)."""
        self.round, self.peers, self.last_outer = round_no, group_size, status
        self.outcomes[status] = self.outcomes.get(status, 0) + 1
        if val is not None:
            self.val_loss = val

    def figures(self, wait_s: float) -> TrainingFigures:
        """What the metrics export at a scrape (``wait_s``: the peer's WaitClock)."""
        return TrainingFigures(
            step=self.step,
            round=self.round,
            loss=self.loss,
            val_loss=self.val_loss,
            group_size=self.peers,
            tokens=self.tokens,
            wait_s=wait_s,
            outcomes=dict(self.outcomes),
        )


async def report_progress(
    out: Progress, stats: TrainStats, metrics: Metrics, interval_s: float
) -> None:
    """Every `interval_s`: step, loss, tokens/s since the last line, round and bytes sent."""
    last_tokens, last_time = 0, time.monotonic()
    while True:
        await trio.sleep(interval_s)
        now = time.monotonic()
        tokens_per_s = (stats.tokens - last_tokens) / max(now - last_time, 1e-9)
        last_tokens, last_time = stats.tokens, now
        sent = metrics.sent_total
        out.event(
            "progress",
            f"step {stats.step} loss {stats.loss:.4f} | {tokens_per_s:.0f} tokens/s | "
            f"round {stats.round} ({stats.last_outer}, {stats.peers} peers) | "
            f"sent {sent / 2**20:.1f} MiB",
            step=stats.step,
            loss=stats.loss,
            tokens_per_s=round(tokens_per_s, 1),
            round=stats.round,
            sent_bytes=sent,
        )
