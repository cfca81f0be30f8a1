"""Which server of a stage takes a trainer's next call: SWARM's stochastic wiring.

Each call goes to the server with the smallest expected finish time, estimated as

    (calls this trainer has in flight there + the queue it published + 1) / its rate

with the rate the server measured of its own compute (published in its stage record), or,
once this trainer has timed calls there, what the trainer saw a call take (the network and
the queue it met count too) if that is longer. A timed call already holds the queue it
waited in, so it is a floor on the estimate, never multiplied by the queue: multiplied, one
call that met a queue made its server look (queue + 1) times slower than it was, for as long
as nobody called it again, and trainers crowded the servers they had not yet timed (the
simulator's 40 servers on 4 stages computed 60-63% of what they could; 68-74% with the
floor, same seeds). The estimate is multiplied by a random factor
in [0.8, 1.2] so trainers that read the same directory don't all pick the same server.
A call that failed bans its server for a while (2 s, doubling per failure in a row, at most
60 s), unless every server of the stage is banned, in which case the least recently failed
is tried again (a stage with one server must not be given up for a minute because one call
timed out). SWARM's balancer and Petals' sequence manager are the anchors; unlike SWARM's,
a failure counts in the estimate (a failing server kept its optimistic estimate there) and
retries back off.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.protocol.identity import PeerId

BAN_S = 2.0
MAX_BAN_S = 60.0
BUSY_BAN_S = 0.2
#: Seconds per call assumed for a server that has not published a rate yet.
UNMEASURED_S = 1.0
EMA_ALPHA = 0.3
#: The share of calls sent to a server drawn at random instead of the best estimate: a server
#: timed slow once (a queue, a round's averaging holding its device) was otherwise never called
#: again by this trainer while the others looked faster, and sat idle (seen: one of three
#: stage servers got no micro-batch in 20 of 33 one-second rounds), since only a call updates
#: its timing. Forgetting timings with age instead (half-lives of 5-60 s) cost the simulated
#: pipeline 8-14% of its throughput: far servers' round trips were forgotten too.
EXPLORE = 0.05


@dataclass
class _Server:
    seconds: float | None = None
    inflight: int = 0
    failures: int = 0
    banned_until: float = 0.0
    #: Caught answering unlike the stage's other servers (audit.py): not even a fallback.
    distrusted_until: float = 0.0


@dataclass(frozen=True)
class Choice:
    peer: PeerId
    address: str


class Router:
    """One trainer's view of the servers: what it measured of each, and its bans."""

    def __init__(
        self, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._servers: dict[PeerId, _Server] = {}
        self._rng = rng or random.Random()
        self._clock = clock

    def _of(self, peer: PeerId) -> _Server:
        return self._servers.setdefault(peer, _Server())

    def expected_s(self, peer: PeerId, record: StageRecord) -> float:
        s = self._of(peer)
        own = 1.0 / record.rate if record.rate > 0 else UNMEASURED_S
        return max((s.inflight + record.queue + 1) * own, s.seconds or 0.0)

    def pick(
        self, servers: dict[PeerId, StageRecord], now: float | None = None, *, drawn: bool = False
    ) -> Choice | None:
        """The server for the next call among `servers` (one stage's), or None if none is
        trusted. ``drawn``: any of the open ones at random, not the soonest: an audit's
        opinion. Picked by speed, a fast liar's accomplice, fast too, was the second opinion
        of most of its hops and vouched for its lies (the simulator, seed 6 of the audit
        test: two liars of one stage's eight, 613 of 3,143 Last answers kept were x(-20))."""
        now = self._clock() if now is None else now
        servers = {p: r for p, r in servers.items() if self._of(p).distrusted_until <= now}
        if not servers:
            return None
        open_ = {p: r for p, r in servers.items() if self._of(p).banned_until <= now}
        if not open_:
            peer = min(servers, key=lambda p: self._of(p).banned_until)
            return Choice(peer, servers[peer].address)
        if len(open_) > 1 and (drawn or self._rng.random() < EXPLORE):
            peer = self._rng.choice(sorted(open_, key=lambda p: p.raw))
            return Choice(peer, open_[peer].address)
        best: PeerId | None = None
        best_t = math.inf
        for peer, record in open_.items():
            t = self.expected_s(peer, record) * self._rng.uniform(0.8, 1.2)
            if t < best_t:
                best, best_t = peer, t
        assert best is not None
        return Choice(best, open_[best].address)

    def rest_s(self, peer: PeerId, now: float | None = None) -> float:
        """Seconds until the server's ban ends (0: not banned)."""
        now = self._clock() if now is None else now
        return max(0.0, self._of(peer).banned_until - now)

    def started(self, peer: PeerId) -> None:
        self._of(peer).inflight += 1

    def succeeded(self, peer: PeerId, seconds: float) -> None:
        s = self._of(peer)
        s.inflight -= 1
        s.failures = 0
        s.seconds = seconds if s.seconds is None else s.seconds + EMA_ALPHA * (seconds - s.seconds)

    def released(self, peer: PeerId) -> None:
        """A call ended without telling anything of the server (it refused the input)."""
        self._of(peer).inflight -= 1

    def busy(self, peer: PeerId, now: float | None = None) -> None:
        """The server refused a call for load or rate (nothing computed): it is passed over
        for BUSY_BAN_S, without counting as a failure."""
        now = self._clock() if now is None else now
        s = self._of(peer)
        s.inflight -= 1
        s.banned_until = max(s.banned_until, now + BUSY_BAN_S)

    def distrust(self, peer: PeerId, seconds: float, now: float | None = None) -> None:
        """Leaves `peer` out for `seconds`, even when its stage has no other server (a stage
        served only by a liar is a stage with no server)."""
        now = self._clock() if now is None else now
        s = self._of(peer)
        s.distrusted_until = max(s.distrusted_until, now + seconds)

    def failed(self, peer: PeerId, now: float | None = None) -> float:
        """Bans the server after a failed call; returns the ban's length."""
        now = self._clock() if now is None else now
        s = self._of(peer)
        s.inflight -= 1
        s.failures += 1
        ban = min(BAN_S * 2.0 ** min(s.failures - 1, 16), MAX_BAN_S)
        s.banned_until = now + ban
        return ban
