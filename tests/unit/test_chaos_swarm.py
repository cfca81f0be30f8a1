"""`swarmd chaos --algo swarm`: the layout, the schedule's lost stage, and the invariants on
hand-made logs (a good run, and each way a run can break them)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from swarmd.node.chaos import ChaosOptions, build_schedule
from swarmd.node.chaos.swarm import (
    DOWN_S,
    LOST_STAGE,
    STAGES,
    Role,
    check_swarm,
    roles,
)

Record = dict[str, Any]


def test_roles_servers_round_robin_then_trainers() -> None:
    assert roles(6) == [Role(0), Role(1), Role(2), Role(0), Role(1), Role(None)]
    assert roles(8)[-2:] == [Role(None), Role(None)]
    assert Role(None).join_args() == ["--role", "trainer"]
    assert Role(2).join_args() == ["--role", "server", "--stage", "2"]
    with pytest.raises(ValueError, match="at least 4 peers"):
        roles(3)


def test_the_schedule_kills_the_middle_stage_long_enough_for_its_records_to_lapse() -> None:
    opts = ChaosOptions(peers=6, duration_s=120, seed=3, algo="swarm")
    schedule = build_schedule(opts)
    assert schedule == build_schedule(opts)  # the same seed, the same schedule
    (kill,) = [e for e in schedule.events if e.kind == "kill_stage"]
    assert kill.peers == tuple(i for i, r in enumerate(roles(6)) if r.stage == LOST_STAGE)
    assert DOWN_S[0] <= kill.duration_s <= DOWN_S[1]
    assert all(
        e.kind in ("kill_stage", "latency", "bandwidth", "clock_skew") for e in schedule.events
    )
    with pytest.raises(ValueError, match="too short"):
        build_schedule(ChaosOptions(peers=6, duration_s=40, seed=3, algo="swarm"))


def _round(t: float, peer: int, stage: int, loss: float | None = None, **extra: Any) -> Record:
    return {"t": t, "type": "peer", "peer": peer, "event": "stage_round", "stage": stage,
            "micro_batches": 4, "loss": loss, **extra}  # fmt: skip


def good_log() -> list[Record]:
    """A 6-peer run: stage 1's servers (peers 1, 4) killed at 50 s, replaced at 75 s; peer 1's
    replacement rebuilds it, peer 4's downloads it."""
    log: list[Record] = [{"t": 0.0, "type": "start", "peers": 6}]
    for t in range(10, 50, 3):
        log += [_round(t, 0, 0), _round(t, 1, 1), _round(t, 2, 2, loss=4.0 - t / 100)]
    log.append({"t": 50.0, "type": "fault", "kind": "kill_stage", "peers": [1, 4]})
    log += [{"t": 50.1, "type": "exit", "peer": p, "code": -signal.SIGKILL} for p in (1, 4)]
    log.append({"t": 75.0, "type": "heal", "kind": "kill_stage", "peers": [1, 4]})
    log += [{"t": 75.1, "type": "spawn", "peer": p, "incarnation": 1} for p in (1, 4)]
    log.append({"t": 80.0, "type": "peer", "peer": 1, "event": "stage_recovered", "stage": 1,
                "method": "checkfree"})  # fmt: skip
    log.append(_round(82.0, 1, 1, recovery_s=6.5))
    for t in range(83, 120, 3):
        log += [_round(t, 0, 0), _round(t, 4, 1), _round(t, 2, 2, loss=3.7 - (t - 83) / 200)]
    log.append({"t": 121.0, "type": "stop"})
    log += [{"t": 122.0, "type": "exit", "peer": p, "code": 0} for p in range(-1, 6)]
    return log


def _failed(log: list[Record]) -> dict[str, str]:
    return {c.name: c.detail for c in check_swarm(log) if not c.ok}


def test_a_good_run_passes_with_its_figures() -> None:
    checks = check_swarm(good_log())
    assert all(c.ok for c in checks), [(c.name, c.detail) for c in checks if not c.ok]
    figures = dict(f for c in checks for f in c.figures)
    assert figures["recovery_s"] == 6.5
    assert figures["loss_end"] < figures["loss_before_loss"]


def test_two_rebuilds_of_one_stage_fail() -> None:
    log = good_log()
    twice = {**next(r for r in log if r.get("event") == "stage_recovered"), "peer": 4, "t": 80.5}
    log.append(twice)
    assert "a lost stage is rebuilt once" in _failed(log)


def test_a_lost_stage_never_rebuilt_fails() -> None:
    log = [r for r in good_log() if r.get("event") != "stage_recovered"]
    assert "a lost stage is rebuilt once" in _failed(log)


def test_a_stage_that_never_trains_again_fails() -> None:
    log = [r for r in good_log() if not (r.get("stage") == 1 and r["t"] > 75)]
    failed = _failed(log)
    assert "stage(s) [1] never stepped" in failed["the pipeline trains after the lost stage"]


def test_a_loss_that_does_not_recover_fails() -> None:
    log = good_log()
    for r in log:
        if r.get("event") == "stage_round" and r["stage"] == STAGES - 1 and r["t"] > 75:
            r["loss"] = 4.5
    assert "the loss recovers" in _failed(log)


def test_a_server_that_dies_unkilled_fails() -> None:
    log = good_log()
    log.insert(-9, {"t": 100.0, "type": "exit", "peer": 0, "code": 1})
    assert "no unintended deaths" in _failed(log)
