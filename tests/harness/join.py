"""`swarmd join` peers as real processes: the bootstrap node they meet through, their
command lines, and reading the JSON events they print (--log-format json) until the one a
test waits for, or until they exit."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from tests.harness.processes import Proc, ProcessGroup, swarmd_cmd


def start_bootstrap(processes: ProcessGroup, tmp: Path) -> str:
    """A `swarmd dht` node for the peers to join through; returns its address."""
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp / "boot")))
    return boot.address


def join_cmd(tmp: Path, name: str, boot: str, *extra: str, steps: int | None = 30) -> list[str]:
    """`swarmd join` of run "t" with its state in tmp/name, stopping after `steps` steps
    (None: at the run's end, its total_steps)."""
    budget = ("--max-steps", str(steps)) if steps is not None else ()
    return swarmd_cmd(
        "join", "--run", "t", "--peers", boot, "--log-format", "json",
        "--state-dir", str(tmp / name), "--progress-interval", "60", *budget, *extra,
    )  # fmt: skip


def events_until_exit(proc: Proc, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every event the peer prints until it exits (or `timeout`: its exit code tells which)."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            events.append(proc.receive(timeout=max(0.1, deadline - time.monotonic())))
        except AssertionError:
            break  # exited (or timed out: the exit code check below tells which)
    proc.process.wait(timeout=10)
    return events


def wait_for(proc: Proc, kind: str, timeout: float = 90.0) -> dict[str, Any]:
    """The peer's next event of `kind`, skipping the others."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = proc.receive(timeout=max(0.1, deadline - time.monotonic()))
        if event.get("event") == kind:
            return event
    raise AssertionError(f"no {kind!r} event within {timeout}s")


def stop_and_collect(procs: list[Proc]) -> list[list[dict[str, Any]]]:
    """SIGTERMs every peer (each leaves cleanly), then each one's events until it exited."""
    for p in procs:
        p.process.send_signal(signal.SIGTERM)
    return [events_until_exit(p, timeout=60) for p in procs]


def state_at(events: list[dict[str, Any]], round_: int) -> str:
    """The state a peer held at the end of ``round_``: its outer step's, or the group's state
    it took instead (its last report of that round, status "synced"). The events are those a
    peer prints, or a simulated peer records (swarmd/node/sim/peers.py): the same."""
    steps = [e for e in events if e["event"] == "outer_step" and e["round"] == round_]
    return str(steps[-1]["state_hash"])
