"""Chaos invariants over hand-made records: each one passes a good run and fails a bad one."""

from __future__ import annotations

from typing import Any

from swarmd.node.chaos.invariants import (
    Bounds,
    check_all,
    final_agreement,
    liveness,
    loss_fell,
    no_exceptions,
    no_unexpected_exits,
    restarts_resumed,
)

Record = dict[str, Any]


class Log:
    """Builds a run's records in time order."""

    def __init__(self, peers: int = 3) -> None:
        self.records: list[Record] = [{"t": 0.0, "type": "start", "peers": peers}]
        self.peers = peers
        for p in range(peers):
            self.add(0.0, "spawn", peer=p, pid=100 + p, incarnation=0)
        for p in range(peers):
            self.event(1.0, p, "training", origin="fresh" if p == 0 else "group")
        self.event(1.5, 0, "validation", round=0, val_loss=5.0)

    def add(self, t: float, type_: str, **fields: Any) -> Log:
        self.records.append({"t": t, "type": type_, **fields})
        return self

    def event(self, t: float, peer: int, event: str, **fields: Any) -> Log:
        return self.add(t, "peer", peer=peer, event=event, **fields)

    def round(
        self,
        t: float,
        rnd: int,
        peers: list[int] | None = None,
        *,
        loss: float = 4.0,
        state: str = "",
        status: str = "averaged",
    ) -> Log:
        members = list(range(self.peers)) if peers is None else peers
        for p in members:
            self.event(
                t,
                p,
                "outer_step",
                round=rnd,
                status=status,
                group_size=len(members),
                dropped=0,
                val_loss=loss,
                state_hash=state or f"h{rnd}" * 8,
            )
        return self

    def stop(self, t: float, codes: dict[int, int] | None = None) -> Log:
        self.add(t, "stop")
        for p in range(self.peers):
            code = (codes or {}).get(p, 0)
            if code is not None:
                self.add(t + 1, "exit", peer=p, code=code)
        return self


def healthy(rounds: int = 10) -> Log:
    log = Log()
    for r in range(1, rounds + 1):
        log.round(2.0 + 5 * r, r, loss=5.0 - 0.1 * r)
    return log.stop(2.0 + 5 * rounds + 3)


def test_a_healthy_run_passes_everything() -> None:
    checks = check_all(healthy().records, Bounds(liveness_s=20))
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    figures = {k: v for c in checks for k, v in c.figures}
    assert figures["loss_start"] == 5.0 and figures["loss_end"] < 5.0


def test_different_final_states_fail() -> None:
    log = healthy(3)
    log.records = [r for r in log.records if r["type"] not in ("stop", "exit")]
    log.round(30, 4, [0, 1], state="a" * 16).round(30, 4, [2], state="b" * 16).stop(35)
    check = final_agreement(log.records)
    assert not check.ok and "differ" in check.detail


def test_final_round_is_the_last_one_everybody_finished_before_the_stop() -> None:
    # peer0 finished one more round alone while the others were leaving: not compared.
    log = healthy(3)
    log.records = [r for r in log.records if r["type"] not in ("stop", "exit")]
    log.add(30, "stop").round(31, 4, [0], state="c" * 16, status="local")
    for p in range(3):
        log.add(32, "exit", peer=p, code=0)
    check = final_agreement(log.records)
    assert check.ok and "round 3" in check.detail
    # Even when all of them finish a round in flight at the stop, the judged round is 3.
    late = healthy(3)
    late.records = [r for r in late.records if r["type"] not in ("stop", "exit")]
    late.add(30, "stop").round(31, 4, [0, 1], state="d" * 16).round(31, 4, [2], state="e" * 16)
    assert "round 3" in final_agreement(late.records).detail


def test_a_peer_that_skipped_the_final_round_fails() -> None:
    log = healthy(3)
    log.records = [r for r in log.records if r["type"] not in ("stop", "exit")]
    log.round(30, 4, [0, 1]).round(35, 5, [0, 1, 2]).stop(40)
    assert final_agreement(log.records).ok  # peer 2 skipped round 4, but 5 is the final one
    log2 = healthy(3)
    log2.records = [r for r in log2.records if r["type"] not in ("stop", "exit")]
    log2.round(30, 4, [0, 1]).round(35, 5, [2]).stop(40)  # final = 4, peer 2 jumped 3 -> 5
    check = final_agreement(log2.records)
    assert not check.ok and "skipped round 4" in check.detail


def test_loss_that_did_not_fall_fails() -> None:
    log = Log()
    for r in range(1, 4):
        log.round(5.0 * r, r, loss=5.5)
    check = loss_fell(log.stop(30).records)
    assert not check.ok and "5.0000 -> 5.5000" in check.detail


