"""The invariants a chaos run must keep, as pure functions over its recorded JSONL.

Every function takes the run's records (dicts, in time order, each with ``t`` seconds since the
harness started and a ``type``) and returns a :class:`Check`. Nothing here trusts the harness's
opinion of what happened: whether an exit was intended, for instance, is re-derived from the
fault records that precede it, so a hand-made log can be checked exactly like a real one.

Record types (written by harness.py):

- ``start``: peers, seed, duration_s, min_group_size, schedule
- ``spawn``: peer, pid, incarnation (0 the first start, then one more per restart)
- ``peer``: peer, event (the daemon's JSON event name) and the event's own fields
- ``fault`` / ``heal``: kind, peers (for a partition, the minority side)
- ``exit``: peer, code (negative: killed by that signal)
- ``exception``: peer, text (a traceback found in the peer's stderr)
- ``stop``: the harness began stopping everyone (SIGTERM) at the end of the run

Peer -1 is the bootstrap DHT node.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Group)\b")

#: Statuses of an outer step in which the peer averaged with others.
AVERAGED = ("averaged", "partial")


@dataclass(frozen=True)
class Bounds:
    """The stated bounds the invariants hold the run to."""

    min_group_size: int = 2
    #: A restarted peer must be training again within this long of its restart.
    resume_s: float = 90.0
    #: While a group could form, a completed outer round at least this often.
    liveness_s: float = 90.0

    def __post_init__(self) -> None:
        if self.min_group_size < 1 or not self.resume_s > 0 or not self.liveness_s > 0:
            raise ValueError("bounds must be positive (min_group_size >= 1)")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    #: Figures the report prints (loss_start, max_resume_s, ...).
    figures: tuple[tuple[str, float], ...] = ()


def peer_events(records: Iterable[Record], event: str) -> list[Record]:
    return [r for r in records if r["type"] == "peer" and r.get("event") == event]


def stop_time(records: list[Record]) -> float:
    return next((r["t"] for r in records if r["type"] == "stop"), math.inf)


def live_at_end(records: list[Record]) -> list[int]:
    """Peers whose process was running when the harness began the final stop."""
    running: set[int] = set()
    stop = stop_time(records)
    for r in records:
        if r["t"] > stop:
            break
        if r["type"] == "spawn" and r["peer"] >= 0:
            running.add(r["peer"])
        elif r["type"] == "exit":
            running.discard(r["peer"])
    return sorted(running)


def _final_round(records: list[Record]) -> tuple[int | None, dict[int, dict[int, Record]], str]:
    """The last round every live peer finished before the final stop, each peer's outer
    steps by round, and why there is none.

    Rounds still in flight when everyone is told to leave are not judged: peers leave one by
    one, so who is left to average with in them is a race of the shutdown, not of the run.
    """
    live = live_at_end(records)
    if not live:
        return None, {}, "no peer was alive at the end"
    stop = stop_time(records)
    steps: dict[int, dict[int, Record]] = {p: {} for p in live}
    for r in peer_events(records, "outer_step"):
        if r["peer"] in steps and r["t"] < stop:
            steps[r["peer"]][int(r["round"])] = r
    idle = [p for p in live if not steps[p]]
    if idle:
        return None, steps, f"peer(s) {idle} finished no outer round"
    return min(max(by_round) for by_round in steps.values()), steps, ""


def final_agreement(records: list[Record]) -> Check:
    """Every peer alive at the end holds the same global parameters after the final round
    (the last round all of them finished), by the state hashes they logged."""
    name = "final states agree"
    final, steps, why = _final_round(records)
    if final is None:
        return Check(name, False, why)
    missing = [p for p, by_round in steps.items() if final not in by_round]
    if missing:
        return Check(name, False, f"peer(s) {missing} skipped round {final}, the final round")
    hashes = {p: by_round[final]["state_hash"] for p, by_round in steps.items()}
    if len(set(hashes.values())) != 1:
        shown = ", ".join(f"peer{p}={h[:12]}" for p, h in hashes.items())
        return Check(name, False, f"round {final}: states differ: {shown}")
    return Check(
        name,
        True,
        f"{len(hashes)} live peers hold state {next(iter(hashes.values()))[:12]} after round "
        f"{final}",
        (("final_round", float(final)),),
    )


def loss_fell(records: list[Record]) -> Check:
    """Validation loss after the final round is below the loss of the initial weights."""
    name = "validation loss fell"
    first = next((r for r in peer_events(records, "validation") if r.get("round") == 0), None)
    if first is None:
        return Check(name, False, "no validation of the initial weights was logged")
    start = float(first["val_loss"])
    final, steps, why = _final_round(records)
    ends = [
        float(by_round[final]["val_loss"])
        for by_round in steps.values()
        if final is not None and final in by_round
    ]
    if final is None or not ends:
        return Check(name, False, why or "no final validation loss", (("loss_start", start),))
    end = sum(ends) / len(ends)
    figures = (("loss_start", start), ("loss_end", end))
    return Check(name, end < start, f"{start:.4f} -> {end:.4f} (round {final})", figures)


def no_unexpected_exits(records: list[Record]) -> Check:
    """No process ended except peers SIGKILLed by a fault, and everyone at the final stop
    (which must exit 0: a clean leave, not a crash or a hang that needed SIGKILL)."""
    name = "no unintended deaths"
    stop = stop_time(records)
    doomed: set[int] = set()
    bad: list[str] = []
    exits = 0
    for r in records:
        if (r["type"] == "fault" and r["kind"] in ("kill", "kill_stage")) or _swapped(r):
            doomed.update(r["peers"])
        elif r["type"] == "spawn":
            doomed.discard(r["peer"])
        elif r["type"] == "exit":
            exits += 1
            who = "bootstrap" if r["peer"] < 0 else f"peer{r['peer']}"
            code = int(r["code"])
            if r["t"] >= stop:
                if code != 0:
                    bad.append(f"{who} exited {code} when stopped at {r['t']:.0f}s")
            elif r["peer"] in doomed and code == -signal.SIGKILL:
                doomed.discard(r["peer"])
            else:
                bad.append(f"{who} died (exit {code}) at {r['t']:.0f}s")
    if bad:
        return Check(name, False, "; ".join(bad))
    return Check(name, True, f"{exits} exits, all intended")


def no_exceptions(records: list[Record]) -> Check:
    """No traceback in any process's log."""
    found = [r for r in records if r["type"] == "exception"]
    if not found:
        return Check("no unhandled exceptions", True, "no traceback in any log")
    first = found[0]
    # The exception's own line (`ValueError: ...`), also inside an exception group's frame.
    lines = [ln.strip(" |+-") for ln in first["text"].splitlines()]
    last_line = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), "?")
    return Check(
        "no unhandled exceptions",
        False,
        f"{len(found)} traceback(s); first in peer {first['peer']} at {first['t']:.0f}s: "
        f"{last_line}",
    )


