"""A peer's JSON event lines are written whole, so a kill cannot leave half of one."""

from __future__ import annotations

import io
import json

import pytest

from swarmd.node.peer.progress import Progress, announce
from swarmd.node.runtime.jsonlines import print_event


class _Writes(io.StringIO):
    """stdout that records each write, as an unbuffered stream makes one syscall each."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_each_event_line_is_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    print_event({"event": "listening", "peer_id": "p"})
    announce("ready", port=4000)
    Progress("json").event("outer_step", "round 3", round=3)
    # `print(line, flush=True)` wrote the newline apart: a SIGKILL between the two writes
    # left the line open and the restarted container's first event was glued onto it.
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in out.writes), out.writes
    assert [json.loads(w)["event"] for w in out.writes] == ["listening", "ready", "outer_step"]
