"""SWARM's faults with real peers in virtual time (tests/harness/sim_swarm.py): a killed stage
server's hops are retried elsewhere exactly once, and a server moves to the bottleneck stage.
tests/integration/test_swarm_join.py has the same checks on real processes (slow tier)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import trio

from swarmd.node.algorithms.swarm.strategy import AUDIT_FILE, COMPLETED_FILE
from swarmd.node.sim.peers import Event, SimPeer
from tests.harness.runs import SWARM_RUN
from tests.harness.sim_swarm import SwarmSim, swarm_run

#: The retry test's micro-batches.
STEPS = 240


def _micro_batches(path: Path) -> collections.Counter[str]:
    return collections.Counter(line.split("/")[0] for line in path.read_text().split())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_killed_server_s_hops_are_retried_and_no_micro_batch_is_lost_or_doubled(
    tmp_path: Path, seed: int
) -> None:
    got: dict[str, Any] = {}

    async def body(run: SwarmSim) -> None:
        audit = {"role": "server", "swarm_audit": True}
        s0, s1a, s1b, s2 = (
            run.add(name, stage=stage, **audit)
            for name, stage in [("s0", 0), ("s1a", 1), ("s1b", 1), ("s2", 2)]
        )
        for s in (s0, s1a, s1b, s2):
            await run.next(s, "stage")
        trainer = run.add("t", role="trainer", max_steps=STEPS, swarm_audit=True)
        await run.trained_round(s1a)
        run.sim.kill(s1a)
        killed_at = trainer.net.monotonic()
        got["done"] = await run.next(trainer, "trainer_done", limit_s=240)
        got["took_s"] = trainer.net.monotonic() - killed_at
        got["retried"] = trainer.out.of("stage_retry")

    sim = swarm_run(tmp_path, SWARM_RUN, body, seed=seed)
    assert [p.error for p in sim.peers] == [None] * len(sim.peers)
    done = got["done"]
    assert done["micro_batches"] == STEPS and done["retries"] >= 1, done
    assert got["took_s"] < 200, got["took_s"]
    retried = got["retried"]
    assert retried, done
    assert all(e["stage"] == 1 for e in retried), retried
    completed = (tmp_path / "t" / COMPLETED_FILE).read_text().split()
    assert sorted(int(c) for c in completed) == list(range(STEPS))  # each once, none lost
    applied = {n: _micro_batches(tmp_path / n / AUDIT_FILE) for n in ("s0", "s1a", "s1b", "s2")}
    # Stages 0 and 2 had one server each: every micro-batch applied there exactly once.
    for name in ("s0", "s2"):
        assert len(applied[name]) == STEPS and set(applied[name].values()) == {1}, name
    # Stage 1: each server applied a micro-batch at most once; together they applied each; one
    # in both was applied by the victim and never answered (the kill cut it off), then redone
    # on the survivor: at most the trainer's micro-batches in flight then.
    victim, survivor = applied["s1a"], applied["s1b"]
    assert set(victim.values()) <= {1} and set(survivor.values()) == {1}
    assert len(set(victim) | set(survivor)) == STEPS
    assert len(set(victim) & set(survivor)) <= 4, set(victim) & set(survivor)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_server_moves_to_the_bottleneck_stage(tmp_path: Path, seed: int) -> None:
    """3 servers on stage 0, 1 slowed server on stage 1 (4x the device time): one stage-0
    server moves to stage 1 with stage 1's state and averages there; stage 0 keeps its other
    two, and no other server moves."""
    run = SWARM_RUN.replace("swarm_stages = 3", "swarm_stages = 2").replace(
        "swarm_rebalance_s = 0", "swarm_rebalance_s = 4"
    )
    moves: list[Event] = []

    async def body(run: SwarmSim) -> None:
        servers = [run.add(n, role="server", stage=0) for n in "abc"]
        slow = run.add("slow", role="server", stage=1, slowdown=4.0)
        for s in (*servers, slow):
            await run.next(s, "stage")
        run.add("t", role="trainer")

        def moved() -> SimPeer | None:
            return next((s for s in servers if s.out.of("rebalance")), None)

        mover: SimPeer | None = None
        for _ in range(900):  # 90 virtual seconds
            if (mover := moved()) is not None:
                break
            await trio.sleep(0.1)
        assert mover is not None, [(s.name, s.out.events[-5:]) for s in servers]
        (move,) = mover.out.of("rebalance")
        assert (move["source"], move["target"]) == (0, 1) and move["after"] > move["before"], move
        took = await run.next(mover, "stage", lambda e: e["t"] >= move["t"])
        assert took["stage"] == 1 and took["origin"] == "group" and took["round"] >= 1, took
        e = await run.next(mover, "stage_round", lambda e: e["group_size"] >= 2)
        assert e["stage"] == 1, e
        # Stage 0 kept the other two, which go on averaging together there.
        for s in servers:
            if s is not mover:
                e = await run.next(s, "stage_round", lambda e: e["group_size"] == 2)
                assert e["stage"] == 0, e
        moves.extend(e for s in (*servers, slow) for e in s.out.of("rebalance"))

    sim = swarm_run(tmp_path, run, body, seed=seed)
    assert [p.error for p in sim.peers] == [None] * len(sim.peers)
    # Only one server moved, by the time the others averaged again ...
    assert len(moves) == 1, moves
    # ... and none after, until the run was stopped.
    later = [e for p in sim.peers for e in p.out.of("rebalance")]
    assert len(later) == 1, [(e["source"], e["target"], e["before"], e["after"]) for e in later]
