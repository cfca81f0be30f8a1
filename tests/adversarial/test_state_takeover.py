"""Forged state adverts cannot take over running peers or crash a joiner.

Before: two fresh keys advertising a scrambled state at round 1,000,000 made both honest peers
of a run adopt it (validation loss 3.6 -> 89); a manifest declaring 200 GiB killed joiners with
MemoryError; a non-finite state was loaded and crashed the peer that took it.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.join import events_until_exit, join_cmd, start_bootstrap, wait_for
from tests.harness.processes import Proc, ProcessGroup
from tests.harness.runs import TINY_RUN

STEPS = 150  # 30 rounds of 5 inner steps: the attack lands mid-run


def attacker_cmd(boot: str, run_file: Path, attack: str, keys: int = 1) -> list[str]:
    return [
        sys.executable, "-m", "tests.harness.attacker_peer", "--boot", boot,
        "--run", "t", "--run-file", str(run_file), "--attack", attack, "--keys", str(keys),
    ]  # fmt: skip


def _pair(processes: ProcessGroup, tmp: Path, boot: str, tag: str) -> list[Proc]:
    # Shards pinned: the attacked run trains on the very data of the run it is compared with
    # (shards drawn from random peer ids moved this tiny run's final loss by up to 20%).
    creator = processes.start(
        join_cmd(
            tmp, f"{tag}0", boot, "--create-run", str(tmp / "run.toml"), "--data-shard", "0",
            steps=STEPS,
        )
    )  # fmt: skip
    created = wait_for(creator, "run_created")
    other = processes.start(
        join_cmd(
            tmp, f"{tag}1", boot, "--creator", created["creator"], "--data-shard", "1",
            steps=STEPS,
        )
    )  # fmt: skip
    return [creator, other]


def _finish(peers: list[Proc]) -> list[list[dict[str, Any]]]:
    logs = [events_until_exit(p, timeout=240) for p in peers]
    for p in peers:
        assert p.process.returncode == 0, "".join(p.stderr_tail)
    return logs


def _last_step(events: list[dict[str, Any]]) -> dict[str, Any]:
    return [e for e in events if e["event"] == "outer_step"][-1]


def test_forged_adverts_do_not_take_over_running_peers(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = start_bootstrap(processes, tmp_path)
    baseline = [_last_step(e)["val_loss"] for e in _finish(_pair(processes, tmp_path, boot, "b"))]

    run = tmp_path / "attacked"
    run.mkdir()
    (run / "run.toml").write_text(TINY_RUN)
    boot = start_bootstrap(processes, run)
    attacker = processes.start(attacker_cmd(boot, run / "run.toml", "scrambled", keys=2))
    honest = _pair(processes, run, boot, "h")
    assert attacker.receive(timeout=120) == {"attacking": True}
    logs = _finish(honest)

    for events in logs:
        synced = [e for e in events if e["event"] == "state_synced"]
        assert all(e["round"] < 1000 for e in synced), synced
        assert _last_step(events)["round"] < 1000
    last = [_last_step(e) for e in logs]
    assert last[0]["state_hash"] == last[1]["state_hash"]  # the honest peers still agree
    losses = [e["val_loss"] for e in last]
    assert all(math.isfinite(v) for v in losses)
    # Within 5% of the same run without the attacker (+0.05 for this tiny run's own noise).
    assert max(losses) <= max(baseline) * 1.05 + 0.05, (losses, baseline)
    time.sleep(0.2)  # the stderr pumps
    stderr = "".join(line for p in honest for line in p.stderr_tail)
    assert "ignored the state advert of" in stderr and "round 1000000" in stderr


@pytest.mark.parametrize(
    ("attack", "quorum"),
    [
        # Each kind of unusable state is vetted in tests/unit/test_state_vetting.py; the
        # default suite keeps one kind with each quorum in processes.
        pytest.param("huge", 1, marks=pytest.mark.slow),
        ("nan", 1),
        pytest.param("scrambled", 1, marks=pytest.mark.slow),
        ("nan", 2),
    ],
)
def test_a_joiner_refuses_an_unusable_state_and_takes_the_groups(
    processes: ProcessGroup, tmp_path: Path, attack: str, quorum: int
) -> None:
    """A 200 GiB manifest, a NaN state, or a finite scrambled state that two keys advertise
    (a quorum to a joiner that has met nobody) at a newer round: refused (logged with the
    advertiser), and the joiner goes on to the honest group's state. With `state_quorum = 2`
    one key's advert is not even fetched."""
    run = TINY_RUN.replace("min_group_size = 2", "min_group_size = 1")
    (tmp_path / "run.toml").write_text(f"{run}state_quorum = {quorum}\n")
    boot = start_bootstrap(processes, tmp_path)
    keys = 2 if attack == "scrambled" else 1
    attacker = processes.start(attacker_cmd(boot, tmp_path / "run.toml", attack, keys=keys))
    creator = processes.start(
        join_cmd(tmp_path, "c", boot, "--create-run", str(tmp_path / "run.toml"), steps=100_000)
    )
    created = wait_for(creator, "run_created")
    assert attacker.receive(timeout=120) == {"attacking": True}
    joiner = processes.start(join_cmd(tmp_path, "j", boot, "--creator", created["creator"]))
    events = events_until_exit(joiner, timeout=180)
    time.sleep(0.2)  # the stderr pump
    stderr = "".join(joiner.stderr_tail)
    assert joiner.process.returncode == 0, stderr
    synced = [e for e in events if e["event"] == "state_synced"]
    assert synced and all(e["round"] < 1000 for e in synced), synced
    if quorum > 1:
        assert "refused state" not in stderr  # one key is below the quorum: never fetched
    else:
        assert "refused state" in stderr and "advertised by 127.0.0.1:" in stderr
    why = (
        ""
        if quorum > 1
        else {
            "huge": "does not fit this model",
            "nan": "NaN or infinity",
            "scrambled": "for the state this peer holds",
        }[attack]
    )
    assert why in stderr
    steps = [e for e in events if e["event"] == "outer_step"]
    assert any(e["group_size"] == 2 for e in steps)  # it trains with the honest creator
    assert all(math.isfinite(e["val_loss"]) and e["val_loss"] < 6.0 for e in steps)
    assert creator.process.poll() is None  # the creator never noticed
