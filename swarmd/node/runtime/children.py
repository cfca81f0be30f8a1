"""Child processes of the demo and benchmarks: reading their JSON events, stopping them all."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@dataclass
class EventChild:
    """A child whose stdout is JSON lines (`swarmd join --log-format json`, `swarmd dht`): a
    thread reads them into `events` and a queue, and copies them to `<name>.jsonl` next to the
    child's stderr log, so a run can be read afterwards."""

    name: str
    process: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    lines: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    record: IO[str] | None = None

    @classmethod
    def spawn(
        cls, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> EventChild:
        with open(log_dir / f"{name}.log", "w") as stderr:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        record = open(log_dir / f"{name}.jsonl", "w")  # noqa: SIM115 - closed by the reader
        child = cls(name, proc, record=record)
        threading.Thread(target=child._pump, daemon=True).start()
        return child

    def _pump(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                if self.record is not None:
                    self.record.write(line)
                    self.record.flush()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                self.events.append(event)
                self.lines.put(event)
        except ValueError:
            pass  # stdout closed under us by stop_all
        finally:
            if self.record is not None:
                self.record.close()
            self.lines.put(None)

    def first(self, kind: str, timeout: float) -> dict[str, Any]:
        """The next event of this kind (events read before are skipped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if event is None:
                break
            if event.get("event") == kind:
                return event
        raise RuntimeError(f"{self.name} did not report {kind!r} within {timeout:.0f}s")

    def last(self, kind: str) -> dict[str, Any]:
        found = [e for e in self.events if e.get("event") == kind]
        if not found:
            raise RuntimeError(f"{self.name} never reported {kind!r} (see its log)")
        return found[-1]


def stop_all(processes: Iterable[subprocess.Popen[str]], timeout: float = 10.0) -> None:
    """SIGTERM every live child (SIGCONT first: a stopped child cannot act on it), wait for each
    up to ``timeout``, SIGKILL the ones that do not exit, and close their pipes."""
    procs = list(processes)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
