"""CheckFree and CheckFree+ with real peers in virtual time (tests/harness/sim_swarm.py): every
server of a stage is killed, new peers rebuild it from its neighbours, and the pipeline trains
on. The process tests of the same (tests/integration/test_checkfree_join.py, slow tier, and
test_checkfree_plus_join.py) kill with SIGKILL; a killed simulated host leaves its callers'
calls to run to their deadlines instead, as a vanished router does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.node.sim.peers import Event
from swarmd.node.timing import TimingProfile
from tests.harness.checkfree import one_rebuild
from tests.harness.runs import SWARM_RUN
from tests.harness.sim_swarm import SwarmSim, swarm_run


@pytest.mark.parametrize("seed", [0, 1])
def test_a_lost_middle_stage_is_rebuilt_once_and_training_goes_on(
    tmp_path: Path, seed: int
) -> None:
    got: dict[str, Any] = {}

    async def body(run: SwarmSim) -> None:
        s0, s1, s2, trainer = await run.three_stages()
        # Every stage has stepped (the neighbours publish their gradient norms with their
        # records), and a record refresh has passed.
        for s in (s0, s1, s2):
            await run.trained_round(s)
        await trio.sleep(4)
        run.sim.kill(s1)
        missing = await run.next(trainer, "stage_missing")
        assert missing["stage"] == 1
        lost_at = trainer.net.monotonic()
        racers = [run.add(name, role="server", stage=1) for name in ("r1", "r2")]
        before: list[list[Event]] = [[], []]
        for r, seen in zip(racers, before, strict=True):
            seen.append(await run.next(r, "stage", seen=seen))
        rebuilder = racers[one_rebuild(before)]
        assert rebuilder.net.monotonic() - lost_at < 60
        # The rebuilder's first trained round says how long from detection.
        first = await run.trained_round(rebuilder)
        assert 0 < first["recovery_s"] < 30, first
        # Its progress record (`swarmd status` shows it as a recovery) carries the recovery.
        notices = [(n.kind, n.text) for n in rebuilder.out.notices]
        assert [kind for kind, _ in notices] == ["stage_recovered"], notices
        assert notices[0][1].startswith("stage 1 lost: rebuilt from stages 0 and 2 by CheckFree")
        # The two average.
        for r in racers:
            await run.next(r, "stage_round", lambda e: e["group_size"] >= 2)
        assert (await run.next(trainer, "stage_back"))["stage"] == 1
        for _ in range(3):  # rounds of the rebuilt stage's two servers, compared below
            await run.trained_round(rebuilder)
        got["racers"] = racers
        got["trainer"] = trainer

    sim = swarm_run(tmp_path, SWARM_RUN, body, seed=seed)
    assert [p.error for p in sim.peers] == [None] * len(sim.peers)
    (done,) = got["trainer"].out.of("trainer_done")
    assert done["micro_batches"] > 0, done
    recovered = [p.name for p in sim.peers for _ in p.out.of("stage_recovered")]
    assert len(recovered) == 1, recovered  # the one recovery; none since
    # The two servers of the rebuilt stage hold the same state after every round both had.
    rounds: dict[int, set[str]] = {}
    for r in got["racers"]:
        for e in r.out.of("stage_round"):
            if e["group_size"] == 2:
                rounds.setdefault(e["round"], set()).add(e["state_hash"])
    assert len(rounds) >= 3 and all(len(h) == 1 for h in rounds.values()), rounds


@pytest.mark.parametrize("seed", [0, 1])
def test_a_lost_first_stage_is_rebuilt_by_checkfree_plus(tmp_path: Path, seed: int) -> None:
    """In a run that swaps the end stages with their neighbours on half of the micro-batches,
    every server of the FIRST stage is killed; a new peer rebuilds it from stage 1's blocks and
    the copy of the embedding stage 1's server keeps, and the loss goes on falling."""
    got: dict[str, Any] = {}

    async def body(run: SwarmSim) -> None:
        s0, s1, s2, trainer = await run.three_stages()
        first_loss = (await run.trained_round(s2))["loss"]
        for s in (s0, s1):
            await run.trained_round(s)
        await run.trained_round(s1)  # a round after stage 0 stepped: its copy is fresh
        await trio.sleep(4)  # a record refresh
        run.sim.kill(s0)
        assert (await run.next(trainer, "stage_missing"))["stage"] == 0
        (r0,) = run.servers(0, prefix="r")
        before: list[Event] = []
        took = await run.next(r0, "stage", seen=before)
        assert took["origin"] == "checkfree+", before
        (rec,) = [e for e in before if e["event"] == "stage_recovered"]
        assert rec["method"] == "checkfree+" and rec["neighbours"] == [1], rec
        assert rec["copy_round"] > 0 and rec["norms"][0] > 0, rec
        after = await run.trained_round(r0)
        assert 0 < after["recovery_s"] < 30, after
        assert (await run.next(trainer, "stage_back"))["stage"] == 0
        losses = [(await run.trained_round(s2))["loss"] for _ in range(3)]
        assert max(losses) < first_loss, (first_loss, losses)
        got["trainer"] = trainer

    sim = swarm_run(tmp_path, SWARM_RUN + "swarm_swap = 0.5\n", body, seed=seed)
    assert [p.error for p in sim.peers] == [None] * len(sim.peers)
    (done,) = got["trainer"].out.of("trainer_done")
    assert done["micro_batches"] > 0, done
    recovered = [p.name for p in sim.peers for _ in p.out.of("stage_recovered")]
    assert recovered == ["r0"], recovered


def test_the_profile_s_swarm_timings_set_how_soon_a_lost_stage_is_rebuilt(
    tmp_path: Path,
) -> None:
    """A server taking a stage whose servers were all killed a moment ago waits for their
    records to lapse (a record lifetime and two refreshes at most) before it rebuilds: with
    records that live 30 s instead of 12 (TimingProfile.swarm), the rebuild comes that much
    later."""
    took: list[float] = []

    async def body(run: SwarmSim) -> None:
        s0, s1, s2, _ = await run.three_stages()
        for s in (s0, s1, s2):
            await run.trained_round(s)
        run.sim.kill(s1)
        killed_at = s0.net.monotonic()
        (r1,) = run.servers(1, prefix="r")
        assert (await run.next(r1, "stage"))["origin"] == "checkfree"
        took.append(r1.net.monotonic() - killed_at)

    slow = TimingProfile(swarm=SwarmTimings(record_ttl_s=30.0))
    for i, timings in enumerate([None, slow]):
        sim = swarm_run(tmp_path / str(i), SWARM_RUN, body, timings=timings)
        assert [p.error for p in sim.peers] == [None] * len(sim.peers)
    default, longer = took
    assert default < 20 and longer > default + 10, took
