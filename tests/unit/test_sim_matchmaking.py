"""DiLoCo's matchmaking (the real `form_group`) among simulated peers, in virtual time."""

from __future__ import annotations

from swarmd.node.sim.matchmaking import MatchScenario, run_matchmaking, with_target


def test_peers_that_fit_one_group_all_meet_every_round() -> None:
    report = run_matchmaking(with_target(MatchScenario(peers=12, rounds=2, seed=1), 16))
    for figures in report.rounds:
        assert (figures.groups, figures.sizes, figures.alone) == (1, (12,), 0)
        assert figures.inconsistent == 0 and figures.missing == 0
        # Everyone was there within the 2 s arrival spread: nobody waits out the 5 s gather.
        assert figures.max_form_s < 5.0


def test_groups_never_exceed_the_target_and_holders_agree_on_their_members() -> None:
    report = run_matchmaking(with_target(MatchScenario(peers=20, rounds=2, seed=2), 4))
    for figures in report.rounds:
        assert figures.inconsistent == 0
        assert all(2 <= size <= 4 for size in figures.sizes)
        assert sum(figures.sizes) - figures.missing + figures.alone == 20