def test_only_killed_and_cleanly_stopped_exits_are_intended() -> None:
    log = healthy(2)
    log.add(9, "fault", kind="kill", peers=[1], duration_s=3)
    log.add(9.1, "exit", peer=1, code=-9)
    log.add(12, "spawn", peer=1, pid=200, incarnation=1)
    log.records.sort(key=lambda r: r["t"])
    assert no_unexpected_exits(log.records).ok
    crashed = healthy(2).add(9, "exit", peer=2, code=1)
    crashed.records.sort(key=lambda r: r["t"])
    check = no_unexpected_exits(crashed.records)
    assert not check.ok and "peer2 died (exit 1)" in check.detail
    # A SIGKILL nobody scheduled is a death too (e.g. the OOM killer).
    oom = healthy(2).add(9, "exit", peer=2, code=-9)
    oom.records.sort(key=lambda r: r["t"])
    assert not no_unexpected_exits(oom.records).ok
    hung = Log().round(5, 1).stop(10, codes={0: -9})
    check = no_unexpected_exits(hung.records)
    assert not check.ok and "when stopped" in check.detail


def test_tracebacks_fail() -> None:
    log = healthy(2).add(8, "exception", peer=1, text="Traceback...\nValueError: boom")
    check = no_exceptions(log.records)
    assert not check.ok and "ValueError: boom" in check.detail
    assert no_exceptions(healthy(2).records).ok
    group = "  + Exception Group Traceback\n    | AttributeError: 'X' has no 'y'\n    +-----\n"
    check = no_exceptions(healthy(2).add(8, "exception", peer=0, text=group).records)
    assert "AttributeError: 'X' has no 'y'" in check.detail


def restart_log(resume_after: float, origin: str = "saved") -> Log:
    log = Log()
    log.round(5, 1)
    log.add(6, "fault", kind="kill", peers=[1], duration_s=4)
    log.add(6.1, "exit", peer=1, code=-9)
    log.add(10, "spawn", peer=1, pid=300, incarnation=1)
    log.event(10 + resume_after, 1, "training", origin=origin)
    log.round(10 + resume_after + 5, 2)
    return log.stop(10 + resume_after + 10)


def test_restarted_peer_must_resume_in_time_and_from_its_state() -> None:
    bounds = Bounds(resume_s=30)
    ok = restarts_resumed(restart_log(12).records, bounds)
    assert ok.ok and dict(ok.figures)["max_resume_s"] == 12
    slow = restarts_resumed(restart_log(45).records, bounds)
    assert not slow.ok and "took 45s" in slow.detail
    fresh = restarts_resumed(restart_log(5, origin="fresh").records, bounds)
    assert not fresh.ok and "from scratch" in fresh.detail
    never = Log().add(10, "spawn", peer=1, pid=1, incarnation=1).stop(20)
    assert not restarts_resumed(never.records, bounds).ok
    crashed = Log().add(10, "spawn", peer=1, pid=1, incarnation=1).add(12, "exit", peer=1, code=1)
    assert "exited before it resumed" in restarts_resumed(crashed.stop(20).records, bounds).detail
    # Killed again by the schedule while starting up: not a failure to resume.
    rekilled = Log().add(10, "spawn", peer=1, pid=1, incarnation=1)
    rekilled.add(12, "fault", kind="kill", peers=[1], duration_s=3).add(
        12.1, "exit", peer=1, code=-9
    )
    rekilled.add(15, "spawn", peer=1, pid=2, incarnation=2).event(25, 1, "training", origin="saved")
    check = restarts_resumed(rekilled.stop(30).records, bounds)
    assert check.ok and dict(check.figures)["max_resume_s"] == 10


def test_liveness_counts_only_time_when_a_group_could_form() -> None:
    bounds = Bounds(min_group_size=2, liveness_s=20)
    # Rounds every 5 s, then nothing for 40 s while all three are up: fails.
    stalled = Log()
    for r in range(1, 4):
        stalled.round(5.0 * r, r)
    check = liveness(stalled.stop(55).records, bounds)
    assert not check.ok and "40s from 15s" in check.detail
    # The same 40 s gap while two of three are paused (one peer alone cannot average): ok.
    paused = Log()
    for r in range(1, 4):
        paused.round(5.0 * r, r)
    paused.add(15.5, "fault", kind="pause", peers=[1, 2], duration_s=38)
    paused.add(53.5, "heal", kind="pause", peers=[1, 2])
    paused.round(60, 4)
    assert liveness(paused.stop(62).records, bounds).ok
    # A partition 1 | 2 leaves a group of two on the majority side: it must keep going.
    split = Log()
    for r in range(1, 4):
        split.round(5.0 * r, r)
    split.add(15.5, "fault", kind="partition", peers=[0], duration_s=38)
    split.add(53.5, "heal", kind="partition", peers=[0])
    split.round(60, 4)
    assert not liveness(split.stop(62).records, bounds).ok
    # Rounds by the majority side during the partition keep it alive.
    for t in (25.0, 35.0, 45.0):
        split.round(t, 0, [1, 2])
    split.records.sort(key=lambda r: r["t"])
    assert liveness(split.records, bounds).ok


def test_a_solo_step_is_not_a_completed_round() -> None:
    log = Log()
    for t in range(5, 60, 5):
        log.round(float(t), t // 5, [0], status="local")
    check = liveness(log.stop(60).records, Bounds(liveness_s=20))
    assert not check.ok
