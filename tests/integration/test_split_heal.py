"""Two groups that formed apart and never met merge once they can reach each other.

A running peer follows only the state adverts of peers it averaged with or downloaded from
(strangers' adverts once took over every honest peer), and the matchmaking key carries the
state hash. So two groups whose first rounds formed apart hold different states, never share a
matchmaking key, and never see each other's adverts: seen on four netns hosts in CI, where the
first round formed two pairs and they averaged apart for the rest of the run. The run's creator
anchors which state is the run's (statesync/catchup.py); this test makes the split on purpose
(each pair's outgoing calls to the other pair fail, the DHT bootstrap is reachable by all),
then heals it and expects all four to average together with one state.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.processes import Proc, ProcessGroup, swarmd_cmd
from tests.harness.runs import TINY_RUN

HOSTS = ["127.0.0.21", "127.0.0.22", "127.0.0.23", "127.0.0.24"]  # creator, p1 | p2, p3
SIDES = [HOSTS[:2], HOSTS[2:]]

Event = dict[str, Any]


def write_faults(path: Path, plan: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, path)  # the peer re-reads the plan within 0.2 s


def averaged(events: list[Event], size: int) -> list[Event]:
    """Outer steps averaged by `size` members with nobody dropped. A member late to a round
    can report the group's size and still end apart: seen after the heal, the other three
    gave up on its part and fell back, and it reduced its own part from itself alone
    (`dropped` 3), so its state differed from theirs until its next catch-up."""
    return [
        e
        for e in events
        if e.get("event") == "outer_step"
        and e["status"] == "averaged"
        and e["group_size"] == size
        and e["dropped"] == 0
    ]


def timeline(events: list[list[Event]]) -> str:
    return "\n".join(
        f"{host}: "
        + ", ".join(
            f"{e['event']}(r{e.get('round')},{e.get('status', '')},g{e.get('group_size')})"
            for e in got[-12:]
        )
        for host, got in zip(HOSTS, events, strict=True)
    )


def _hashes(events: list[list[Event]]) -> str:
    """Each peer's outer steps as round:status:group:dropped:hash, and its state syncs: what a
    failure of the sides' apartness shows (seen once in a CI rehearsal, not yet explained:
    a peer of one side whose first outer step held the other side's state)."""
    lines = []
    for host, got in zip(HOSTS, events, strict=True):
        steps = [
            f"r{e.get('round')}:{e.get('status', 'sync')}:g{e.get('group_size')}:"
            f"d{e.get('dropped')}:{str(e.get('state_hash'))[:8]}"
            for e in got
            if e["event"] in ("outer_step", "state_synced", "training")
        ]
        lines.append(f"{host}: {', '.join(steps)}")
    return "\n".join(lines)


def collect(procs: list[Proc], events: list[list[Event]], until: float) -> None:
    """Reads every peer's events that arrive before ``until``, none blocking the others."""
    while time.monotonic() < until:
        for proc, got in zip(procs, events, strict=True):
            while not proc._lines.empty():
                got.append(proc.receive(timeout=1))
            assert proc.process.poll() is None, "".join(proc.stderr_tail)
        time.sleep(0.1)


@pytest.mark.slow  # 80 s; tests/unit/test_sim_peers.py runs the same peers in virtual time
@pytest.mark.timeout(240)
def test_groups_that_formed_apart_merge_on_the_creators_state(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = processes.start(
        swarmd_cmd("dht", "--listen", "127.0.0.20:0", "--state-dir", str(tmp_path / "boot"))
    )
    plans = [tmp_path / f"faults{i}.json" for i in range(len(HOSTS))]
    for i, plan in enumerate(plans):
        write_faults(plan, {"blocked": SIDES[1 - i // 2]})

    def join(i: int, *extra: str) -> list[str]:
        return swarmd_cmd(
            "join", "--run", "split", "--peers", boot.address, "--listen", f"{HOSTS[i]}:0",
            "--log-format", "json", "--state-dir", str(tmp_path / f"p{i}"),
            "--progress-interval", "600", *extra,
        )  # fmt: skip

    # All four at once (imports overlap), so that each pair's first round is a round of two.
    procs = processes.start_many(
        [
            ["env", f"SWARMD_FAULTS={plans[i]}", *join(i, *extra)]
            for i, extra in enumerate([("--create-run", str(tmp_path / "run.toml")), (), (), ()])
        ]
    )
    events: list[list[Event]] = [[] for _ in procs]

    # 1. Apart: each side trains on its own line for a few rounds (in pairs, or alone when a
    # round goes wrong under the load of five processes on two cores: a split all the same).
    deadline = time.monotonic() + 120
    while not all(sum(e["event"] == "outer_step" for e in got) >= 4 for got in events):
        assert time.monotonic() < deadline, f"the sides did not train apart:\n{timeline(events)}"
        collect(procs, events, time.monotonic() + 1)
    assert not any(e.get("group_size") == 4 for got in events for e in got)
    apart = [[e["state_hash"] for e in got if e["event"] == "outer_step"] for got in events]
    assert not set(apart[0] + apart[1]) & set(apart[2] + apart[3]), _hashes(events)

    # 2. Healed: all four average together, holding one state.
    for plan in plans:
        write_faults(plan, {})
    healed_at = [len(got) for got in events]
    deadline = time.monotonic() + 90
    while True:
        fours = [averaged(got[n:], 4) for got, n in zip(events, healed_at, strict=True)]
        rounds = [{e["round"]: e["state_hash"] for e in f} for f in fours]
        common = set.intersection(*(set(r) for r in rounds))
        if common:
            break
        assert time.monotonic() < deadline, (
            f"the two groups never averaged together after the heal:\n{timeline(events)}"
        )
        collect(procs, events, time.monotonic() + 1)
    last = max(common)
    assert len({r[last] for r in rounds}) == 1, rounds
    # One line was given up for the other by a download (which one depends on whether the
    # creator's own rounds were shared when the calls came back: a creator that only ever
    # trained alone anchors nothing, and then follows the other side's state).
    assert any(
        e["event"] == "state_synced" or e.get("status") == "synced"
        for got, n in zip(events, healed_at, strict=True)
        for e in got[n:]
    ), timeline(events)
