"""Client mode end to end on loopback (issue 27): a peer started with `--reachable no` trains
in a DiLoCo, streaming DiLoCo or DeMo run, its updates go into the group's average, and every member
ends each round in one state; peers left on `auto` are dialled back by the bootstrap node and
stay servers. The same on real NAT between network namespaces is tests/multinode/test_nat.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.join import events_until_exit, join_cmd, start_bootstrap
from tests.harness.processes import ProcessGroup
from tests.harness.runs import DEMO_RUN, STREAMING_RUN, SWARM_RUN, TINY_RUN


# Streaming DiLoCo's client mode shares DiLoCo's matchmaking and reduce: slow tier.
@pytest.mark.parametrize(
    "algo", ["diloco", pytest.param("streaming-diloco", marks=pytest.mark.slow)]
)
def test_a_client_mode_peer_trains_with_two_servers(
    processes: ProcessGroup, tmp_path: Path, algo: str
) -> None:
    run = STREAMING_RUN if algo == "streaming-diloco" else TINY_RUN
    (tmp_path / "run.toml").write_text(run.replace("min_group_size = 2", "min_group_size = 3"))
    boot = start_bootstrap(processes, tmp_path)
    procs = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml")),
            join_cmd(tmp_path, "p1", boot),
            join_cmd(tmp_path, "p2", boot, "--reachable", "no"),
        ]
    )
    runs = [events_until_exit(p) for p in procs]
    assert all(p.process.returncode == 0 for p in procs), [p.stderr_tail for p in procs]
    modes = [next(e for e in events if e["event"] == "reachability") for events in runs]
    assert [m["mode"] for m in modes] == ["server", "server", "client"], modes
    assert [m["verdict"] for m in modes] == ["reachable", "reachable", "unreachable"], modes
    full: dict[int, set[str]] = {}
    for events in runs:
        outer = [e for e in events if e["event"] == "outer_step"]
        losses = [e["val_loss"] for e in outer if e["val_loss"] is not None]
        start = next(e["val_loss"] for e in events if e["event"] == "validation")
        assert losses and losses[-1] < start, outer
        for e in outer:
            if e["group_size"] == 3 and e["dropped"] == 0 and e["status"] == "averaged":
                # A streaming peer's rounds are turns (one fragment each).
                full.setdefault(e.get("turn", e["round"]), set()).add(e["state_hash"])
    assert len(full) >= 3, full  # the client averaged with the two servers, round after round
    assert all(len(hashes) == 1 for hashes in full.values()), full


def test_two_client_mode_peers_train_demo_with_one_server(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """DeMo exchanges every inner step: the two clients push to the one reachable peer and
    pull everything from it, each other's payloads included (signed, so the server cannot
    alter them); all three hold the very same parameters at every boundary."""
    (tmp_path / "run.toml").write_text(DEMO_RUN)
    boot = start_bootstrap(processes, tmp_path)
    create = ("--create-run", str(tmp_path / "run.toml"))
    procs = processes.start_many(
        [
            join_cmd(tmp_path, "p0", boot, *create, steps=30),
            join_cmd(tmp_path, "p1", boot, "--reachable", "no", steps=30),
            join_cmd(tmp_path, "p2", boot, "--reachable", "no", steps=30),
        ]
    )
    runs = [events_until_exit(p) for p in procs]
    assert all(p.process.returncode == 0 for p in procs), [p.stderr_tail for p in procs]
    modes = [next(e["mode"] for e in events if e["event"] == "reachability") for events in runs]
    assert modes == ["server", "client", "client"], modes
    hashes: dict[int, set[str]] = {}
    for events in runs:
        rounds = [e for e in events if e["event"] == "outer_step"]
        assert sum(e["group_size"] == 3 for e in rounds) >= 4, rounds
        for e in rounds:
            hashes.setdefault(e["round"], set()).add(e["state_hash"])
        assert rounds[-1]["val_loss"] < rounds[0]["val_loss"], rounds
    assert len(hashes) >= 5 and all(len(h) == 1 for h in hashes.values()), hashes


def test_a_swarm_server_nobody_can_dial_is_refused_with_the_reason(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(SWARM_RUN)
    boot = start_bootstrap(processes, tmp_path)
    cmd = join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"))
    proc = processes.start([*cmd, "--role", "server", "--stage", "0", "--reachable", "no"])
    events_until_exit(proc, timeout=60)
    assert proc.process.returncode not in (0, None)
    err = "".join(proc.stderr_tail)
    assert "uses swarm, whose peers must all be reachable" in err, err
    assert "can join as --role trainer" in err, err
