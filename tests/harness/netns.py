"""Hosts as network namespaces (deploy/netns.py) running real peers: the run file they
train, the fixture that starts their processes, and `Hosts`, which reads every host's events
as they come."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.processes import Proc, ProcessGroup
from tests.harness.runs import TINY_RUN

# Tiny model and H=5 so outer steps come every few seconds; matchmaking dominates a round.
#: The tiny built-in run every join test uses.
RUN = TINY_RUN

Event = dict[str, Any]


@pytest.fixture
def peers() -> Iterator[ProcessGroup]:
    """Like the `processes` fixture, but SIGKILLs first: a peer honours SIGTERM at its next step
    boundary, which mid-matchmaking is up to 25 s away (graceful leave is test_join's)."""
    group = ProcessGroup()
    try:
        yield group
    finally:
        for proc in group.procs:
            if proc.process.poll() is None:
                proc.process.kill()
        group.close()


class Hosts:
    """Collects each host's JSON events as they arrive, without blocking on any one host."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.events: list[list[Event]] = [[] for _ in procs]

    def drain(self) -> None:
        for proc, events in zip(self.procs, self.events, strict=True):
            while not proc._lines.empty():
                events.append(proc.receive(timeout=1))
            if proc.process.poll() is not None and proc._lines.empty():
                raise AssertionError(
                    f"{proc.process.args[-1]} exited ({proc.process.returncode}):\n"
                    + "".join(proc.stderr_tail)
                )

    def wait(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            if done():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout}s: {what}\n{self.timeline()}")
            time.sleep(0.2)

    def outer(self, i: int, since: float = 0.0) -> list[Event]:
        return [e for e in self.events[i] if e["event"] == "outer_step" and e["time"] >= since]

    def timeline(self) -> str:
        lines = []
        for i, events in enumerate(self.events):
            lines.append(
                f"host {i}: "
                + ", ".join(
                    f"{e['event']}(r{e.get('round')},{e.get('status', '')},"
                    f"g{e.get('group_size', '')},{str(e.get('state_hash', ''))[:6]},"
                    f"t{e['time'] % 1000:.1f})"
                    for e in events
                    if e["event"] in ("outer_step", "state_synced", "run_joined", "training")
                )
            )
            lines.extend("    " + line.rstrip() for line in list(self.procs[i].stderr_tail)[-5:])
        return "\n".join(lines)
