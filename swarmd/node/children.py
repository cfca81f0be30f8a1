"""Stopping child processes (the demo's peers, tests' daemons) without leaving any behind."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


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
