"""`grouping = "grid"` in a daemon (issue 46): with more live peers than a group holds, a
DiLoCo round takes a roll call (one gathering of every live peer, whose leader commits the
roster), then averages on the grid planned from that roster (averaging/grid.py), through
real `swarmd join` processes: every round that all three averaged ends on one state.

Planned from each peer's own read of the heartbeats, this test passed 1 run in 3: peers
whose views differed planned different grids, and the rounds forked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.join import events_until_exit, join_cmd, start_bootstrap
from tests.harness.processes import ProcessGroup
from tests.harness.runs import STREAMING_RUN, TINY_RUN

PEERS = 3
#: 20 rounds of H = 5: the first peers up average in a pair (flat: they see 2 live peers)
#: until the third one's heartbeat is read, a second or two in.
STEPS = 100
#: The streaming run's length in turns (H = 4 in 2 fragments: 2 inner steps a turn).
TURNS = 20


def _outer(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "outer_step"]


# Covered in the default suite by tests/unit/test_sim_grid_peers.py (real peers in virtual
# time: after the creator's kill, three peers in groups of 2, every full round on one state,
# averaging across rows, the run ending at its total_steps on one state); 25 s here.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_peers_in_groups_of_two_average_on_the_grid(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The run ends at its total_steps (20 rounds), not at each peer's --max-steps: a peer
    that started late stops with the others, and all three end on one state."""
    run = TINY_RUN + f'target_group_size = 2\ngrouping = "grid"\ntotal_steps = {STEPS}\n'
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    procs = processes.start_many(
        [join_cmd(tmp_path, f"p{i}", boot, *create * (i == 0), steps=None) for i in range(PEERS)]
    )
    runs = [events_until_exit(p, timeout=240) for p in procs]
    for i, events in enumerate(runs):
        print(f"p{i}:", [(e["round"], e["status"], e["group_size"]) for e in _outer(events)])
    assert all(p.process.returncode == 0 for p in procs), [p.stderr_tail for p in procs]
    steps = [e for events in runs for e in _outer(events)]
    rounds: dict[int, list[dict[str, Any]]] = {}
    for e in steps:
        rounds.setdefault(e["round"], []).append(e)
    # Rounds all three averaged in: one roster, one grid, one state each.
    full = {
        r: es for r, es in rounds.items()
        if len(es) == PEERS and all(e["status"] == "averaged" for e in es)
    }  # fmt: skip
    assert len(full) >= 5, rounds
    for r, es in full.items():
        assert len({e["state_hash"] for e in es}) == 1, (r, es)
    # With groups of 2, a peer that met both others averaged across rows: on the grid.
    assert any(max(e["group_size"] for e in es) == PEERS for es in full.values()), full
    # The run's end: every peer's last state is the run's last round, the same state.
    last = [_outer(events)[-1] for events in runs]
    assert {e["round"] for e in last} == {STEPS // 5}, last
    assert len({e["state_hash"] for e in last}) == 1, last


# In virtual time in the default suite (tests/unit/test_sim_grid_peers.py, three seeds);
# ~60 s here.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_creator_killed_mid_run_the_grid_peers_end_on_one_state(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Issue 46: no peer is special. Four peers in groups of 2 (a 2 x 2 grid); the run's
    creator is killed after its third outer step. Its heartbeat outlives it by up to 30 s, so
    roll calls wait for it until attendance excuses it; the three others then keep averaging
    on a grid of three and end on one state, the run's last (its total_steps)."""
    peers = 4
    run = TINY_RUN + f'target_group_size = 2\ngrouping = "grid"\ntotal_steps = {STEPS}\n'
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    creator, *others = processes.start_many(
        [join_cmd(tmp_path, f"p{i}", boot, *create * (i == 0), steps=None) for i in range(peers)]
    )
    seen = 0
    while seen < 3:
        seen += creator.receive(timeout=60)["event"] == "outer_step"
    creator.process.kill()
    runs = [events_until_exit(p, timeout=200) for p in others]
    for i, events in enumerate(runs, 1):
        print(f"p{i}:", [(e["round"], e["status"], e["group_size"]) for e in _outer(events)])
    assert all(p.process.returncode == 0 for p in others), [p.stderr_tail for p in others]
    # The lines merge: after the kill, the survivors keep averaging together, every round
    # all three averaged in ending on one state, and the run's last state is the same.
    rounds: dict[int, list[dict[str, Any]]] = {}
    for events in runs:
        for e in _outer(events):
            rounds.setdefault(e["round"], []).append(e)
    after = {
        r: es for r, es in rounds.items()
        if r > 4 and len(es) == peers - 1 and all(e["status"] == "averaged" for e in es)
    }  # fmt: skip
    assert len(after) >= 8, rounds
    for r, es in after.items():
        assert len({e["state_hash"] for e in es}) == 1, (r, es)
    # With groups of 2, a peer that met both others averaged across rows: on the grid.
    assert any(max(e["group_size"] for e in es) == peers - 1 for es in after.values()), after
    last = [_outer(events)[-1] for events in runs]
    assert {e["round"] for e in last} == {STEPS // 5}, last
    assert len({e["state_hash"] for e in last}) == 1, last


@pytest.mark.timeout(300)
def test_three_streaming_peers_in_groups_of_two_average_fragments_on_the_grid(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Streaming DiLoCo on the grid (issue 46 item 4): each fragment round takes the roll
    call and grid a DiLoCo round takes, its rows' error feedback kept per fragment. Three
    peers in groups of 2: every turn all three averaged in ends on one state, and peers met
    both others (across rows). Flat, they were a pair and a lone peer on two state lines.
    The run ends at its total_steps (20 turns of H/P = 2 steps), and all three leave on one
    state of its last turn (peer/runend.py, as DiLoCo's peers do)."""
    run = STREAMING_RUN + f'target_group_size = 2\ngrouping = "grid"\ntotal_steps = {TURNS * 2}\n'
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    procs = processes.start_many(
        [join_cmd(tmp_path, f"p{i}", boot, *create * (i == 0), steps=None) for i in range(PEERS)]
    )
    runs = [events_until_exit(p, timeout=240) for p in procs]
    for i, events in enumerate(runs):
        print(f"p{i}:", [(e.get("turn"), e["status"], e["group_size"]) for e in _outer(events)])
    assert all(p.process.returncode == 0 for p in procs), [p.stderr_tail for p in procs]
    turns: dict[int, list[dict[str, Any]]] = {}
    for events in runs:
        for e in _outer(events):
            if e["status"] != "synced":
                turns.setdefault(e["turn"], []).append(e)
    full = {
        t: es for t, es in turns.items()
        if len(es) == PEERS and all(e["status"] == "averaged" for e in es)
    }  # fmt: skip
    assert len(full) >= 6, turns
    # A split turn's message carries each peer's warnings. Seen once, in a clean-clone
    # rehearsal on 2026-12-01 (turn 11 of 20, after a late joiner), with a catch-up change
    # since taken back; not reproduced in 8 process runs nor in 84 simulated ones with late
    # joiners and uneven speeds.
    warned = [f"p{i}: {line}" for i, p in enumerate(procs) for line in p.stderr_tail
              if "WARNING" in line or "ERROR" in line]  # fmt: skip
    for t, es in full.items():
        hashes = [(e["state_hash"][:8], e["group_size"]) for e in es]
        assert len({e["state_hash"] for e in es}) == 1, (t, hashes, warned)
    # Both fragments went over the grid, each with a peer that met both others.
    met_all = {es[0]["fragment"] for es in full.values() if max(e["group_size"] for e in es) == 3}
    assert met_all == {0, 1}, full
    last = [_outer(events)[-1] for events in runs]
    assert {e["turn"] for e in last} == {TURNS}, last
    assert len({e["state_hash"] for e in last}) == 1, last
