"""DiLoCo's rounds among simulated peers: inner steps as virtual time, the real form_group and
the real all-reduce, peers replaced as the run goes."""

from __future__ import annotations

from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.sim.rounds import RoundsScenario, run_rounds


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
