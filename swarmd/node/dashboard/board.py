"""What the dashboard knows of a run over time: the latest reading, bounded history, events.

Each poll's Reading is folded in by `update`; the JSON API reads the `*_json` views. Every
collection is bounded (peers tracked, rounds and time points kept, events), so a long run or
a flood of short-lived peer ids costs the dashboard a fixed amount of memory.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from swarmd.node.dashboard.reading import Reading
from swarmd.node.peer.progress_record import ProgressRecord

#: Peers remembered (live and gone); the longest-gone are forgotten first.
MAX_PEERS = 256
#: Rounds of validation loss and group size kept, and time points of swarm tokens/s.
MAX_ROUNDS = 500
MAX_TIME_POINTS = 900
MAX_EVENTS = 200
#: Outer-round outcomes worth an event (an averaged round is the normal case).
_NOTABLE = frozenset({"local", "alone", "partial", "deferred", "carried", "failed"})
#: The event kind on the board of each notice kind a peer publishes (others are not shown).
_NOTICE_EVENTS = {"peer_banned": "ban", "stage_recovered": "recovery"}
#: Rounds a peer may claim beyond the run's (`Board.anchor_round`) and still be charted: a
#: peer is at most a round ahead of another between their outer steps.
ROUND_SLACK = 2
#: Events one peer may hold on the board at once, and "joined" events one poll may add (more
#: are folded into one): 60 throwaway identities once filled all 200 slots (issue 47).
MAX_EVENTS_PER_PEER = 8
MAX_JOINS_PER_POLL = 8


@dataclass
class PeerView:
    """One peer as the table shows it."""

    peer_id: str
    first_seen: float
    last_seen: float
    live: bool = True
    address: str = ""
    record: ProgressRecord | None = None
    advert_round: int | None = None
    state_hash: str | None = None
    #: Bytes this peer sent per inner step between its last two records (None: not yet).
    bytes_per_step: float | None = None
    #: The time of the newest notice of this peer already on the board.
    notice_seen: float = 0.0


def ddp_bytes_per_step(params: int, peers: int) -> float:
    """What each of `peers` data-parallel workers sends a step: a ring all-reduce of fp32
    gradients, 2 (n - 1) / n x 4 bytes a parameter (the benchmarks' DDP baseline)."""
    n = max(peers, 2)
    return 2 * (n - 1) / n * 4 * params


class Board:
    """The run's state for the page; `update` is its only writer."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.reading = Reading()
        self.polls = 0
        self.updated_at: float | None = None
        self.poll_error = ""
        self.peers: dict[str, PeerView] = {}
        #: round -> peer -> validation loss that peer reported at that round.
        self.losses: dict[int, dict[str, float]] = {}
        #: round -> the largest group a peer reported for it.
        self.groups: dict[int, int] = {}
        #: (unix time, the live peers' tokens/s summed).
        self.tokens: deque[tuple[float, float]] = deque(maxlen=MAX_TIME_POINTS)
        #: (unix time, the live peers' mean bytes sent a step, what data-parallel training of
        #: the same model by as many peers would send a step).
        self.bytes: deque[tuple[float, float, float]] = deque(maxlen=MAX_TIME_POINTS)
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        #: SWARM: the stage each server was last seen serving, and the stages seen unserved.
        self.stage_of: dict[str, int] = {}
        self.unserved: set[int] = set()
        #: The peers that came live in the poll being folded in (`_joined`), and the run's
        #: round as this poll trusts it (`anchor_round`).
        self._joins: list[str] = []
        self._anchor: int | None = None

    def event(self, kind: str, text: str, peer: str | None = None, at: float | None = None) -> None:
        if peer is not None and sum(e["peer"] == peer for e in self.events) >= MAX_EVENTS_PER_PEER:
            return
        self.events.append(
            {"time": round(at or time.time(), 3), "kind": kind, "text": text, "peer": peer}
        )

    def failed_poll(self, reason: str) -> None:
        self.poll_error = reason[:500]

    def update(self, reading: Reading, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.reading.run is None and reading.run is not None:
            self.event("run", f"run config found (hash {reading.run.config_hash})", at=now)
        self.reading, self.polls, self.updated_at, self.poll_error = (
            reading,
            self.polls + 1,
            now,
            "",
        )
        self._joins, self._anchor = [], self._anchor_of(reading)
        seen = reading.heartbeats.keys() | reading.progress.keys()
        for peer_id in seen:
            self._see(peer_id, reading, now)
        self._joined(reading, now)
        for peer_id in seen:
            self._take(peer_id, reading, now)
        for view in self.peers.values():
            if view.live and view.peer_id not in reading.heartbeats:
                view.live = False
                self.event("left", f"{self.label(view)} left (no heartbeat)", view.peer_id, now)
        self._forget_oldest()
        self._see_stages(reading, now)
        live = [v.record for v in self.peers.values() if v.live and v.record is not None]
        if live:
            self.tokens.append((round(now, 3), round(sum(r.tokens_per_s for r in live), 1)))
        self._sample_bytes(now)

    def stage_count(self) -> int:
        """A SWARM run's stages: its config's, else as many as its servers name."""
        info = self.reading.run
        configured = info.fields.get("swarm_stages") if info is not None else None
        named = max((r.stage + 1 for r in self.reading.stages.values()), default=0)
        algo = info.fields.get("algo") if info is not None else None
        if isinstance(configured, int) and algo == "swarm":
            return max(1, min(configured, 64))
        return named

    def _see_stages(self, reading: Reading, now: float) -> None:
        """Events for SWARM's moves, and for a stage left with no server (a stage with none
        stops every trainer) and served again (its recovery)."""
        for peer_id, record in reading.stages.items():
            old = self.stage_of.get(peer_id)
            if old is not None and old != record.stage:
                label = self.label_of(
                    peer_id, self.peers[peer_id].record if peer_id in self.peers else None
                )
                self.event(
                    "moved", f"{label} moved from stage {old} to stage {record.stage}", peer_id, now
                )
            self.stage_of[peer_id] = record.stage
        for peer_id in list(self.stage_of):
            if peer_id not in reading.stages and peer_id not in self.peers:
                del self.stage_of[peer_id]  # bounded by the peers remembered
        if not reading.stages:
            return
        served = {r.stage for r in reading.stages.values() if r.state == "serving"}
        for stage in range(self.stage_count()):
            if stage not in served and stage not in self.unserved:
                self.unserved.add(stage)
                self.event("stage", f"stage {stage} has no server: trainers wait", at=now)
            elif stage in served and stage in self.unserved:
                self.unserved.discard(stage)
                self.event("stage", f"stage {stage} is served again", at=now)

    def _sample_bytes(self, now: float) -> None:
        live = [v for v in self.peers.values() if v.live and v.record is not None]
        rates = [v.bytes_per_step for v in live if v.bytes_per_step is not None]
        params = max((v.record.params for v in live if v.record is not None), default=0)
        if rates and params:
            ddp = ddp_bytes_per_step(params, len(live))
            self.bytes.append((round(now, 3), round(sum(rates) / len(rates), 1), round(ddp, 1)))

    def _see(self, peer_id: str, reading: Reading, now: float) -> None:
        view = self.peers.get(peer_id)
        beating = peer_id in reading.heartbeats
        if view is None:
            view = self.peers[peer_id] = PeerView(peer_id, first_seen=now, last_seen=now)
            view.live = False
        if beating:
            view.last_seen, view.address = now, reading.heartbeats[peer_id]
            if not view.live:
                view.live = True
                self._joins.append(peer_id)

    def _take(self, peer_id: str, reading: Reading, now: float) -> None:
        """A seen peer's record and advert (after the poll's "joined" events)."""
        view = self.peers[peer_id]
        record = reading.progress.get(peer_id)
        if record is not None:
            self._record(view, record, now)
        advert = reading.adverts.get(peer_id)
        if advert is not None:
            view.advert_round, view.state_hash = advert.round, advert.state_hash

    def _joined(self, reading: Reading, now: float) -> None:
        """This poll's "joined" events: one each up to MAX_JOINS_PER_POLL, then one for the
        rest."""
        verb = "is in the run" if self.polls == 1 else "joined"
        for peer_id in sorted(self._joins)[:MAX_JOINS_PER_POLL]:
            record = reading.progress.get(peer_id) or self.peers[peer_id].record
            self.event("joined", f"{self.label_of(peer_id, record)} {verb}", peer_id, now)
        rest = len(self._joins) - MAX_JOINS_PER_POLL
        if rest > 0:
            self.event(
                "joined",
                f"{rest} more peers {'are in the run' if self.polls == 1 else 'joined'}",
                at=now,
            )

    def anchor_round(self) -> int | None:
        """The run's round as the board trusts it (computed once per poll, `_anchor_of`)."""
        return self._anchor

    def _anchor_of(self, reading: Reading) -> int | None:
        """The run's round as the board trusts it: the creator's (the key that published the
        run's config) while it advertises a state, else the median of the live peers'
        advertised rounds. Rounds are self-declared: 60 throwaway identities claiming
        2^63 - 1 once set the page's round, emptied its loss chart and made the honest
        peers' agreeing states show as differing (issue 47). Without the creator, a
        majority of such identities still moves the median."""
        creator = reading.run.creator if reading.run is not None else None
        if creator is not None and creator in reading.adverts and creator in reading.heartbeats:
            return reading.adverts[creator].round
        rounds = sorted(a.round for p, a in reading.adverts.items() if p in reading.heartbeats)
        return rounds[(len(rounds) - 1) // 2] if rounds else None

    def plausible(self, round_no: int) -> bool:
        """Whether a round a peer claims is within ROUND_SLACK of the run's."""
        anchor = self.anchor_round()
        return anchor is None or round_no <= anchor + ROUND_SLACK

    def _record(self, view: PeerView, record: ProgressRecord, now: float) -> None:
        old, view.record = view.record, record
        self._notices(view, record, now)
        if not self.plausible(record.round):
            return  # shown in its own row; kept out of the charts and the round's events
        if old is not None and record.step > old.step and record.sent_bytes >= old.sent_bytes:
            view.bytes_per_step = (record.sent_bytes - old.sent_bytes) / (record.step - old.step)
        if record.val_loss is not None:
            self.losses.setdefault(record.round, {})[view.peer_id] = record.val_loss
            while len(self.losses) > MAX_ROUNDS:
                del self.losses[min(self.losses)]
        if record.last_outer == "-":
            return
        self.groups[record.round] = max(self.groups.get(record.round, 0), record.group_size)
        while len(self.groups) > MAX_ROUNDS:
            del self.groups[min(self.groups)]
        new_round = old is None or old.round != record.round
        if new_round and record.last_outer in _NOTABLE:
            self.event(
                "round",
                f"{self.label(view)}: round {record.round} {record.last_outer} "
                f"(group of {record.group_size})",
                view.peer_id,
                now,
            )

    def _notices(self, view: PeerView, record: ProgressRecord, now: float) -> None:
        """The peer's notices not yet on the board, as events at the time they were read (the
        peer's clock orders its own notices only)."""
        for notice in record.notices:
            kind = _NOTICE_EVENTS.get(notice.kind)
            if notice.time <= view.notice_seen or kind is None:
                continue
            view.notice_seen = notice.time
            self.event(kind, f"{self.label(view)}: {notice.text}", view.peer_id, now)

    def _forget_oldest(self) -> None:
        if len(self.peers) <= MAX_PEERS:
            return
        gone = sorted((v for v in self.peers.values() if not v.live), key=lambda v: v.last_seen)
        for view in gone[: len(self.peers) - MAX_PEERS]:
            del self.peers[view.peer_id]

    @staticmethod
    def label_of(peer_id: str, record: ProgressRecord | None) -> str:
        """The peer's --public-name with its short id, or the short id alone."""
        name = record.name if record else ""
        return f"{name} ({peer_id[:10]})" if name else peer_id[:10]

    @staticmethod
    def label(view: PeerView) -> str:
        return Board.label_of(view.peer_id, view.record)

    def agreed_hash(self) -> str | None:
        """The state hash most live peers advertise at the newest round advertised."""
        live = [v for v in self.peers.values() if v.live and v.state_hash is not None]
        if not live:
            return None
        anchor = self.anchor_round()
        newest = anchor if anchor is not None else max(v.advert_round or 0 for v in live)
        counts = Counter(v.state_hash for v in live if v.advert_round == newest)
        return counts.most_common(1)[0][0] if counts else None
