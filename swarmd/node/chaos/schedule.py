"""A chaos schedule: typed fault events at times, drawn from a seed or read from a JSON file.

Two lanes of faults run side by side, each one fault at a time:

- *disruptive* faults take peers out: SIGKILL (and a restart from the same state directory
  after ``duration_s``), SIGSTOP/SIGCONT (a pause: the process holds its sockets but answers
  nothing, like a machine swapping or a laptop lid), and a network partition that splits the
  peers into two sides for ``duration_s``. At most ``peers - min_group_size`` peers are out at
  once, so the rest can always form a group;
- *degrading* faults make the network bad without taking anyone out: latency with jitter and
  loss, a bandwidth squeeze, a skewed clock (within the transport's 30 s skew bound, so the
  bound itself is exercised, not tripped).

Nothing happens in the first ``warmup_s`` (the run must be training before it is hurt) nor in
the last ``quiet_s`` (every fault is healed and every killed peer back, so the invariants can
demand that the survivors end up agreeing). The same seed gives the same schedule.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from swarmd.node.chaos.byzantine import LIES

FaultKind = Literal[
    "kill", "pause", "partition", "latency", "bandwidth", "clock_skew", "kill_stage", "byzantine"
]
DISRUPTIVE: tuple[FaultKind, ...] = ("kill", "pause", "partition")
DEGRADING: tuple[FaultKind, ...] = ("latency", "bandwidth", "clock_skew")
#: SWARM runs (chaos/swarm.py): every server of a stage killed at once, replaced by new
#: machines after ``duration_s``. Never drawn at random; swarm_schedule places it.
KILL_STAGE: FaultKind = "kill_stage"
#: A peer restarted as a liar (chaos/byzantine.py: `lie`) for ``duration_s``, then restarted
#: honest; drawn in the disruptive lane only with `swarmd chaos --byzantine`.
BYZANTINE: FaultKind = "byzantine"
KINDS: tuple[FaultKind, ...] = DISRUPTIVE + DEGRADING + (KILL_STAGE, BYZANTINE)
#: What a random schedule draws unless told otherwise.
DEFAULT_KINDS: tuple[FaultKind, ...] = DISRUPTIVE + DEGRADING


class ScheduleError(ValueError):
    """A schedule is malformed or cannot be applied to this many peers."""


@dataclass(frozen=True)
class FaultEvent:
    """One fault: starts ``at_s`` seconds into the run, lasts ``duration_s``, hits ``peers``
    (indices). For a partition, ``peers`` is the minority side; the rest is the other."""

    at_s: float
    kind: FaultKind
    peers: tuple[int, ...]
    duration_s: float
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    bandwidth_bytes_s: float = 0.0
    clock_skew_s: float = 0.0
    #: byzantine: what the peer lies about (chaos/byzantine.py LIES).
    lie: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown fault kind {self.kind!r}; expected one of {KINDS}")
        if not self.at_s >= 0 or not self.duration_s > 0:
            raise ScheduleError(f"{self.kind}: needs at_s >= 0 and duration_s > 0")
        if not self.peers or len(set(self.peers)) != len(self.peers) or min(self.peers) < 0:
            raise ScheduleError(f"{self.kind}: peers must be distinct indices >= 0")
        if self.kind == "latency" and not (
            self.latency_ms > 0 and 0 <= self.jitter_ms <= self.latency_ms and 0 <= self.loss < 1
        ):
            raise ScheduleError("latency: needs latency_ms > 0, 0 <= jitter <= latency, loss < 1")
        if self.kind == "bandwidth" and not self.bandwidth_bytes_s > 0:
            raise ScheduleError("bandwidth: needs bandwidth_bytes_s > 0")
        if self.kind == "clock_skew" and self.clock_skew_s == 0:
            raise ScheduleError("clock_skew: needs clock_skew_s != 0")
        if (self.kind == BYZANTINE) != (self.lie in LIES):
            raise ScheduleError(f"byzantine faults (only) need lie: one of {', '.join(LIES)}")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    @property
    def disruptive(self) -> bool:
        return self.kind in DISRUPTIVE or self.kind in (KILL_STAGE, BYZANTINE)

    def describe(self) -> str:
        who = ",".join(f"peer{i}" for i in self.peers)
        extra = {
            "latency": f" {self.latency_ms:.0f}±{self.jitter_ms:.0f} ms, loss {self.loss:.0%}",
            "bandwidth": f" {self.bandwidth_bytes_s / 1e3:.0f} kB/s",
            "clock_skew": f" {self.clock_skew_s:+.1f} s",
            "partition": " cut off from the rest",
            "kill_stage": " (every server of a stage; replaced by new peers)",
            "byzantine": f" lying ({self.lie})",
        }.get(self.kind, "")
        return f"{self.kind} {who}{extra} for {self.duration_s:.0f}s"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["peers"] = list(self.peers)
        return {k: v for k, v in out.items() if v or k in ("at_s", "kind", "peers")}

    @classmethod
    def from_dict(cls, data: Any) -> FaultEvent:
        if not isinstance(data, dict):
            raise ScheduleError("a fault event is a JSON object")
        values = dict(data)
        peers = values.pop("peers", None)
        if not isinstance(peers, list) or not all(isinstance(p, int) for p in peers):
            raise ScheduleError("a fault event needs peers: a list of peer indices")
        try:
            return cls(peers=tuple(peers), **values)
        except TypeError as exc:
            raise ScheduleError(f"bad fault event {data!r}: {exc}") from None


@dataclass(frozen=True)
class Schedule:
    events: tuple[FaultEvent, ...]
    seed: int | None = None

    def validate(self, peers: int, min_group_size: int, duration_s: float) -> None:
        """Refuses events that name absent peers, outlast the run, or leave too few peers up."""
        for e in self.events:
            if max(e.peers) >= peers:
                raise ScheduleError(f"{e.describe()}: there are only {peers} peers")
            if e.end_s > duration_s:
                raise ScheduleError(f"{e.describe()} at {e.at_s:.0f}s outlasts the run")
        for e in self.events:
            if not e.disruptive:
                continue
            out = {
                p
                for o in self.events
                if o.disruptive and o.at_s < e.end_s and e.at_s < o.end_s
                for p in o.peers
            }
            if peers - len(out) < min_group_size:
                raise ScheduleError(
                    f"{e.describe()} at {e.at_s:.0f}s leaves fewer than {min_group_size} peers up"
                )

    def to_json(self) -> str:
        return json.dumps(
            {"seed": self.seed, "events": [e.to_dict() for e in self.events]}, indent=1
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ScheduleError(f"schedule is not JSON: {exc}") from None
        if isinstance(data, list):
            data = {"events": data}
        if not isinstance(data, dict) or not isinstance(data.get("events"), list):
            raise ScheduleError("a schedule is a JSON list of events or {'events': [...]}")
        events = tuple(
            sorted((FaultEvent.from_dict(e) for e in data["events"]), key=lambda e: e.at_s)
        )
        seed = data.get("seed")
        return cls(events, seed if isinstance(seed, int) else None)

    @classmethod
    def load(cls, path: Path) -> Schedule:
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise ScheduleError(f"schedule file {path} does not exist") from None


@dataclass(frozen=True)
class ScheduleParams:
    """How a random schedule is drawn."""

    peers: int
    duration_s: float
    min_group_size: int = 2
    warmup_s: float = 40.0
    quiet_s: float = 60.0
    #: Pause between two faults of one lane.
    gap_s: tuple[float, float] = (5.0, 20.0)
    #: How long a killed peer stays down, a pause lasts, a partition holds.
    down_s: tuple[float, float] = (5.0, 25.0)
    degrade_s: tuple[float, float] = (15.0, 45.0)
    kinds: tuple[FaultKind, ...] = field(default=DEFAULT_KINDS)

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ScheduleError("chaos needs at least 2 peers")
        if not 1 <= self.min_group_size <= self.peers:
            raise ScheduleError("need 1 <= min_group_size <= peers")
        if self.warmup_s < 0 or self.quiet_s < 0 or self.duration_s <= 0:
            raise ScheduleError("warmup_s, quiet_s >= 0 and duration_s > 0")
        for lo, hi in (self.gap_s, self.down_s, self.degrade_s):
            if not 0 < lo <= hi:
                raise ScheduleError("ranges must satisfy 0 < low <= high")
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ScheduleError(f"unknown fault kinds {sorted(unknown)}")


def generate(params: ScheduleParams, seed: int) -> Schedule:
    """A random schedule; the same (params, seed) always gives the same one."""
    rng = random.Random(seed)
    end = params.duration_s - params.quiet_s
    events: list[FaultEvent] = []
    spare = params.peers - params.min_group_size  # peers that may be out at once
    for lane in ((*DISRUPTIVE, BYZANTINE), DEGRADING):
        kinds = [k for k in lane if k in params.kinds]
        if lane is not DEGRADING and spare < 1:
            kinds = []
        t = params.warmup_s
        while kinds:
            t += rng.uniform(*params.gap_s)
            kind = rng.choice(kinds)
            span = params.degrade_s if lane is DEGRADING else params.down_s
            duration = round(rng.uniform(*span), 1)
            if t + duration > end:
                break
            events.append(_draw(rng, kind, round(t, 1), duration, params.peers, spare))
            t += duration
    return Schedule(tuple(sorted(events, key=lambda e: (e.at_s, e.kind))), seed)


def _draw(
    rng: random.Random, kind: FaultKind, at: float, duration: float, peers: int, spare: int
) -> FaultEvent:
    everyone = list(range(peers))
    if kind in ("kill", "pause"):
        # Mostly one peer; sometimes two at once when the group can spare them.
        n = 2 if spare >= 2 and rng.random() < 0.25 else 1
        return FaultEvent(at, kind, tuple(sorted(rng.sample(everyone, n))), duration)
    if kind == BYZANTINE:  # never the creator: its adverts anchor which state is the run's
        liar = rng.randrange(1, peers)
        return FaultEvent(at, kind, (liar,), duration, lie=rng.choice(LIES))
    if kind == "partition":
        minority = rng.randint(1, min(spare, peers // 2))
        return FaultEvent(at, kind, tuple(sorted(rng.sample(everyone, minority))), duration)
    victims = tuple(sorted(rng.sample(everyone, rng.randint(1, max(1, peers // 3)))))
    if kind == "latency":
        latency = round(rng.uniform(20.0, 250.0))
        return FaultEvent(
            at,
            kind,
            victims,
            duration,
            latency_ms=latency,
            jitter_ms=round(latency * rng.uniform(0.0, 0.5)),
            loss=round(rng.uniform(0.0, 0.1), 3),
        )
    if kind == "bandwidth":
        bw = round(rng.uniform(20e3, 300e3), -3)
        return FaultEvent(at, kind, victims, duration, bandwidth_bytes_s=bw)
    skew = round(rng.uniform(2.0, 20.0), 1) * rng.choice((-1, 1))
    return FaultEvent(at, kind, victims[:1], duration, clock_skew_s=skew)
