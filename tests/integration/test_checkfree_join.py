"""CheckFree through `swarmd join`: every server of the middle stage of 3 is SIGKILLed, two
new peers race to serve it: one takes the recovery lease and rebuilds the stage from its
neighbours, the other takes that state, and the pipeline trains on."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.checkfree import one_rebuild
from tests.harness.join import stop_and_collect, wait_for
from tests.harness.processes import ProcessGroup, run_command, swarmd_cmd
from tests.harness.runs import SWARM_RUN
from tests.harness.swarm import STAGE_START_S, stage_server_cmd, start_three_stages


# In virtual time in the default suite (tests/unit/test_sim_checkfree_peers.py, two seeds);
# ~40 s here. CheckFree+'s process test (test_checkfree_plus_join.py) is the recovery's smoke
# test on real processes.
@pytest.mark.slow
def test_a_lost_middle_stage_is_rebuilt_once_and_training_goes_on(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    boot, (s0, s1, s2, trainer) = start_three_stages(processes, tmp_path, SWARM_RUN)
    # Every stage has stepped (the neighbours publish their gradient norms with their records).
    for s in (s0, s1, s2):
        while (e := s.receive(timeout=60))["event"] != "stage_round" or e["micro_batches"] == 0:
            pass
    time.sleep(4)  # a record refresh
    s1.process.send_signal(signal.SIGKILL)
    missing = wait_for(trainer, "stage_missing", timeout=60)
    assert missing["stage"] == 1
    lost_at = time.monotonic()
    racers = processes.start_many(
        [stage_server_cmd(tmp_path, "r1", boot, 1), stage_server_cmd(tmp_path, "r2", boot, 1)],
        timeout=STAGE_START_S,
    )
    before: list[list[dict[str, Any]]] = [[], []]
    for r, seen in zip(racers, before, strict=True):
        while (e := r.receive(timeout=STAGE_START_S))["event"] != "stage":
            seen.append(e)
        seen.append(e)
    rebuilder = racers[one_rebuild(before)]
    assert time.monotonic() - lost_at < 60
    # The rebuilder's first trained round says how long from detection; the two average.
    while (e := rebuilder.receive(timeout=60))["event"] != "stage_round" or e["micro_batches"] == 0:
        pass
    assert 0 < e["recovery_s"] < 30, e
    # `swarmd status` shows the recovery (the rebuilder's progress record carries it).
    status = run_command(swarmd_cmd("status", "--run", "t", "--peers", boot, "--json"), timeout=60)
    assert status.returncode == 0, status.stderr
    notices = json.loads(status.stdout)["notices"]
    assert [(n["kind"], n["peer_id"]) for n in notices] == [
        ("recovery", rebuilder.info["peer_id"])
    ], notices
    assert notices[0]["text"].startswith("stage 1 lost: rebuilt from stages 0 and 2 by CheckFree")
    seen: list[list[dict[str, Any]]] = [[], []]
    for r, rounds_of in zip(racers, seen, strict=True):
        while (e := r.receive(timeout=60))["event"] != "stage_round" or e["group_size"] < 2:
            rounds_of.append(e)
        rounds_of.append(e)
    back = wait_for(trainer, "stage_back", timeout=30)
    assert back["stage"] == 1
    runs = stop_and_collect([trainer, s0, s2, *racers])
    done = next(e for e in runs[0] if e["event"] == "trainer_done")
    assert done["micro_batches"] > 0
    recovered = [e for events in runs for e in events if e["event"] == "stage_recovered"]
    assert not recovered, recovered  # the one recovery was read above; none since
    # The two servers of the rebuilt stage hold the same state after every round both had.
    rounds: dict[int, set[str]] = {}
    for events in [seen[0] + runs[3], seen[1] + runs[4]]:
        for e in events:
            if e["event"] == "stage_round" and e["group_size"] == 2:
                rounds.setdefault(e["round"], set()).add(e["state_hash"])
    assert rounds and all(len(h) == 1 for h in rounds.values()), rounds