def restarts_resumed(records: list[Record], bounds: Bounds) -> Check:
    """Every restarted peer was training again, from saved or downloaded state (not from
    scratch), within ``bounds.resume_s`` of its restart."""
    name = "restarted peers resumed"
    waiting: dict[int, float] = {}
    times: list[float] = []
    bad: list[str] = []
    for r in records:
        peer: int = r.get("peer", -2)
        if r["type"] == "spawn" and r.get("incarnation", 0) > 0:
            waiting[peer] = r["t"]
        elif r["type"] == "peer" and r.get("event") == "training" and peer in waiting:
            took = r["t"] - waiting.pop(peer)
            times.append(took)
            if r.get("origin") == "fresh":
                bad.append(f"peer{peer} restarted from scratch, not from its state")
            if took > bounds.resume_s:
                bad.append(f"peer{peer} took {took:.0f}s to resume (bound {bounds.resume_s:.0f}s)")
        elif (r["type"] == "fault" and r["kind"] == "kill") or _swapped(r):
            for p in r["peers"]:
                waiting.pop(p, None)  # killed again while starting: judged on its next restart
        elif r["type"] == "exit" and peer in waiting:
            bad.append(f"peer{peer} exited before it resumed")
            waiting.pop(peer)
    bad += [f"peer{p} never resumed after its restart at {t:.0f}s" for p, t in waiting.items()]
    worst = max(times, default=0.0)
    figures = (("max_resume_s", worst), ("restarts", float(len(times))))
    if bad:
        return Check(name, False, "; ".join(bad), figures)
    if not times:
        return Check(name, True, "no peer was restarted", figures)
    return Check(name, True, f"{len(times)} restart(s), slowest resumed in {worst:.1f}s", figures)


