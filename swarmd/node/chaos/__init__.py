"""`swarmd chaos`: real peers under a seeded schedule of faults, then invariants over the log.

schedule.py draws (or reads) the faults, harness.py runs the processes and applies them while
recording everything as JSONL, invariants.py judges the record, report.py prints and plots it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from swarmd.node.chaos.harness import Harness, HarnessOptions
from swarmd.node.chaos.invariants import Bounds, check_all, live_at_end
from swarmd.node.chaos.report import figures, text_report, timeline_png
from swarmd.node.chaos.schedule import (
    BYZANTINE,
    DEFAULT_KINDS,
    Schedule,
    ScheduleParams,
    generate,
)
from swarmd.node.chaos.swarm import check_swarm, roles, swarm_schedule


@dataclass(frozen=True)
class ChaosOptions:
    peers: int = 6
    duration_s: float = 300.0
    seed: int = 0
    out_dir: Path | None = None
    #: A JSON schedule to run instead of a seeded random one.
    schedule_file: Path | None = None
    inner_steps: int = 10
    algo: str = "diloco"
    min_group_size: int = 2
    resume_bound_s: float = 90.0
    liveness_bound_s: float = 90.0
    #: Draw Byzantine faults too (chaos/byzantine.py).
    byzantine: bool = False

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if not self.min_group_size < self.peers:
            raise ValueError("min_group_size must be below the number of peers")
        if not self.duration_s >= 30:
            raise ValueError("--duration must be at least 30 seconds")
        if self.algo == "swarm":
            roles(self.peers)  # raises when there are too few peers for the stages
        if self.byzantine and self.algo != "diloco":
            raise ValueError("--byzantine lies about DiLoCo updates: --algo diloco only")

    @property
    def swarm(self) -> bool:
        return self.algo == "swarm"


def build_schedule(opts: ChaosOptions) -> Schedule:
    if opts.schedule_file is not None:
        schedule = Schedule.load(opts.schedule_file)
    else:
        d = opts.duration_s
        params = ScheduleParams(
            peers=opts.peers,
            duration_s=d,
            min_group_size=opts.min_group_size,
            warmup_s=min(40.0, 0.15 * d),
            quiet_s=min(60.0, max(25.0, 0.2 * d)),
            kinds=(*DEFAULT_KINDS, BYZANTINE) if opts.byzantine else DEFAULT_KINDS,
        )
        schedule = swarm_schedule(params, opts.seed) if opts.swarm else generate(params, opts.seed)
    # A SWARM run has no group to keep: a stage's servers may all be out (that is the test).
    schedule.validate(opts.peers, 1 if opts.swarm else opts.min_group_size, opts.duration_s)
    return schedule


def _say(text: str) -> None:
    print(text, flush=True)


def run_chaos(opts: ChaosOptions) -> int:
    """Runs, checks, reports. Exit code 0 when every invariant holds, else 1."""
    schedule = build_schedule(opts)
    out = opts.out_dir or Path(tempfile.mkdtemp(prefix="swarmd-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "schedule.json").write_text(schedule.to_json())
    _say(
        f"swarmd chaos: {opts.peers} peers, {opts.duration_s:.0f}s, "
        f"{'schedule ' + str(opts.schedule_file) if opts.schedule_file else f'seed {opts.seed}'}"
        f", {len(schedule.events)} faults; records in {out}"
    )
    for e in schedule.events:
        _say(f"  at {e.at_s:6.1f}s  {e.describe()}")
    harness = Harness(
        HarnessOptions(
            peers=opts.peers,
            duration_s=opts.duration_s,
            out_dir=out,
            schedule=schedule,
            inner_steps=opts.inner_steps,
            algo=opts.algo,
            min_group_size=opts.min_group_size,
        )
    )
    try:
        started = trio.run(harness.run)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is None:
            raise
        _say(f"\ninterrupted; every process was stopped; records so far in {out}")
        return 130
    records = harness.rec.records
    bounds = Bounds(
        min_group_size=opts.min_group_size,
        resume_s=opts.resume_bound_s,
        liveness_s=opts.liveness_bound_s,
    )
    checks = check_swarm(records) if opts.swarm else check_all(records, bounds)
    report = text_report(records, checks)
    if not started:
        report += "\n\nSTARTUP FAILED: not every peer was training in time (see logs/)"
    (out / "report.txt").write_text(report + "\n")
    _say("\n" + report)
    why_not = timeline_png(records, out / "timeline.png")
    _say(f"\ntimeline: {out / 'timeline.png'}" if why_not is None else f"\nno timeline: {why_not}")
    (out / "checks.json").write_text(
        json.dumps([{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks], indent=1)
    )
    ok = started and all(c.ok for c in checks)
    fig = figures(checks)
    exits = {r["peer"]: r["code"] for r in records if r["type"] == "exit"}
    survived = sum(1 for p in live_at_end(records) if exits.get(p) == 0)
    _say(
        f"faults={harness.faults_applied} survived={survived} "
        f"invariants_ok={str(ok).lower()} loss_start={fig.get('loss_start', float('nan')):.4f} "
        f"loss_end={fig.get('loss_end', float('nan')):.4f} "
        f"max_resume_s={fig.get('max_resume_s', 0.0):.1f}"
        + (f" recovery_s={fig.get('recovery_s', float('nan')):.1f}" if opts.swarm else "")
    )
    return 0 if ok else 1
