"""SWARM pipelines in virtual time: the real trainer routing and server rebalancing against
modelled stage servers (swarmd/node/sim/swarm.py). Fixed seeds: a failure replays."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.sim.swarm import run_swarm
from swarmd.node.sim.swarm_spec import SwarmReport, SwarmScenario, without_rebalancing


def small(**changes: object) -> SwarmScenario:
    base = SwarmScenario(
        servers=24,
        trainers=6,
        duration_s=900.0,
        warmup_s=150.0,
        speed_sigma=0.8,
        lifetime_s=math.inf,
        swarm=SwarmConfig(stages=3, inflight=8, rebalance_s=30.0),
        seed=5,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_seed_replays_the_same_pipeline_run() -> None:
    scenario = small(servers=12, trainers=3, duration_s=300.0, warmup_s=60.0, lifetime_s=200.0)
    first, second = run_swarm(scenario), run_swarm(scenario)
    assert first.done > 0 and first.preempted > 0
    assert (first.log_hash, first.done, first.moves) == (second.log_hash, second.done, second.moves)
    other = run_swarm(dataclasses.replace(scenario, seed=6))
    assert other.log_hash != first.log_hash


def test_rebalancing_evens_out_unequal_servers_and_raises_throughput() -> None:
    scenario = small()
    moved, static = run_swarm(scenario), run_swarm(without_rebalancing(scenario))
    # The seed's servers, spread over the stages by count, leave the stages unequal ...
    assert static.moves == 0
    assert max(static.stage_balance) / min(static.stage_balance) > 1.4, static.stage_balance
    # ... and servers moving to the slowest stage bring them within the move rule's margin:
    # a stage exceeds another by less than 1.25 x a mover's rate (a server's rate is about a
    # third of a stage's total here).
    assert moved.moves > 0
    assert max(moved.stage_balance) / min(moved.stage_balance) < 1.4, moved.stage_balance
    assert moved.efficiency > static.efficiency
    assert moved.failed == static.failed == 0


def test_preempted_servers_cost_retries_not_micro_batches() -> None:
    # Servers live 5 virtual minutes on average and come back a minute later: calls in
    # flight at a preempted server time out and are retried elsewhere; none is given up.
    report = run_swarm(small(lifetime_s=300.0, downtime_s=60.0))
    assert report.preempted >= 24
    assert report.retries > 0
    assert report.failed == 0
    assert report.done > 0 and 0 < report.efficiency < 1


def liars() -> SwarmScenario:
    """Two of 24 servers answer every call x(-20), wherever they serve (the last stage's
    liar answers Last calls, checked as CheckLast)."""
    return small(liars=2, lifetime_s=math.inf)


@functools.cache
def unaudited() -> SwarmReport:
    """The liars' run with no audit at all: both audit tests' baseline, run once (the two
    tests share an xdist group, so one worker runs both)."""
    scenario = liars()
    return run_swarm(
        dataclasses.replace(scenario, swarm=dataclasses.replace(scenario.swarm, audit=0))
    )


@pytest.mark.xdist_group("sim_swarm_liars")
def test_audits_catch_lying_servers_and_keep_their_answers_out() -> None:
    unchecked, checked = unaudited(), run_swarm(liars())
    assert unchecked.caught == 0 and unchecked.poisoned > 0.05 * unchecked.done
    # Each of the 6 trainers catches each liar at least once ...
    assert checked.caught >= 12, checked.caught
    # ... after which it sends them nothing: a few poisoned micro-batches before each catch.
    assert checked.poisoned < unchecked.poisoned / 5, (checked.poisoned, unchecked.poisoned)
    assert checked.failed == 0


@pytest.mark.xdist_group("sim_swarm_liars")
def test_an_outsized_answer_is_audited_whatever_the_audit_share() -> None:
    # A liar's x(-20) answers are far larger than the stage's other servers' (grad_bound.py,
    # each server held to the others' norms): a trainer audits every such answer, so the
    # liars are caught even when almost no hop is audited by chance, and none of their
    # gradients is relayed to the stage before (whose servers cannot tell who lied).
    scenario = liars()
    unchecked = unaudited()
    checked = run_swarm(
        dataclasses.replace(scenario, swarm=dataclasses.replace(scenario.swarm, audit=1e-9))
    )
    assert checked.caught >= 12, checked.caught
    assert checked.poisoned < unchecked.poisoned / 50, (checked.poisoned, unchecked.poisoned)
    assert checked.failed == 0
