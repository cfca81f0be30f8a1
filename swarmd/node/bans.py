"""Bans: a peer that sent this peer provably bad data is refused for a while, longer each time.

Evidence is only ever what a peer sent, checked by this peer: values that are not finite,
the wrong size, bytes that do not decode, an impossible declared weight, a reduced part whose
proof does not hold, a state chunk whose hash is not the manifest's. How the network behaved
(a timeout, a reset, a straggler's late nonce) is never evidence, so a ban cannot lock out an
honest peer on a bad link. Rejections that an honest peer can earn (a norm or a weight far
from the group's: a peer with more local ranks, or one that joined late) are strikes, which ban
only when `strikes` is set (off by default: see BanConfig).

A ban refuses the peer's contributions to parts this peer reduces (without waiting for them)
and keeps this peer from downloading its state. The peer stays in groups: bans are each peer's
own verdict, and leaving it out of groups split honest peers that had not banned it. Bans are
not gossiped, so a liar cannot get honest peers banned by accusing them (what a run-wide,
creator-signed ban would add is issue 28's). Bans last `first_s`, then `growth` times longer
on each repeat, up to `max_s`; they are kept in memory only (a restart forgives).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.bans")

#: What a peer did, as metric labels. The first five prove a fault; "outlier" is a strike.
Offence = Literal["non_finite", "bad_size", "undecodable", "bad_weight", "false_data", "outlier"]
HARD: frozenset[Offence] = frozenset(
    ("non_finite", "bad_size", "undecodable", "bad_weight", "false_data")
)


class Rejection(str):
    """Why something a peer sent was refused (it reads as the reason), and what that proves."""

    offence: Offence

    def __new__(cls, why: str, offence: Offence) -> Rejection:
        obj = super().__new__(cls, why)
        obj.offence = offence
        return obj


class BanObserver(Protocol):
    def on_ban(self, offence: str) -> None: ...


@dataclass(frozen=True)
class BanConfig:
    first_s: float = 60.0
    growth: float = 4.0
    max_s: float = 24 * 3600.0
    #: Outliers that make a ban within the window; 0 (the default): outliers never ban. An
    #: honest peer can be a steady outlier (a late joiner: a tiny update next to which every
    #: part looks huge; a heavy weight is clipped, not an outlier), and one round's
    #: sub-groups would count it several times; until outliers are judged against robust
    #: statistics of the run (issue 28), only evidence bans.
    strikes: int = 0
    strike_window_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError("need 0 < first_s <= max_s")
        if self.growth < 1:
            raise ValueError("growth must be >= 1")
        if self.strikes < 0 or self.strike_window_s <= 0:
            raise ValueError("strikes must be >= 0 and strike_window_s > 0")


@dataclass
class _Record:
    bans: int = 0
    until: float = 0.0
    reason: str = ""
    #: (when, episode) of each strike still in the window.
    strikes: list[tuple[float, str]] = field(default_factory=list)


class Bans:
    """This peer's bans; safe to call from worker threads (decoding runs in them)."""

    def __init__(
        self,
        config: BanConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: BanObserver | None = None,
        on_ban: Callable[[PeerId, float, Rejection], None] | None = None,
        own: PeerId | None = None,
    ) -> None:
        self.config = config or BanConfig()
        #: This peer: never banned by itself (a reducer checks its own contribution too, and
        #: a peer whose own update is refused has nothing to refuse itself from).
        self.own = own
        self._clock, self._observer, self._on_ban = clock, observer, on_ban
        self._records: dict[PeerId, _Record] = {}
        self._lock = threading.Lock()

    def banned(self, peer: PeerId) -> bool:
        with self._lock:
            rec = self._records.get(peer)
            return rec is not None and rec.until > self._clock()

    def reason(self, peer: PeerId) -> str:
        with self._lock:
            rec = self._records.get(peer)
            return rec.reason if rec is not None and rec.until > self._clock() else ""

    def active(self) -> int:
        now = self._clock()
        with self._lock:
            return sum(1 for rec in self._records.values() if rec.until > now)

    def offence(self, peer: PeerId, why: Rejection, context: str = "", episode: str = "") -> float:
        """Records what ``peer`` did; the ban's seconds if it is (now) banned, else 0. Strikes
        with the same ``episode`` (a round: its reducer and its members may all see one bad
        update) count once."""
        cfg, now = self.config, self._clock()
        if peer == self.own:
            return 0.0
        with self._lock:
            rec = self._records.setdefault(peer, _Record())
            if rec.until > now:
                return rec.until - now  # already banned: one ban per episode
            if why.offence not in HARD:
                if cfg.strikes == 0:
                    return 0.0
                rec.strikes = [s for s in rec.strikes if s[0] > now - cfg.strike_window_s]
                if episode and any(e == episode for _, e in rec.strikes):
                    return 0.0
                rec.strikes.append((now, episode))
                if len(rec.strikes) < cfg.strikes:
                    return 0.0
            rec.strikes.clear()
            seconds = min(cfg.max_s, cfg.first_s * cfg.growth**rec.bans)
            rec.bans += 1
            rec.until = now + seconds
            rec.reason = str(why)
            count = rec.bans
        # The evidence a run owner (or a reviewer of this peer's verdict) needs.
        log.warning(
            "banned peer %s for %.0f s (ban %d, %s): %s%s",
            peer.short(),
            seconds,
            count,
            why.offence,
            why,
            f" ({context})" if context else "",
        )
        if self._observer is not None:
            self._observer.on_ban(why.offence)
        if self._on_ban is not None:
            self._on_ban(peer, seconds, why)
        return seconds
