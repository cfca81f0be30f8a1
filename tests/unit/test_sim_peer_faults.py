"""The peers scenario's pause and churn (swarmd/node/sim/peer_run.py): a real peer paused as
SIGSTOP pauses a process, then resumed, and peers dying after lifetimes drawn from the seed,
each replaced by a newcomer; the living end on one state."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmd.node.sim.peer_run import PeerChurn, PeerFault, PeersScenario, run_peers
from swarmd.node.sim.scenario import ScenarioError, load_scenario

#: Pause peer 2 from this virtual second ...
PAUSE_AT = 15.0
#: ... to this one: longer than a round's deadlines, shorter than the others' run.
RESUME_AT = 75.0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_paused_peer_is_left_out_while_paused_then_ends_on_the_others_state(seed: int) -> None:
    """A round in flight when the member stops waits its deadlines (seen: up to 32 s), then
    the other two go on as a pair while it is stopped; once it goes on it takes their line,
    and all three end on one state. (Swept: seeds 0-7.)"""
    scenario = PeersScenario(
        peers=3,
        rounds=60,
        faults=(
            PeerFault(at_s=PAUSE_AT, pause=(2,)),
            PeerFault(at_s=RESUME_AT, resume=(2,)),
        ),
        seed=seed,
    )
    report = run_peers(scenario)
    assert report.errors == {}, report.errors
    lines, times = report.timelines, report.times
    for name in ("p0", "p1"):
        during = [
            e for e, t in zip(lines[name], times[name], strict=True) if PAUSE_AT < t < RESUME_AT
        ]
        assert any(s == "averaged" and g == 2 for _, s, g in during), (name, lines[name])
    assert report.end_states == 1 and report.common_round == 60, lines


def test_peers_dying_of_churn_are_replaced_and_the_living_end_on_one_state() -> None:
    scenario = PeersScenario(
        peers=4,
        rounds=15,
        churn=PeerChurn(lifetime_s=40.0, replace_s=5.0, until_s=60.0),
        seed=0,
    )
    report = run_peers(scenario)
    assert report.errors == {}, report.errors
    # Some died of churn before their rounds were done; each was replaced.
    assert report.killed >= 1 and report.joined == report.killed, report
    assert report.end_states == 1, report.timelines
    assert report.averaged_share > 0.6, report.averaged_share
    # One seed, one run: the same lifetimes, the same calls.
    again = run_peers(scenario)
    assert (again.killed, again.calls, again.log_hash) == (
        report.killed,
        report.calls,
        report.log_hash,
    )


def test_a_churn_table_loads_from_a_scenario_file_and_bad_values_are_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "churn.toml"
    path.write_text('kind = "peers"\n[churn]\nlifetime_s = 60\nreplace_s = 5\n')
    spec = load_scenario(path).spec
    assert isinstance(spec, PeersScenario)
    assert spec.churn == PeerChurn(lifetime_s=60.0, replace_s=5.0)
    path.write_text('kind = "peers"\n[churn]\nlifetime_s = -1\n')
    with pytest.raises(ScenarioError, match="churn"):
        load_scenario(path)
    path.write_text('kind = "peers"\n[[faults]]\nat_s = 1\npause = [7]\n')
    with pytest.raises(ScenarioError, match="outside"):
        load_scenario(path)
