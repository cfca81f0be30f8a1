"""A real peer process under an injected partition: unreachable while isolated, back after heal."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from swarmd.protocol import faults
from swarmd.protocol.faults import FaultPlan
from tests.harness.processes import ProcessGroup, run_command, swarmd_cmd


def ping(address: str) -> subprocess.CompletedProcess[str]:
    return run_command(swarmd_cmd("ping", address, "--count", "1", "--timeout", "5"), timeout=60)


def test_isolated_peer_is_unreachable_until_healed(processes: ProcessGroup, tmp_path: Path) -> None:
    plan = tmp_path / "faults.json"
    peer = processes.start(
        swarmd_cmd("serve", "--state-dir", str(tmp_path / "peer")),
        env={faults.ENV_VAR: str(plan)},
    )
    assert ping(peer.address).returncode == 0
    FaultPlan(isolated=True).write(plan)
    time.sleep(faults.RELOAD_INTERVAL_S + 0.1)  # the peer re-reads its plan at most this often
    cut = ping(peer.address)
    assert cut.returncode == 3, cut.stdout + cut.stderr
    assert "cannot reach" in cut.stderr
    FaultPlan().write(plan)
    time.sleep(faults.RELOAD_INTERVAL_S + 0.1)
    healed = ping(peer.address)
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "1 round trips" in healed.stdout
