"""A SWARM trainer that sends every Backward's gradient x(-1000) (finite, in the wire's range)
no longer picks the stage's direction (issue 47, item 2).

Before: a stage added any finite gradient into its round's sum and clipped only the averaged
one, so one such trainer raised the honest stages' validation loss 1.6-1.9x. Now each stage
bounds a micro-batch's gradient by the norms it let in lately from other callers
(optim/grad_bound.py: scaled down beyond 3x their low median, left out of the sum beyond
100x, logged with the caller's peer id; not banned: a trainer relays the gradient a later
stage's server answered, and a first version that banned banned an honest trainer relaying
a lying server's x(-20)).

Honest stage-0 gradients are heavy-tailed: over four clean runs of this test (1,600
micro-batches each) the largest reached 7-77x the median and one CI run saw 170x, so an
honest micro-batch is left out about once in several thousand. The test holds the honest
trainers to at most one in 400 (a bound of 10x left out 5 of 1,600 in the run that reached
77x) and reads the counts from stage 0's round events, per caller.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from swarmd.protocol.identity import Identity
from tests.harness.join import events_until_exit, start_bootstrap, stop_and_collect, wait_for
from tests.harness.processes import Proc, ProcessGroup
from tests.harness.runs import SWARM_RUN
from tests.harness.swarm import STAGE_START_S, stage_server_cmd, trainer_cmd

STEPS = 800
#: Honest micro-batches stage 0 may leave out of a run: one in 400 (see above).
HONEST_LEFT_OUT = 2 * STEPS // 400
#: Two stages of one server each; rounds of a second (the loss is read per round).
RUN = SWARM_RUN.replace("swarm_stages = 3", "swarm_stages = 2").replace(
    "swarm_round_s = 3.0", "swarm_round_s = 1.0"
)


def _run(
    processes: ProcessGroup, tmp: Path, lie: bool
) -> tuple[str, Proc, Counter[str], list[dict[str, Any]]]:
    """Two trainers through the pipeline, the second lying if ``lie``: its peer id, the
    stage-0 server (the one its gradients reach), the micro-batches stage 0 left out per
    caller, and the last stage's events."""
    tmp.mkdir()
    (tmp / "run.toml").write_text(RUN)
    boot = start_bootstrap(processes, tmp)
    create = ("--create-run", str(tmp / "run.toml"))
    servers = [
        processes.start(stage_server_cmd(tmp, "s0", boot, 0, *create)),
        processes.start(stage_server_cmd(tmp, "s1", boot, 1)),
    ]
    for s in servers:
        wait_for(s, "stage", timeout=STAGE_START_S)
    honest = processes.start(trainer_cmd(tmp, "t", boot, STEPS))
    cmd = trainer_cmd(tmp, "u", boot, STEPS)
    if lie:
        cmd = [sys.executable, "-m", "tests.harness.lying_peer", *cmd[3:]]
    other = processes.start(cmd, env={"SWARMD_LIE": "trainer1000"} if lie else None)
    trained = events_until_exit(honest, timeout=240)
    assert honest.process.returncode == 0, "".join(honest.stderr_tail)
    done = next(e for e in trained if e["event"] == "trainer_done")
    assert done["micro_batches"] == STEPS, done
    other.process.kill()
    first, last = stop_and_collect(servers)
    left_out: Counter[str] = Counter()
    for e in first:
        if e["event"] == "stage_round":
            left_out.update(e.get("left_out", {}))
    return str(Identity.load(tmp / "u").peer_id), servers[0], left_out, last


def _late_loss(events: list[dict[str, Any]]) -> float:
    """The last stage's mean loss over its last three rounds that saw micro-batches."""
    losses = [e["loss"] for e in events if e["event"] == "stage_round" and e["loss"] is not None]
    assert len(losses) >= 4, losses
    return float(sum(losses[-3:]) / 3)


# Slow tier: two whole pipeline runs (honest, then with the liar), 94-105 s beside the other
# worker in clean-clone rehearsals (2026-11-30), the longest test of the default suite. The
# bound itself is checked in-process (tests/unit/test_stage_trainer.py: `NormBound`, a liar
# with half the micro-batches held to the honest scale, an outsized Backward left out of the
# sum), and SWARM through processes stays in the default suite (test_swarm_join.py).
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_sending_gradients_x_minus_1000_is_left_out_and_logged(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    _, _, fair, clean = _run(processes, tmp_path / "clean", lie=False)
    assert sum(fair.values()) <= HONEST_LEFT_OUT, fair
    liar, s0, left_out, attacked = _run(processes, tmp_path / "attacked", lie=True)
    base, got = _late_loss(clean), _late_loss(attacked)
    print(f"late loss: clean {base:.4f}, attacked {got:.4f}; left out: {dict(left_out)}")
    assert left_out[liar] >= STEPS // 4, left_out
    assert sum(left_out.values()) - left_out[liar] <= HONEST_LEFT_OUT, left_out
    logged = [line for line in s0.stderr_tail if "left a micro-batch" in line]
    assert any(liar[:10] in line for line in logged), list(s0.stderr_tail)[-20:]
    assert got <= 1.25 * base, (got, base)
