"""DiLoCo's rounds among simulated peers: inner steps as virtual time, the real form_group and
the real all-reduce, peers replaced as the run goes."""

from __future__ import annotations

import pytest

from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.sim.rounds import Fault, RoundsScenario, run_rounds


def scenario(**kw: object) -> RoundsScenario:
    base = RoundsScenario(
        peers=8,
        rounds=3,
        params=2000,
        join_window_s=10,
        matchmaking=MatchmakingConfig(target_group_size=8),
        seed=4,
    )
    return RoundsScenario(**{**base.__dict__, **kw})


def test_peers_that_fit_one_group_average_every_round_together() -> None:
    report = run_rounds(scenario(speed_sigma=0.0))
    assert len(report.records) == 8 * 3
    assert all(r.group_size == 8 and r.dropped == 0 for r in report.records)
    # Equal speeds: everyone is ready together and nobody waits out the gather window.
    assert report.median_form_s < 5.0
    # Each peer sent its 2000 int8 values (~2 kB a part) and reduced parts, a few kB a round.
    assert 1_000 < report.bytes_per_peer_round < 100_000


def test_replaced_peers_take_part_and_the_rest_keep_averaging() -> None:
    report = run_rounds(scenario(rounds=4, churn=0.25))
    assert report.replaced >= 2
    newcomers = {r.peer for r in report.records if r.peer >= 8}
    assert newcomers, "no replacement peer made a round"
    assert any(r.group_size > 1 for r in report.records if r.peer >= 8)
    assert report.averaged_share > 0.5


def test_one_seed_replays_the_same_rounds() -> None:
    first, again = run_rounds(scenario()), run_rounds(scenario())
    assert first.log_hash == again.log_hash and first.records == again.records


def test_a_peer_declaring_a_huge_weight_is_dropped_and_banned_by_every_honest_peer() -> None:
    report = run_rounds(scenario(rounds=3, faults=(Fault(1, "liar", 0.15, lie="weight"),)))
    liars = {r.peer for r in report.records if r.lie}
    assert len(liars) == 1
    lied = [r for r in report.records if r.lie]
    assert lied and all(r.round == 1 for r in lied)
    honest_in_round_1 = [r for r in report.records if r.round == 1 and not r.lie]
    # Every honest member left the liar out of its round, then banned it.
    assert honest_in_round_1 and all(r.dropped == 1 for r in honest_in_round_1)
    assert report.bans == 7


def test_faults_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        Fault(1, "explode", 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share"):
        Fault(1, "kill", 1.0)
    with pytest.raises(ValueError, match="lie"):
        Fault(1, "liar", 0.1, lie="truth")
    built = RoundsScenario(faults=({"at_round": 2, "kind": "slow", "share": 0.5},))  # type: ignore[arg-type]
    assert built.faults == (Fault(2, "slow", 0.5),)


def test_the_committed_scenario_files_load() -> None:
    from pathlib import Path

    from swarmd.node.sim.scenario import load_scenario

    files = sorted((Path(__file__).parents[2] / "deploy" / "sim").glob("*.toml"))
    assert {f.name for f in files} >= {"dht.toml", "groups.toml", "diloco.toml"}
    kinds = {type(load_scenario(f).spec).__name__ for f in files}
    assert kinds == {"DhtScenario", "MatchScenario", "RoundsScenario"}
