"""Helpers for tests that run real processes on loopback with OS-chosen ports."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    process: subprocess.Popen[str]
    info: dict[str, object]

    @property
    def address(self) -> str:
        return str(self.info["address"])


class ProcessGroup:
    """Starts processes that announce themselves with a JSON line; kills them all at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, args: list[str], *, timeout: float = 30.0, env: dict[str, str] | None = None
    ) -> Proc:
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        # readline blocks; the process prints its JSON line within seconds or dies trying.
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise AssertionError(f"{args} did not announce itself within {timeout}s")
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"{args} exited before announcing itself:\n{err}")
        return Proc(proc, json.loads(line))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()


def swarmd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmd.node.cli", *args]


def rpc_server_cmd(config: dict[str, object] | None = None) -> list[str]:
    script = ROOT / "tests" / "integration" / "rpc_test_server.py"
    return [sys.executable, str(script), json.dumps(config or {})]
