"""The dashboard's SWARM view: stages, their servers and rates, the bottleneck, and events
for moves and for a stage left without a server (and served again)."""

from __future__ import annotations

import json

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.dashboard.board import Board
from swarmd.node.dashboard.reading import Reading, RunInfo
from swarmd.node.dashboard.views import stages_view

A, B, C = ("a" * 52, "b" * 52, "c" * 52)
RUN = RunInfo({"algo": "swarm", "swarm_stages": 3}, "h" * 16, "creator", 1.0)


def servers(placement: dict[str, tuple[int, float]], state: str = "serving") -> Reading:
    found = Reading(run=RUN)
    for peer, (stage, rate) in placement.items():
        found.heartbeats[peer] = "127.0.0.1:1"
        found.stages[peer] = StageRecord(stage, "127.0.0.1:1", rate, 0, state, 4)
    return found


def test_stages_rates_and_the_bottleneck_including_an_empty_stage() -> None:
    board = Board("r")
    board.update(servers({A: (0, 5.0), B: (0, 4.0), C: (1, 3.0)}), 1.0)
    view = stages_view(board)
    assert [s["rate"] for s in view["stages"]] == [9.0, 3.0, 0.0]
    assert view["bottleneck"] == 2 and view["pipeline_rate"] == 0.0  # stage 2 has none
    assert [len(s["servers"]) for s in view["stages"]] == [2, 1, 0]
    assert view["stages"][0]["servers"][0]["label"] == A[:10]
    json.dumps(view, allow_nan=False)
    assert [e["text"] for e in board.events if e["kind"] == "stage"] == [
        "stage 2 has no server: trainers wait"
    ]


def test_a_move_and_a_recovery_are_events() -> None:
    board = Board("r")
    board.update(servers({A: (0, 5.0), B: (0, 4.0), C: (1, 3.0)}), 1.0)
    board.update(servers({A: (0, 5.0), B: (2, 4.0), C: (1, 3.0)}), 2.0)
    texts = [e["text"] for e in board.events]
    assert f"{B[:10]} moved from stage 0 to stage 2" in texts
    assert "stage 2 is served again" in texts
    assert stages_view(board)["bottleneck"] == 1


def test_a_run_that_is_not_swarm_has_no_stages() -> None:
    board = Board("r")
    board.update(Reading(run=RunInfo({"algo": "diloco"}, "h" * 16, "c", 1.0)), 1.0)
    assert stages_view(board) == {
        "stages": [],
        "bottleneck": None,
        "pipeline_rate": None,
        "recoveries": [],
    }
