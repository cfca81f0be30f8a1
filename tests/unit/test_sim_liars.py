"""Lying reducers among real peers in virtual time: tests/adversarial/test_poisoned_updates.py's
forger and equivocator (tests/harness/forger.py) given to one simulated host, so that a seed
replays what a run of processes shows once in a while (a CI run once ended with both honest
members' last round local, cause unknown)."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from swarmd.node.averaging import round as round_module
from swarmd.node.averaging import verify
from swarmd.node.averaging.allreduce import Averager
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.sim.network import Host, current_host
from swarmd.node.sim.peers import Event, SimPeer, SimPeers
from swarmd.node.sim.virtual import run_virtual
from tests.harness import forger
from tests.harness.runs import TINY_RUN

STEPS = 60  # 12 rounds of 5 inner steps
STEP_S = 0.1


def honest_run(size: int) -> RunConfig:
    text = TINY_RUN.replace("min_group_size = 2", f"min_group_size = {size}")
    return RunConfig.from_mapping(tomllib.loads(text), name="lies")


def finals(peers: list[SimPeer]) -> list[Event]:
    return [[e for e in p.out.events if e["event"] == "outer_step"][-1] for p in peers]


def trace(peers: list[SimPeer]) -> str:
    return "\n".join(
        f"{p.name}: "
        + " ".join(
            f"r{e['round']}:{e['status']}:g{e['group_size']}:{e['state_hash'][:6]}"
            for e in p.out.events
            if e["event"] == "outer_step"
        )
        + "".join(f"\n    {line}" for line in p.logs[-10:])
        for p in peers
    )


def run(
    root: Path, size: int, seed: int, lie: Callable[[Callable[[], bool]], None] | None
) -> tuple[list[SimPeer], list[SimPeer]]:
    """``size`` peers in groups of ``size``, the last one lying (``lie`` installs its lie,
    gated to its host) and training three times as long; returns (honest, all)."""

    async def main() -> list[SimPeer]:
        sim = SimPeers(root, seed=seed)
        config = honest_run(size)
        async with trio.open_nursery() as nursery:
            boot = await sim.bootstrap(nursery)
            peers = sim.run_of(config, size - bool(lie), boot, max_steps=STEPS, step_s=STEP_S)
            if lie is not None:  # a liar keeps going after the honest peers stop
                peers += sim.run_of(config, 1, boot, max_steps=STEPS * 3, step_s=STEP_S)
            if lie is not None:
                liar: Host = peers[-1].net.host
                lie(lambda: current_host.get() is liar)
            for peer in peers:
                nursery.start_soon(sim.run, peer)
            honest = peers[:-1] if lie else peers
            with trio.fail_after(3600):
                for peer in honest:
                    await peer.done.wait()
            nursery.cancel_scope.cancel()
        return peers

    peers = run_virtual(main, seed=seed)
    return (peers[:-1] if lie else peers), peers


@pytest.fixture
def lies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a lie patches is put back after the test (the lies patch modules: one
    process holds every simulated peer)."""
    monkeypatch.setattr(round_module, "aggregate", round_module.aggregate)
    monkeypatch.setattr(verify, "make_proof", verify.make_proof)
    monkeypatch.setattr(Averager, "_get_proof", Averager._get_proof)


FORGER = (forger.install, "misstates its own contribution")
EQUIVOCATOR = (forger.install_equivocator, "signed two different proofs")


@pytest.mark.usefixtures("lies")
@pytest.mark.parametrize(
    ("lie", "evidence", "seed"),
    [
        (*FORGER, 0),
        (*FORGER, 1),
        (*EQUIVOCATOR, 0),
        # Seed 5 split the honest members before members served the proofs they refused
        # (Round.received): the equivocator dropped one member's contribution as opposed,
        # forged the other's entry in its proof for that member, and gave the other the
        # honest proof of the negated part, which it refused; the member that accepted
        # found no second signed proof to compare, kept the negated part, and the other
        # waited out its fallback at it: two states, then both members' rounds alone.
        (*EQUIVOCATOR, 5),
    ],
    ids=["forger-0", "forger-1", "equivocator-0", "equivocator-5"],
)
def test_a_lying_reducer_cannot_move_the_honest_members(
    tmp_path: Path, lie: Callable[[Callable[[], bool]], None], evidence: str, seed: int
) -> None:
    clean, _ = run(tmp_path / "clean", 2, seed, None)
    honest, everyone = run(tmp_path / "attacked", 3, seed, lie)
    assert [p.error for p in honest] == [None, None], trace(everyone)
    ends = finals(honest)
    losses = [e["val_loss"] for e in ends]
    assert all(math.isfinite(v) for v in losses), losses
    assert len({e["state_hash"] for e in ends}) == 1, trace(everyone)
    banned = [e["evidence"] for p in honest for e in p.out.events if e["event"] == "peer_banned"]
    assert any(evidence in b for b in banned), (banned, trace(everyone))
    base = max(e["val_loss"] for e in finals(clean))
    # Within 5% of the same run without the liar (+0.05 for this tiny run's own noise).
    assert max(losses) <= base * 1.05 + 0.05, (losses, base)
