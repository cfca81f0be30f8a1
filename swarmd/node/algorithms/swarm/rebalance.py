"""When a stage server moves to another stage: the pipeline runs at its slowest stage's speed.

A pipeline's throughput is the smallest of its stages' total rates (the sum of their servers'
published micro-batches per second). A server of stage `a` moves to the stage `b` with the
smallest total when, with its rate `r` taken from `a` and added to `b`, the smallest total
rises by at least `gain` (SWARM's rule, with Petals' balance-quality margin against noise), or
when `a`'s total exceeds `b`'s by at least `gain` x r. The first rule alone never moved a
server once several stages were about equally slow (the smallest total then cannot rise by
one move): the simulator's 40 servers on 4 stages kept a stage at 1.5x the mean for a whole
run. The second moves toward balance and never back: after a move `a` exceeds `b` by at most
2r - gain x r less than before, so the move back would need the same margin the other way, and
each move lowers the spread of the stage totals, so moves end. Stage
`a` must keep a server, and only one server of a stage moves: every server of the stage names
the same mover from the same directory (the one whose move raises the slowest stage most, ties
by a hash of the peer id; no per-server counter or clock, so two servers looking at different
times with the same view cannot both be it), so the servers of an over-served stage don't all
leave it at once (Petals saw decisions reverse within minutes as servers moved together:
petals#389). A server moving
publishes itself as `joining` its new stage at once, so the next look already counts it
there. Pure functions of the directory: the strategy does the move.

Naming one mover from one view is not enough: the servers of a stage look right after the
same round boundary, and a mover stays named while its rates swing (`named`), so two servers
can each be named by their own reads and confirm together (CI: both spare stage-0 servers
moved). A mover therefore claims first and checks after (`contest`): it publishes itself as
`joining`, reads the directory again, and goes only when no other server joins the target.
Of two that both publish before either reads, at least one sees the other; the one with the
higher lot yields at once, the lower waits a moment and goes only when the other has
yielded, so two claims never both go (both may yield: the next looks try again).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.protocol.identity import PeerId


@dataclass(frozen=True)
class Move:
    source: int
    target: int
    #: The slowest stage's total rate before and after the move (micro-batches/s).
    before: float
    after: float


def stage_rates(records: dict[PeerId, StageRecord], stages: int) -> list[float]:
    """Each stage's total rate (servers joining it count already)."""
    totals = [0.0] * stages
    for record in records.values():
        if record.state in ("serving", "joining"):
            totals[record.stage] += record.rate
    return totals


def least_served(records: dict[PeerId, StageRecord], stages: int) -> int:
    """The stage a server takes when it starts: the one with the fewest servers, then the
    lowest total rate (a new server's own rate is not known before it has served)."""
    totals = stage_rates(records, stages)
    counts = [0] * stages
    for record in records.values():
        counts[record.stage] += 1
    return min(range(stages), key=lambda s: (counts[s], totals[s], s))


@dataclass
class Looks:
    """A move is made when two looks in a row name it: rates measured on a busy host swing
    for a moment (seen in CI: a server moved back 1 -> 0 right after the one move 0 -> 1 the
    setup called for), and a move costs a state download and its stage a server."""

    #: (source, target) of the move the last look named, if any.
    last: tuple[int, int] | None = None

    @property
    def named(self) -> bool:
        return self.last is not None

    def confirm(self, move: Move | None) -> bool:
        """Whether `move` (this look's, or None) is the one the last look named."""
        seen = None if move is None else (move.source, move.target)
        confirmed = seen is not None and seen == self.last
        self.last = None if confirmed else seen
        return confirmed


def _lot(peer: PeerId) -> bytes:
    return hashlib.blake2b(peer.raw, digest_size=8).digest()


def choose_move(
    records: dict[PeerId, StageRecord],
    me: PeerId,
    stages: int,
    gain: float,
    named: bool = False,
) -> Move | None:
    """Where `me` should move now, or None (see the module's docstring).

    `named`: `me` was the mover at its last look. It stays the mover while its move is within
    `gain` of the best one: rates measured on a busy host swing by more than the servers of
    a stage differ, so without this the strict best flipped between equal servers from look
    to look and no server was named twice in a row (CI: no move in 90 s)."""
    mine = records.get(me)
    if mine is None or mine.state != "serving" or stages < 2:
        return None
    peers = [p for p, r in records.items() if r.stage == mine.stage and r.state == "serving"]
    if len(peers) < 2:
        return None
    totals = stage_rates(records, stages)
    before = min(totals)
    target = min((s for s in range(stages) if s != mine.stage), key=lambda s: (totals[s], s))

    def after(peer: PeerId) -> float:
        rate = records[peer].rate
        moved = list(totals)
        moved[mine.stage] -= rate
        moved[target] += rate
        return min(moved)

    # Every server of the stage reads the same directory and names the same mover: the one
    # whose move helps most (ties: the lowest hash of its peer id).
    mover = max(peers, key=lambda p: (after(p), _lot(p)))
    best = after(mover)
    if named and mover != me and after(me) * gain >= best:
        mover, best = me, after(me)
    if mover != me or mine.rate <= 0:
        return None
    raises = best > before * gain and best > before
    if not (raises or totals[mine.stage] - totals[target] >= gain * mine.rate):
        return None
    return Move(mine.stage, target, before, best)


def contest(
    records: dict[PeerId, StageRecord], me: PeerId, target: int
) -> Literal["go", "wait", "yield"]:
    """What a server that has published its claim on `target` does after reading `records`
    (see the module's docstring): "go" when nobody else joins the target, "yield" when one
    with a lower lot does, otherwise "wait" (read again shortly; still contested: yield)."""
    rivals = [
        p for p, r in records.items() if p != me and r.state == "joining" and r.stage == target
    ]
    if not rivals:
        return "go"
    return "yield" if min(_lot(p) for p in rivals) < _lot(me) else "wait"
