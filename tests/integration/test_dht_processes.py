"""`swarmd dht` daemons as real processes: a swarm of five, churn, clear errors, no torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from swarmd.node.dht import open_dht
from swarmd.protocol.identity import Identity
from tests.harness.processes import Proc, ProcessGroup, run_command, swarmd_cmd


def test_five_daemons_serve_stores_and_gets_and_survive_a_death(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    first = processes.start(
        swarmd_cmd("dht", "--state-dir", str(tmp_path / "d0"), "--log-interval", "0.3")
    )
    assert first.info["event"] == "listening" and first.info["routing_table"] == 0
    daemons = [first]
    for i in range(1, 5):
        peers = ",".join(d.address for d in daemons[-2:])
        daemons.append(
            processes.start(
                swarmd_cmd("dht", "--state-dir", str(tmp_path / f"d{i}"), "--peers", peers)
            )
        )
        size = daemons[-1].info["routing_table"]
        assert isinstance(size, int) and size >= 1
    peer_ids = {d.info["peer_id"] for d in daemons}
    assert len(peer_ids) == 5

    async def main() -> None:
        async with (
            open_dht(Identity.generate(), bootstrap=[daemons[1].address]) as (writer, _),
            open_dht(Identity.generate(), bootstrap=[daemons[4].address]) as (reader, _),
        ):
            assert len(writer.table) >= 4
            assert await writer.store("run/config", b"lr=0.7", time.time() + 60) >= 5
            async with writer.announce("run/ready/1", b"w"), reader.announce("run/ready/1", b"r"):
                found = await reader.get_value("run/config")
                assert found is not None and found.value == b"lr=0.7"
                assert found.owner == writer.peer_id
                ready = await reader.peers("run/ready/1", exhaustive=True)
                assert set(ready) == {writer.peer_id, reader.peer_id}
                # A daemon dies: the value is still there, and lookups route around it.
                daemons[2].process.send_signal(signal.SIGKILL)
                daemons[2].process.wait()
                with trio.fail_after(3):
                    found = await reader.get_value("run/config")
                assert found is not None and found.value == b"lr=0.7"
                with trio.fail_after(3):
                    again = await writer.peers("run/ready/1", exhaustive=True)
                assert set(again) == set(ready)

    trio.run(main)
    # The bootstrap node logs its routing table size periodically.
    first.process.send_signal(signal.SIGTERM)
    first.process.wait(timeout=10)
    assert "routing_table" in stderr_of(first) and "listening on" in stderr_of(first)


def stderr_of(proc: Proc) -> str:
    """What a finished child wrote to stderr, whether or not the helper drains it for us."""
    tail = getattr(proc, "stderr_tail", None)
    if tail is None:
        assert proc.process.stderr is not None
        return proc.process.stderr.read()
    deadline = time.monotonic() + 5
    while "routing_table" not in "".join(tail) and time.monotonic() < deadline:
        time.sleep(0.05)  # the helper's reader thread is still catching up
    return "".join(tail)


def test_no_answering_bootstrap_peer_is_a_clear_error(tmp_path: Path) -> None:
    done = run_command(
        swarmd_cmd("dht", "--state-dir", str(tmp_path), "--peers", "127.0.0.1:1"), timeout=30
    )
    assert done.returncode == 3
    assert "no bootstrap peer answered" in done.stderr and "127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr
    bad = run_command(
        swarmd_cmd("dht", "--state-dir", str(tmp_path), "--peers", "nonsense"), timeout=30
    )
    assert bad.returncode == 2 and "bad --peers" in bad.stderr


def test_a_dht_only_node_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import swarmd.node.cli.app, swarmd.node.dht, swarmd.node.dht.main\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('swarmd'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "swarmd.node.dht.main" in json.loads(done.stdout)


def _connected_to(port: int) -> bool:
    """Whether some socket on this machine has an established TCP connection to ``port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def test_a_bootstrap_peer_slow_to_answer_is_waited_for(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The first call to a bootstrap peer opens the connection, and the peer may be far away
    or busy: it gets the bootstrap's whole budget (5 s), not the 250 ms floor of a round-trip
    estimate that has measured nothing yet."""
    boot = processes.start(swarmd_cmd("dht", "--state-dir", str(tmp_path / "boot")))
    port = int(boot.address.rsplit(":", 1)[1])
    boot.process.send_signal(signal.SIGSTOP)  # the kernel still accepts its connections
    try:
        joiner = processes._spawn(
            swarmd_cmd("dht", "--state-dir", str(tmp_path / "j"), "--peers", boot.address),
            None,
            False,
        )
        deadline = time.monotonic() + 60
        while not _connected_to(port):  # the joiner's ping is now waiting for an answer
            assert time.monotonic() < deadline and joiner.process.poll() is None
            time.sleep(0.02)
        time.sleep(1.0)
    finally:
        boot.process.send_signal(signal.SIGCONT)
    joined = joiner.receive(timeout=30)
    assert joined["routing_table"] == 1
