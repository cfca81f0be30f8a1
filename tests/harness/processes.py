"""Real processes on loopback with OS-chosen ports: start them, read the JSON lines they
print, and kill them all at teardown (the `processes` fixture of tests/conftest.py)."""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from swarmd.node.runtime.children import stop_all
from tests.harness.zygote import ZYGOTE

ROOT = Path(__file__).resolve().parents[2]
#: This package: the peer programs tests start by path live here.
HARNESS = ROOT / "tests" / "harness"


class Proc:
    """A child process that speaks JSON lines on stdout; stderr is drained and kept (tail)."""

    def __init__(
        self, process: subprocess.Popen[str], info: dict[str, object] | None = None
    ) -> None:
        self.process = process
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=200)
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self.info: dict[str, object] = info or {}

    def _pump_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_stderr(self) -> None:
        if self.process.stderr is None:
            return
        for line in self.process.stderr:
            self.stderr_tail.append(line)

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: dict[str, object]) -> None:
        """One JSON line to the child's stdin (started with stdin=True)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float = 30.0) -> dict[str, object]:
        """The child's next JSON line on stdout; a clear AssertionError on timeout or exit."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.process.args!r} printed nothing within {timeout}s; stderr:\n"
                + "".join(self.stderr_tail)
            ) from None
        if line is None:
            self.process.wait(timeout=5)
            raise AssertionError(
                f"{self.process.args!r} exited ({self.process.returncode}); stderr:\n"
                + "".join(self.stderr_tail)
            )
        result: dict[str, object] = json.loads(line)
        return result


class ProcessGroup:
    """Starts processes that announce themselves with a JSON line; kills them all at teardown."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(
        self,
        args: list[str],
        *,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        stdin: bool = False,
    ) -> Proc:
        return self.start_many([args], timeout=timeout, env=env, stdin=stdin)[0]

    def start_many(
        self,
        commands: list[list[str]],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        stdin: bool = False,
    ) -> list[Proc]:
        """Starts all commands at once (imports overlap), then waits for each one's line."""
        started = [self._spawn(args, env, stdin) for args in commands]
        for proc in started:
            proc.info = proc.receive(timeout)
        return started

    def _spawn(self, args: list[str], env: dict[str, str] | None, stdin: bool) -> Proc:
        process = ZYGOTE.spawn(args, env={**os.environ, **(env or {})}, stdin=stdin)
        proc = Proc(process)  # type: ignore[arg-type]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        stop_all(proc.process for proc in self.procs)


def _read_all(stream: IO[str], into: list[str]) -> None:
    into.append(stream.read())


def run_command(
    args: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(args, capture_output=True, text=True) for a command that exits by itself,
    started by the zygote (its imports done) where it can be."""
    process = ZYGOTE.spawn(args, env={**os.environ, **(env or {})}, stdin=False)
    out: list[str] = []
    err: list[str] = []
    assert process.stdout is not None and process.stderr is not None
    readers = [
        threading.Thread(target=_read_all, args=(process.stdout, out), daemon=True),
        threading.Thread(target=_read_all, args=(process.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_all([process])  # type: ignore[list-item]
        raise
    for reader in readers:
        reader.join()
    process.stdout.close()
    process.stderr.close()
    return subprocess.CompletedProcess(args, code, "".join(out), "".join(err))


def swarmd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmd.node.cli", *args]


def peak_rss_kib(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in KiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")
