"""The processes the tests start through the zygote are what a fresh `python` would have been:
their own pid, environment, working directory, streams, seeds, signals and exit status."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.harness.processes import ProcessGroup, run_command
from tests.harness.zygote import ZYGOTE, ZygoteChild

PROGRAM = """\
import json, os, random, sys
import torch
print(json.dumps({
    "pid": os.getpid(), "cwd": os.getcwd(), "only_here": os.environ.get("ONLY_HERE"),
    "argv": sys.argv, "random": random.random(), "torch": torch.rand(1).item(),
    "path0": sys.path[0], "main": __name__,
}), flush=True)
print("to stderr", file=sys.stderr)
line = sys.stdin.readline()
if line:
    print(line.strip().upper(), flush=True)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_program_gets_its_own_environment_streams_seeds_and_exit_code(
    tmp_path: Path,
) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    cwd = tmp_path / "work"
    cwd.mkdir()
    runs = []
    for code in (3, 0):
        child = ZYGOTE.spawn(
            [sys.executable, str(script), str(code)],
            env={**os.environ, "ONLY_HERE": f"x{code}"},
            stdin=True,
            cwd=str(cwd),
        )
        assert isinstance(child, ZygoteChild)  # forked, not started fresh
        assert child.stdin is not None and child.stdout is not None
        assert child.stderr is not None
        child.stdin.write("hello\n")
        child.stdin.close()
        seen = json.loads(child.stdout.readline())
        assert child.stdout.readline().strip() == "HELLO"
        assert child.wait(timeout=30) == code
        assert "to stderr" in child.stderr.read()
        child.stdout.close()
        child.stderr.close()
        assert seen["pid"] == child.pid and seen["pid"] != os.getpid()
        assert seen["cwd"] == str(cwd) and seen["only_here"] == f"x{code}"
        assert seen["argv"] == [str(script), str(code)] and seen["main"] == "__main__"
        assert seen["path0"] == str(tmp_path)
        runs.append(seen)
    # Each child drew its own seeds (forked children would share the server's otherwise).
    assert runs[0]["random"] != runs[1]["random"] and runs[0]["torch"] != runs[1]["torch"]


def test_signals_reach_the_forked_process_and_its_status_comes_back(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import json, os, time\nprint(json.dumps({'pid': os.getpid()}), flush=True)\n"
        "time.sleep(600)\n"
    )
    killed, stopped = (processes.start([sys.executable, str(script)]) for _ in range(2))
    assert killed.info["pid"] == killed.pid
    killed.process.send_signal(signal.SIGKILL)
    assert killed.process.wait(timeout=30) == -signal.SIGKILL
    stopped.process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while _state(stopped.pid) not in ("T", "t"):  # the child itself stops
        assert time.monotonic() < deadline, _state(stopped.pid)
        time.sleep(0.01)
    stopped.process.send_signal(signal.SIGCONT)
    stopped.process.send_signal(signal.SIGTERM)
    assert stopped.process.wait(timeout=30) == -signal.SIGTERM


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_run_command_runs_a_module_to_its_end(tmp_path: Path) -> None:
    done = run_command([sys.executable, "-m", "swarmd.node.cli", "version"], timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
