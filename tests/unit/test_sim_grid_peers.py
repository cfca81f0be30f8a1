"""`grouping = "grid"` with real peers in virtual time (swarmd/node/sim/peers.py): the roll call
and the grid planned from its roster, through the daemon's own DiLoCo strategy with the tiny
model. tests/integration/test_grid_join.py runs the same on real processes (the creator-killed
case in the slow tier; the streaming case is the grid's process smoke test)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import trio

from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.sim.peers import Event, SimPeer, SimPeers
from swarmd.node.sim.virtual import run_virtual
from tests.harness.runs import TINY_RUN

#: 20 rounds of the tiny run's H = 5.
STEPS = 100
#: Virtual seconds a tiny model's inner step is charged.
STEP_S = 0.1


def _outer(peer: SimPeer) -> list[Event]:
    return peer.out.of("outer_step")


def _timeline(peers: list[SimPeer]) -> str:
    return "\n".join(
        f"{p.name}: "
        + " ".join(f"{e['round']}:{e['status'][:2]}:{e['group_size']}" for e in _outer(p))
        + "".join(f"\n    {line}" for line in p.logs[-5:])
        for p in peers
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_creator_killed_mid_run_the_grid_peers_end_on_one_state(
    tmp_path: Path, seed: int
) -> None:
    """Issue 46: no peer is special. Four peers in groups of 2 (a 2 x 2 grid); the run's
    creator is killed after its third averaged outer step (its first round is often alone
    and its second a download: it starts before the others have joined). Its heartbeat
    outlives it, so roll calls wait for it until attendance excuses it; the three others then
    keep averaging on a grid of three and end on one state, the run's last (its
    total_steps)."""
    run = TINY_RUN + f'target_group_size = 2\ngrouping = "grid"\ntotal_steps = {STEPS}\n'

    killed_at: list[int] = []

    async def main() -> SimPeers:
        sim = SimPeers(tmp_path, seed=seed)
        async with trio.open_nursery() as nursery:
            boot = await sim.bootstrap(nursery)
            config = RunConfig.from_mapping(tomllib.loads(run), name="grid")
            creator, *others = sim.run_of(config, 4, boot, step_s=STEP_S)
            for peer in (creator, *others):
                nursery.start_soon(sim.run, peer)
            with trio.fail_after(300):
                while sum(e["status"] == "averaged" for e in _outer(creator)) < 3:
                    await trio.sleep(0.1)
                sim.kill(creator)
                killed_at.append(_outer(creator)[-1]["round"])
                for peer in others:
                    await peer.done.wait()
            nursery.cancel_scope.cancel()
        return sim

    sim = run_virtual(main, seed=seed)
    others = sim.peers[1:]
    assert [p.error for p in others] == [None] * 3, _timeline(sim.peers)
    rounds: dict[int, list[dict[str, Any]]] = {}
    for p in others:
        for e in _outer(p):
            rounds.setdefault(e["round"], []).append(e)
    # After the kill the survivors keep averaging together, every round all three averaged
    # in ending on one state, and the run's last state is the same.
    after = {
        r: es for r, es in rounds.items()
        if r > killed_at[0] + 1 and len(es) == 3 and all(e["status"] == "averaged" for e in es)
    }  # fmt: skip
    assert len(after) >= STEPS // 5 - killed_at[0] - 3, (killed_at, _timeline(sim.peers))
    for r, es in after.items():
        assert len({e["state_hash"] for e in es}) == 1, (r, _timeline(sim.peers))
    # With groups of 2, a peer that met both others averaged across rows: on the grid.
    assert any(max(e["group_size"] for e in es) == 3 for es in after.values()), after
    last = [_outer(p)[-1] for p in others]
    assert {e["round"] for e in last} == {STEPS // 5}, _timeline(sim.peers)
    assert len({e["state_hash"] for e in last}) == 1, _timeline(sim.peers)
