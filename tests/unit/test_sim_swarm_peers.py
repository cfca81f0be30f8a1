"""SWARM with real peers in virtual time (swarmd/node/sim/peers.py): the daemon's stage servers
and trainers (routing, stage calls, stage rounds, state sync) with the tiny 3-stage model,
their compute charged by the simulated device (`SimNet.device_s`), one seed replaying the run.
The process test of the same pipeline is tests/integration/test_swarm_join.py."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import trio

from swarmd.node.sim.peers import SimPeer, SimPeers
from tests.harness.runs import SWARM_RUN
from tests.harness.sim_swarm import SwarmSim, swarm_run


def pipeline(root: Path, seed: int, half_s: float = 20.0) -> tuple[SimPeers, list[SimPeer]]:
    """Two servers a stage and two trainers for ``half_s`` virtual seconds; then a third
    stage-1 server joins, and all run ``half_s`` more."""

    async def body(run: SwarmSim) -> None:
        for stage in range(3):
            for x in "ab":
                run.add(f"s{stage}{x}", role="server", stage=stage)
        for i in range(2):
            run.add(f"t{i}", role="trainer")
        await trio.sleep(half_s)
        run.add("s1c", role="server", stage=1)
        await trio.sleep(half_s)

    sim = swarm_run(root, SWARM_RUN, body, seed=seed)
    return sim, sim.peers


def test_a_pipeline_of_real_peers_trains_its_servers_agree_and_a_joiner_takes_its_stage(
    tmp_path: Path,
) -> None:
    _, peers = pipeline(tmp_path, seed=0)
    assert [p.error for p in peers] == [None] * len(peers)
    by_name = {p.name: p for p in peers}
    # The trainers' micro-batches went through all three stages.
    done = [e["micro_batches"] for t in ("t0", "t1") for e in by_name[t].out.of("trainer_done")]
    assert len(done) == 2 and min(done) > 0, done
    # Each stage's servers end each stage round on one state.
    hashes: dict[tuple[int, int], set[str]] = defaultdict(set)
    for p in peers:
        for e in p.out.of("stage_round"):
            hashes[(e["stage"], e["round"])].add(e["state_hash"])
    assert {s for s, _ in hashes} == {0, 1, 2}
    split = {k: v for k, v in hashes.items() if len(v) > 1}
    assert not split, split
    # The joiner took stage 1's state from its servers and went on rounding with them.
    (joined,) = by_name["s1c"].out.of("stage")
    assert joined["stage"] == 1 and joined["origin"] == "group" and joined["round"] >= 1
    ours = {e["round"] for e in by_name["s1c"].out.of("stage_round")}
    theirs = {e["round"] for e in by_name["s1a"].out.of("stage_round")}
    assert ours & theirs, (ours, theirs)


def test_one_seed_replays_the_same_pipeline(tmp_path: Path) -> None:
    (a, _), (b, _) = (pipeline(tmp_path / str(i), seed=1, half_s=8.0) for i in range(2))
    assert a.net.calls == b.net.calls
    assert a.net.trace.hexdigest() == b.net.trace.hexdigest()
