"""`swarmd chaos --algo swarm`: a SWARM pipeline under faults, one of which loses a stage.

The peers are stage servers (slot i serves stage i mod STAGES; slot 0 creates the run) and
trainers (the last slots). Besides the degrading faults of any chaos run, the schedule kills
every server of the middle stage at once (`kill_stage`) and, `duration_s` later, starts
replacements in fresh state directories: new machines, which find the stage lost and rebuild it
from its neighbours (CheckFree, algorithms/swarm/recovery.py). A killed server restarted in its
own state directory would bring its stage back from its own saved state, which exercises
nothing new. The duration is at least the directory records' lifetime, so the dead servers'
records have lapsed when the replacements look (one that looks earlier waits for that).

Invariants (over the recorded JSONL, as invariants.py does for DiLoCo runs):
- the pipeline trains after the loss: every stage steps on micro-batches after the last heal;
- the lost stage is rebuilt once: one `stage_recovered` (CheckFree) per lost middle stage, and
  the other replacements download that state instead of rebuilding;
- the loss recovers: the last stage's loss at the end is within LOSS_TOLERANCE of its loss
  just before the stage was lost;
- nobody died except on purpose, no traceback in any log (invariants.py's checks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from swarmd.node.chaos.invariants import (
    Check,
    Record,
    no_exceptions,
    no_unexpected_exits,
    peer_events,
    stop_time,
)
from swarmd.node.chaos.schedule import DEGRADING, FaultEvent, Schedule, ScheduleParams, generate

#: Stages of a chaos SWARM run: the middle one is the one lost.
STAGES = 3
LOST_STAGE = 1
#: Seconds a killed stage stays without servers: its records (12 s) lapse, with margin.
DOWN_S = (20.0, 30.0)
#: The end's loss may exceed the loss before the stage was lost by this fraction.
LOSS_TOLERANCE = 0.05
#: Rounds of the last stage averaged for a loss figure.
LOSS_ROUNDS = 5

SWARM_RUN_EXTRA = f"""\
swarm_stages = {STAGES}
swarm_round_s = 3.0
swarm_rebalance_s = 0
"""


@dataclass(frozen=True)
class Role:
    """What one slot runs: a stage server of `stage`, or a trainer (stage None)."""

    stage: int | None

    def join_args(self) -> list[str]:
        if self.stage is None:
            return ["--role", "trainer"]
        return ["--role", "server", "--stage", str(self.stage)]


def roles(peers: int) -> list[Role]:
    """Servers first (slot 0, the creator, serves stage 0), then one trainer (two from 8
    peers on)."""
    trainers = 1 if peers < 8 else 2
    servers = peers - trainers
    if servers < STAGES:
        raise ValueError(f"chaos --algo swarm needs at least {STAGES + 1} peers")
    return [Role(i % STAGES) for i in range(servers)] + [Role(None)] * trainers


def swarm_schedule(params: ScheduleParams, seed: int) -> Schedule:
    """The seeded degrading faults of any run, and one kill of every server of the middle
    stage, early enough that the rebuilt stage trains for a while before the quiet end."""
    degrading = generate(
        ScheduleParams(
            peers=params.peers,
            duration_s=params.duration_s,
            min_group_size=1,
            warmup_s=params.warmup_s,
            quiet_s=params.quiet_s,
            degrade_s=params.degrade_s,
            kinds=DEGRADING,
        ),
        seed,
    )
    rng = random.Random(seed)
    victims = tuple(i for i, r in enumerate(roles(params.peers)) if r.stage == LOST_STAGE)
    at = round(params.warmup_s + rng.uniform(0.0, 10.0), 1)
    down = round(rng.uniform(*DOWN_S), 1)
    if at + down > params.duration_s - params.quiet_s:
        raise ValueError("--duration is too short for a lost stage and its recovery")
    kill = FaultEvent(at, "kill_stage", victims, down)
    events = sorted([*degrading.events, kill], key=lambda e: (e.at_s, e.kind))
    return Schedule(tuple(events), seed)


def _stage_rounds(records: list[Record]) -> list[Record]:
    return [r for r in peer_events(records, "stage_round") if r.get("micro_batches", 0) > 0]


def trains_after_loss(records: list[Record]) -> Check:
    name = "the pipeline trains after the lost stage"
    heals = [r["t"] for r in records if r["type"] == "heal" and r["kind"] == "kill_stage"]
    if not heals:
        return Check(name, False, "no stage was lost and brought back")
    after, stop = max(heals), stop_time(records)
    stepped = {int(r["stage"]) for r in _stage_rounds(records) if after < r["t"] < stop}
    missing = sorted(set(range(STAGES)) - stepped)
    if missing:
        return Check(name, False, f"stage(s) {missing} never stepped after {after:.0f}s")
    return Check(name, True, f"every stage stepped on micro-batches after {after:.0f}s")


def rebuilt_once(records: list[Record]) -> Check:
    """One CheckFree rebuild per lost middle stage, none of a stage that was not lost."""
    name = "a lost stage is rebuilt once"
    kills = [r for r in records if r["type"] == "fault" and r["kind"] == "kill_stage"]
    rebuilt = [r for r in peer_events(records, "stage_recovered") if r["method"] == "checkfree"]
    by_stage: dict[int, int] = {}
    for r in rebuilt:
        by_stage[int(r["stage"])] = by_stage.get(int(r["stage"]), 0) + 1
    expected = {LOST_STAGE: len(kills)} if kills else {}
    detail = f"{len(kills)} stage loss(es), CheckFree rebuilds by stage {by_stage}"
    figures = tuple(
        ("recovery_s", float(r["recovery_s"]))
        for r in peer_events(records, "stage_round")
        if "recovery_s" in r
    )
    return Check(name, by_stage == expected, detail, figures[:1])


def loss_recovered(records: list[Record]) -> Check:
    name = "the loss recovers"
    losses = [
        (r["t"], float(r["loss"]))
        for r in _stage_rounds(records)
        if r["stage"] == STAGES - 1 and r.get("loss") is not None
    ]
    kill = next(
        (r["t"] for r in records if r["type"] == "fault" and r["kind"] == "kill_stage"), None
    )
    if kill is None or not losses:
        return Check(name, False, "no stage loss or no loss of the last stage logged")
    before = [v for t, v in losses if t < kill][-LOSS_ROUNDS:]
    end = [v for t, v in losses if t < stop_time(records)][-LOSS_ROUNDS:]
    if not before or not end:
        return Check(name, False, "no rounds of the last stage before the loss or at the end")
    b, e = sum(before) / len(before), sum(end) / len(end)
    start = sum(v for _, v in losses[:LOSS_ROUNDS]) / min(len(losses), LOSS_ROUNDS)
    figures = (("loss_start", start), ("loss_before_loss", b), ("loss_end", e))
    ok = e <= b * (1 + LOSS_TOLERANCE)
    return Check(name, ok, f"{b:.4f} before the stage was lost -> {e:.4f} at the end", figures)


def check_swarm(records: list[Record]) -> list[Check]:
    records = sorted(records, key=lambda r: r["t"])
    return [
        trains_after_loss(records),
        rebuilt_once(records),
        loss_recovered(records),
        no_unexpected_exits(records),
        no_exceptions(records),
    ]
