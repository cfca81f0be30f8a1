"""`swarmd join --local-workers 2` as real processes: one peer of a run trains on two local
ranks (gloo), and survives one of them being killed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.join import events_until_exit, join_cmd, start_bootstrap, wait_for
from tests.harness.processes import ProcessGroup
from tests.harness.runs import TINY_RUN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_two_rank_peer_trains_with_two_others_and_all_agree(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 3")
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    creator, *others = processes.start_many(
        [
            join_cmd(
                tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"),
                "--local-workers", "2",
            ),
            join_cmd(tmp_path, "p1", boot),
            join_cmd(tmp_path, "p2", boot),
        ]
    )  # fmt: skip
    runs = [events_until_exit(p, timeout=180) for p in [creator, *others]]
    assert all(p.process.returncode == 0 for p in [creator, *others])
    local = [e for e in runs[0] if e["event"] == "local_ranks"]
    assert len(local) == 1 and local[0]["workers"] == 2 and len(local[0]["pids"]) == 1
    assert not _alive(local[0]["pids"][0])  # rank 1 stopped with its peer
    full: dict[int, set[str]] = {}
    for events in runs:
        outer = [e for e in events if e["event"] == "outer_step"]
        assert any(e["status"] == "averaged" and e["group_size"] == 3 for e in outer), outer
        start = next(e["val_loss"] for e in events if e["event"] == "validation")
        assert outer[-1]["val_loss"] < start
        for e in outer:
            if e["group_size"] == 3 and e["dropped"] == 0:
                full.setdefault(e["round"], set()).add(e["state_hash"])
    # The two-rank peer's states are the group's: it averaged the same vectors.
    assert full and all(len(hashes) == 1 for hashes in full.values()), full


ALGOS = {
    "streaming-diloco": 'algo = "streaming-diloco"\nfragments = 2\ninner_steps = 4\n',
    "demo": 'algo = "demo"\ndemo_topk = 8\ndemo_chunk = 16\n',
}


# DeMo's path through local ranks (GRADS, then rank 0's step broadcast) is also checked in
# one process in test_local_ranks.py; its daemon run is opt-in to keep CI's suite short.
@pytest.mark.parametrize("algo", ["streaming-diloco", pytest.param("demo", marks=pytest.mark.slow)])
def test_a_two_rank_peer_trains_streaming_and_demo_with_another(
    processes: ProcessGroup, tmp_path: Path, algo: str
) -> None:
    base = TINY_RUN.replace("inner_steps = 5\n", "") if algo != "demo" else TINY_RUN
    (tmp_path / "run.toml").write_text(base + ALGOS[algo])
    boot = start_bootstrap(processes, tmp_path)
    peers = processes.start_many(
        [
            join_cmd(
                tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"),
                "--local-workers", "2", steps=24,
            ),
            join_cmd(tmp_path, "p1", boot, steps=24),
        ],
        timeout=120,
    )  # fmt: skip
    runs = [events_until_exit(p, timeout=180) for p in peers]
    assert all(p.process.returncode == 0 for p in peers), [p.stderr_tail for p in peers]
    assert any(e["event"] == "local_ranks" and e["workers"] == 2 for e in runs[0])
    hashes: dict[int, set[str]] = {}
    for events in runs:
        rounds = [e for e in events if e["event"] == "outer_step" and e.get("state_hash")]
        assert any(e["group_size"] == 2 for e in rounds), rounds
        for e in rounds:
            if e["group_size"] == 2 and not e.get("dropped"):
                hashes.setdefault(e["round"], set()).add(e["state_hash"])
        start = next(e["val_loss"] for e in events if e["event"] == "validation")
        assert [e["val_loss"] for e in rounds if e.get("val_loss")][-1] < start
    # Where both averaged (or exchanged) alike, the two-rank peer holds the other's state.
    assert hashes and all(len(h) == 1 for h in hashes.values()), hashes


def test_more_ranks_than_the_run_allows_is_refused(processes: ProcessGroup, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN + "max_local_workers = 2\n")
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(
            tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"),
            "--local-workers", "3",
        )
    )  # fmt: skip
    events_until_exit(peer)
    assert peer.process.returncode == 2
    assert "allows at most 2 local ranks per peer" in "".join(peer.stderr_tail)


# Slow tier; default suite: a dead rank is reported (test_local_ranks) and a two-rank peer trains
# (above).
@pytest.mark.slow
def test_a_killed_rank_stops_the_peer_which_restarts_and_resumes(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 1")
    (tmp_path / "run.toml").write_text(run)
    boot = start_bootstrap(processes, tmp_path)
    peer = processes.start(
        join_cmd(
            tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"),
            "--local-workers", "2", steps=400,
        )
    )  # fmt: skip
    first = wait_for(peer, "local_ranks")
    rank1 = first["pids"][0]
    before = [wait_for(peer, "outer_step") for _ in range(3)]
    os.kill(rank1, signal.SIGKILL)
    events: list[dict[str, Any]] = events_until_exit(peer, timeout=240)
    kinds = [e["event"] for e in events]
    assert peer.process.returncode == 0, "".join(peer.stderr_tail)
    restart = next(e for e in events if e["event"] == "restarting")
    assert "local rank 1 was killed by SIGKILL" in restart["reason"], restart
    assert restart["attempt"] == 1
    # Started again from its own saved state, with a fresh rank 1, and trained on to the end.
    after = kinds.index("restarting")
    resumed = next(e for e in events[after:] if e["event"] == "resumed")
    assert resumed["round"] >= before[-1]["round"]
    again = next(e for e in events[after:] if e["event"] == "local_ranks")
    assert again["pids"] != first["pids"]
    later = [e for e in events[after:] if e["event"] == "outer_step"]
    assert later and later[-1]["round"] > resumed["round"]
    assert events[-1]["event"] == "stopped" and events[-1]["step"] == 400
    deadline = time.monotonic() + 10
    while _alive(again["pids"][0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(again["pids"][0]) and not _alive(rank1)
