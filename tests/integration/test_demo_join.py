"""`swarmd join` with `algo = "demo"` as real processes on loopback: DeMo's sticky group
exchanges every inner step, the loss falls, members end each round with identical states, a
member killed mid-round does not stall the others, and a joiner takes the group's state."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.join import events_until_exit, join_cmd, start_bootstrap
from tests.harness.processes import ProcessGroup
from tests.harness.runs import DEMO_RUN

START_S = 120.0


def _rounds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "outer_step"]


def test_three_demo_peers_learn_and_agree(processes: ProcessGroup, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(DEMO_RUN)
    boot = start_bootstrap(processes, tmp_path)
    peers = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=30),
            join_cmd(tmp_path, "p1", boot, steps=30),
            join_cmd(tmp_path, "p2", boot, steps=30),
        ],
        timeout=START_S,
    )
    runs = [events_until_exit(p) for p in peers]
    assert all(p.process.returncode == 0 for p in peers), [p.stderr_tail for p in peers]
    hashes: dict[int, set[str]] = {}
    for events in runs:
        training = next(e for e in events if e["event"] == "training")
        assert training["algo"] == "demo"
        rounds = _rounds(events)
        assert len(rounds) >= 5, rounds
        assert sum(e["group_size"] == 3 for e in rounds) >= 4, rounds
        for e in rounds:
            hashes.setdefault(e["round"], set()).add(e["state_hash"])
        losses = [e["val_loss"] for e in rounds]
        assert losses[-1] < losses[0], losses
    # Every round boundary: the three hold the very same parameters.
    assert len(hashes) >= 5 and all(len(h) == 1 for h in hashes.values()), hashes


def _agreeing_tail(runs: list[list[dict[str, Any]]], last: int) -> dict[int, set[str]]:
    """State hashes of the last ``last`` rounds every run reported."""
    per_run = [{e["round"]: e["state_hash"] for e in _rounds(events)} for events in runs]
    common = sorted(set.intersection(*(set(r) for r in per_run)))[-last:]
    return {n: {r[n] for r in per_run} for n in common}


# Slow tier; default suite: three DeMo peers (above), a member killed mid-reduce (test_allreduce,
# test_sim_allreduce).
@pytest.mark.slow
def test_a_killed_member_does_not_stall_the_others_and_a_joiner_catches_up(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The survivors train on until the joiner has finished (then SIGTERM): with a fixed
    step budget they could finish before a joiner slowed by a busy machine had its first
    boundary, and then no round was common to the three (seen in CI)."""
    (tmp_path / "run.toml").write_text(DEMO_RUN.replace("min_group_size = 3", "min_group_size = 2"))
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    p0, p1, victim = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, *create, steps=100_000),
            join_cmd(tmp_path, "p1", boot, steps=100_000),
            join_cmd(tmp_path, "victim", boot, steps=100_000),
        ],
        timeout=START_S,
    )
    while (e := victim.receive(timeout=60))["event"] != "outer_step" or e["round"] < 2:
        pass
    killed_round, killed_at = e["round"], time.time()
    victim.process.send_signal(signal.SIGKILL)
    joiner = processes.start(join_cmd(tmp_path, "joiner", boot, steps=25), timeout=START_S)
    joined = events_until_exit(joiner, timeout=240)
    for p in (p0, p1):
        p.process.send_signal(signal.SIGTERM)
    runs = [events_until_exit(p, timeout=60) for p in (p0, p1)] + [joined]
    assert [p.process.returncode for p in (p0, p1, joiner)] == [0, 0, 0]
    # It downloaded the group's parameters (at its start, or at its first boundary when the
    # group had moved on meanwhile).
    assert any(e["event"] == "state_synced" for e in runs[2]), runs[2]
    for events in runs[:2]:
        # Two boundaries (10 steps of this tiny model: well under a second each) after the
        # kill, soon: a stall on the dead member would cost up to 30 s a step until dropped.
        later = next(e for e in _rounds(events) if e["round"] >= killed_round + 2)
        assert later["time"] - killed_at < 60, later
    # The survivors and the joiner end the joiner's last rounds with the very same parameters.
    tail = _agreeing_tail(runs, 2)
    assert tail and all(len(h) == 1 for h in tail.values()), tail
