"""A run config from the network never runs code, opens local files, or replaces the creator's.

Before: a run created with ``model = "os:abort"`` killed every joiner with SIGABRT, one whose
``data`` was a path made joiners train on that file of their own disk, and any key could
overwrite the run's config record.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.harness.attacker import forged_config, publish_config
from tests.harness.join import events_until_exit, join_cmd, start_bootstrap, wait_for
from tests.harness.processes import ProcessGroup
from tests.harness.runs import TINY_RUN


def _refused(processes: ProcessGroup, tmp: Path, boot: str, name: str, *extra: str) -> str:
    """Starts a joiner that must refuse the run: its exit code 2 and its stderr."""
    peer = processes.start(join_cmd(tmp, name, boot, "--join-timeout", "30", *extra))
    peer.process.wait(timeout=90)
    time.sleep(0.2)  # the stderr pump
    stderr = "".join(peer.stderr_tail)
    assert peer.process.returncode != -signal.SIGABRT, stderr
    assert peer.process.returncode == 2, stderr
    assert not (tmp / name / "state.pt").exists()
    return stderr


def test_a_config_naming_code_or_a_local_path_is_refused(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    boot = start_bootstrap(processes, tmp_path)
    publish_config(boot, tmp_path / "attacker", "t", forged_config("t", model="os:abort"))
    stderr = _refused(processes, tmp_path, boot, "p0")
    assert "model 'os:abort'" in stderr and "--model os:abort" in stderr

    secret = tmp_path / "secret.txt"
    secret.write_text("a private file of the joiner's own disk\n" * 100)
    publish_config(boot, tmp_path / "attacker2", "u", forged_config("u", data=str(secret)))
    stderr = _refused(processes, tmp_path, boot, "p1", "--run", "u")
    assert f"data '{secret}'" in stderr and f"--data {secret}" in stderr


def test_an_impostor_config_does_not_replace_the_creators(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = start_bootstrap(processes, tmp_path)
    creator = processes.start(
        join_cmd(tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"), steps=15)
    )
    created = wait_for(creator, "run_created")
    # Same run name, a config that would wreck training, signed by a stranger's key.
    publish_config(boot, tmp_path / "attacker", "t", forged_config("t", inner_lr=1e6))

    stderr = _refused(processes, tmp_path, boot, "p1")
    assert "2 different keys publish a config for run 't'" in stderr and "--creator" in stderr

    joiner = processes.start(join_cmd(tmp_path, "p2", boot, "--creator", created["creator"]))
    joined = wait_for(joiner, "run_joined")
    assert joined["config_hash"] == created["config_hash"]
    assert joined["creator"] == created["creator"]
    steps = [e for e in events_until_exit(joiner) if e["event"] == "outer_step"]
    assert joiner.process.returncode == 0
    losses = [e["val_loss"] for e in steps if e.get("val_loss") is not None]
    assert losses and max(losses) < 6.0  # the run's own lr: inner_lr 1e6 gives inf or NaN