def _swapped(r: Record) -> bool:
    """A Byzantine fault or its heal: the peer is SIGKILLed and started again at once."""
    return r["type"] in ("fault", "heal") and r["kind"] == "byzantine"


def liars_banned(records: list[Record]) -> Check | None:
    """Every liar that gave evidence (a declared weight beyond the run's bound) was banned by
    some other peer while it lied; None when no such fault ran. Flipped or scaled updates are
    not evidence: the other invariants (agreement, loss) judge those."""
    faults = [r for r in records if r["type"] == "fault" and r.get("lie") == "weight"]
    if not faults:
        return None
    ids = {
        r["peer"]: r.get("peer_id")
        for r in records
        if r["type"] == "peer" and r.get("event") == "listening"
    }
    missed = []
    for fault in faults:
        liar = fault["peers"][0]
        end = fault["t"] + fault["duration_s"] + 10.0
        if not any(
            r["type"] == "peer"
            and r.get("event") == "peer_banned"
            and r.get("peer_id") == ids.get(liar)
            and r["peer"] != liar
            and fault["t"] <= r["t"] <= end
            for r in records
        ):
            missed.append(f"peer{liar} at {fault['t']:.0f}s")
    name = "liars banned"
    if missed:
        return Check(name, False, "nobody banned " + ", ".join(missed))
    return Check(name, True, f"{len(faults)} lying peer(s) banned on their evidence")


def _completes_round(r: Record, min_group_size: int) -> bool:
    return (
        r["type"] == "peer"
        and r.get("event") == "outer_step"
        and r.get("status") in AVERAGED
        and int(r.get("group_size", 0)) - int(r.get("dropped", 0)) >= max(2, min_group_size)
    )


def connected_peers(up: set[int], paused: set[int], minority: set[int] | None) -> set[int]:
    """The largest set of peers that are up, not paused, and can reach each other."""
    available = up - paused
    if minority is None:
        return available
    cut, rest = available & minority, available - minority
    return cut if len(cut) > len(rest) else rest


def liveness(records: list[Record], bounds: Bounds) -> Check:
    """While at least ``min_group_size`` peers were up (training, not paused) and connected,
    no window longer than ``bounds.liveness_s`` passed without a completed outer round (an
    averaged step with at least that many peers)."""
    name = "liveness"
    up: set[int] = set()
    paused: set[int] = set()
    minority: set[int] | None = None
    stop = stop_time(records)
    since: float | None = None  # start of the current window without a completed round
    worst, worst_at = 0.0, 0.0
    eligible_s = 0.0
    last_t = 0.0
    for r in records:
        t = min(r["t"], stop)
        if since is not None:
            eligible_s += t - last_t
            if t - since > worst:
                worst, worst_at = t - since, since
        last_t = t
        if r["t"] >= stop:
            break
        kind: str = r["type"]
        peer: int = r.get("peer", -2)
        if kind == "peer" and r.get("event") == "training":
            up.add(peer)
        elif kind == "exit" or (kind == "fault" and r["kind"] == "kill"):
            up.difference_update(r["peers"] if kind == "fault" else [peer])
        elif kind == "fault" and r["kind"] == "pause":
            paused.update(r["peers"])
        elif kind == "heal" and r["kind"] == "pause":
            paused.difference_update(r["peers"])
        elif kind == "fault" and r["kind"] == "partition":
            minority = set(r["peers"])
        elif kind == "heal" and r["kind"] == "partition":
            minority = None
        eligible = len(connected_peers(up, paused, minority)) >= bounds.min_group_size
        if not eligible:
            since = None
        elif since is None or _completes_round(r, bounds.min_group_size):
            since = t
    figures = (("max_gap_s", worst), ("eligible_s", eligible_s))
    detail = (
        f"longest wait for a round while a group could form: {worst:.0f}s from {worst_at:.0f}s "
        f"(bound {bounds.liveness_s:.0f}s)"
    )
    if eligible_s == 0:
        return Check(name, False, "no group of peers was ever up and connected", figures)
    return Check(name, worst <= bounds.liveness_s, detail, figures)


def check_all(records: list[Record], bounds: Bounds) -> list[Check]:
    records = sorted(records, key=lambda r: r["t"])
    return [
        final_agreement(records),
        loss_fell(records),
        no_unexpected_exits(records),
        no_exceptions(records),
        restarts_resumed(records, bounds),
        liveness(records, bounds),
        *([banned] if (banned := liars_banned(records)) is not None else []),
    ]
