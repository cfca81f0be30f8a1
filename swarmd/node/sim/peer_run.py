"""`kind = "peers"`: a run of real `swarmd join` peers (sim/peers.py) with scheduled faults.

Each peer is the daemon's lifecycle with the run's real model (the scenario's ``[run]``
table is a run config, as `--create-run` reads it); the first creates the run, the others
join through one bootstrap node; each trains ``rounds`` rounds of the run's H steps (its
``--max-steps``). Faults come at virtual times: a peer killed (a vanished host), told to
leave (SIGTERM), paused and resumed (SIGSTOP, SIGCONT), new peers joining, the network cut
between sides (the bootstrap node on no side) and healed; and churn from the seed, each
peer's lifetime drawn from an exponential distribution and a replacement joining after it
dies (`PeerChurn`). What it checks is what `swarmd chaos` checks of real processes: the living
peers end on one state (at the last round all of them reached), and the share of their
peer-rounds averaged in a group.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from swarmd.node.peer.runconfig import RunConfig, RunConfigError
from swarmd.node.sim.network import NetworkConfig
from swarmd.node.sim.peers import SimPeers
from swarmd.node.sim.virtual import run_virtual

#: The run config a scenario without a ``[run]`` table trains: the process tests' tiny model.
TINY_RUN: dict[str, Any] = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 32,
    "batch_size": 4,
    "inner_steps": 5,
    "inner_lr": 0.003,
    "outer_momentum": 0.5,
    "min_group_size": 2,
}


@dataclass(frozen=True)
class PeerFault:
    """What happens at virtual second ``at_s`` (peers by index, in the order they were
    made: the first ``peers``, then each joiner)."""

    at_s: float
    kill: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()
    #: Paused as SIGSTOP pauses a process (SimNetwork.pause), until a later ``resume``.
    pause: tuple[int, ...] = ()
    resume: tuple[int, ...] = ()
    join: int = 0
    #: Sides of peer indices whose calls to one another fail (hosts on no side reach all).
    cut: tuple[tuple[int, ...], ...] = ()
    heal: bool = False

    def __post_init__(self) -> None:
        if not self.at_s >= 0:
            raise ValueError("a fault's at_s must be >= 0")
        if self.join < 0:
            raise ValueError("a fault's join must be >= 0")
        for name in ("kill", "stop", "pause", "resume"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "cut", tuple(tuple(side) for side in self.cut))


@dataclass(frozen=True)
class PeerChurn:
    """Churn from the seed (``[churn]``): every peer, the first ones and each replacement,
    is killed after a lifetime drawn from an exponential distribution of mean ``lifetime_s``
    (0: no churn), unless it has finished its rounds first, and a new peer joins
    ``replace_s`` after each death. Nobody dies of churn after ``until_s``."""

    lifetime_s: float = 0.0
    replace_s: float = 10.0
    until_s: float = 300.0

    def __post_init__(self) -> None:
        if not (self.lifetime_s >= 0 and self.replace_s >= 0 and self.until_s > 0):
            raise ValueError("churn needs lifetime_s >= 0, replace_s >= 0 and until_s > 0")


@dataclass(frozen=True)
class PeersScenario:
    peers: int = 4
    #: Rounds each peer trains (its --max-steps: rounds x the run's inner_steps).
    rounds: int = 10
    #: Virtual seconds an inner step takes on a speed-1 peer.
    step_s: float = 0.1
    #: Peer speeds are log-normal with this sigma (0: all equal).
    speed_sigma: float = 0.0
    #: The run config (RunConfig's keys; name "sim").
    run: dict[str, Any] = field(default_factory=lambda: dict(TINY_RUN))
    faults: tuple[PeerFault, ...] = ()
    churn: PeerChurn = field(default_factory=PeerChurn)
    #: Virtual seconds after which the run counts as hung.
    limit_s: float = 3600.0
    network: NetworkConfig = field(default_factory=NetworkConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.peers < 1 or self.rounds < 1:
            raise ValueError("a peers scenario needs peers >= 1 and rounds >= 1")
        if not (self.step_s >= 0 and self.speed_sigma >= 0 and self.limit_s > 0):
            raise ValueError("step_s and speed_sigma must be >= 0, limit_s > 0")
        faults = tuple(f if isinstance(f, PeerFault) else PeerFault(**f) for f in self.faults)
        object.__setattr__(self, "faults", faults)
        made = self.peers
        for f in sorted(faults, key=lambda f: f.at_s):
            made += f.join
            named = (*f.kill, *f.stop, *f.pause, *f.resume, *(p for side in f.cut for p in side))
            if any(not 0 <= i < made for i in named):
                raise ValueError(
                    f"the fault at {f.at_s:g} s names a peer outside 0..{made - 1} (the peers "
                    "made by then)"
                )
        try:
            self.run_config()
        except RunConfigError as exc:
            raise ValueError(f"[run]: {exc}") from None

    def run_config(self) -> RunConfig:
        return RunConfig.from_mapping(dict(self.run), name="sim")


@dataclass(frozen=True)
class PeersReport:
    peers: int
    joined: int
    killed: int
    #: Outer steps the peers took, and the share of them averaged in a group of two or more.
    outer_steps: int
    averaged_share: float
    #: Each living peer's outer steps as (round, status, group size).
    timelines: dict[str, list[tuple[int, str, int]]]
    #: ... and the virtual second of each.
    times: dict[str, list[float]]
    #: The last round every living peer reached, and how many states they hold there.
    common_round: int
    end_states: int
    errors: dict[str, str]
    calls: int
    virtual_s: float
    wall_s: float
    log_hash: str


def run_peers(
    scenario: PeersScenario, progress: Callable[[str], None] | None = None
) -> PeersReport:
    config = scenario.run_config()
    rng = random.Random(scenario.seed)
    wall0 = time.monotonic()

    def speed() -> float:
        return math.exp(rng.gauss(0.0, scenario.speed_sigma)) if scenario.speed_sigma else 1.0

    async def main(root: Path) -> tuple[SimPeers, set[int], float]:
        sim = SimPeers(root, seed=scenario.seed, network=scenario.network)
        gone: set[int] = set()
        # A stream of its own: the speeds' draws stay what they were without churn.
        churn, lifetimes = scenario.churn, random.Random(f"{scenario.seed}/churn")
        replacing = 0  # peers killed by churn whose replacement has not joined yet
        async with trio.open_nursery() as nursery:
            boot = await sim.bootstrap(nursery)

            def add() -> None:
                steps = scenario.rounds * config.inner_steps
                (peer,) = sim.run_of(
                    config, 1, boot, max_steps=steps, step_s=scenario.step_s / speed()
                )
                nursery.start_soon(sim.run, peer)
                if churn.lifetime_s:
                    life = lifetimes.expovariate(1.0 / churn.lifetime_s)
                    nursery.start_soon(die, len(sim.peers) - 1, trio.current_time() + life)

            async def die(index: int, at: float) -> None:
                nonlocal replacing
                if at > churn.until_s:
                    return
                await trio.sleep_until(at)
                if index in gone or sim.peers[index].done.is_set():
                    return  # killed or stopped by a fault, or done with its rounds
                sim.kill(sim.peers[index])
                gone.add(index)
                replacing += 1
                await trio.sleep(churn.replace_s)
                add()
                replacing -= 1

            for _ in range(scenario.peers):
                add()
            with trio.move_on_after(scenario.limit_s):
                for fault in sorted(scenario.faults, key=lambda f: f.at_s):
                    await trio.sleep_until(fault.at_s)
                    for _ in range(fault.join):
                        add()
                    for i in fault.kill:
                        sim.kill(sim.peers[i])
                        gone.add(i)
                    for i in fault.stop:
                        sim.stop(sim.peers[i])
                        gone.add(i)
                    for i in fault.pause:
                        sim.net.pause(sim.peers[i].address)
                    for i in fault.resume:
                        sim.net.resume(sim.peers[i].address)
                    if fault.cut:
                        sim.net.cut([[sim.peers[i].address for i in s] for s in fault.cut])
                    if fault.heal:
                        sim.net.heal()
                    if progress is not None:
                        progress(f"[{trio.current_time():8.1f}s virtual] {fault}")
                while True:
                    for peer in sim.peers:  # joiners are appended as they come
                        await peer.done.wait()
                    if not replacing:
                        break
                    await trio.sleep(1.0)  # a replacement is due
            end = trio.current_time()
            nursery.cancel_scope.cancel()
        return sim, gone, end

    with tempfile.TemporaryDirectory(prefix="swarmd-sim-") as tmp:
        sim, gone, end = run_virtual(main, Path(tmp), seed=scenario.seed)
    return _report(scenario, sim, gone, end, time.monotonic() - wall0)


def _report(
    scenario: PeersScenario, sim: SimPeers, gone: set[int], end: float, wall_s: float
) -> PeersReport:
    living = [p for i, p in enumerate(sim.peers) if i not in gone]
    steps = {p.name: [e for e in p.out.events if e["event"] == "outer_step"] for p in sim.peers}
    counted = [e for p in sim.peers for e in steps[p.name] if e["status"] != "synced"]
    averaged = sum(e["status"] == "averaged" and e["group_size"] >= 2 for e in counted)
    reached = [max((e["round"] for e in steps[p.name]), default=0) for p in living]
    common = min(reached, default=0)
    # A round a peer took more than once (a catch-up after a lone step) counts its last.
    ends = {
        next(e["state_hash"] for e in reversed(steps[p.name]) if e["round"] == common)
        for p in living
        if common
    }
    return PeersReport(
        peers=scenario.peers,
        joined=len(sim.peers) - scenario.peers,
        killed=len(gone) - sum(len(f.stop) for f in scenario.faults),
        outer_steps=len(counted),
        averaged_share=averaged / len(counted) if counted else 0.0,
        timelines={
            p.name: [(e["round"], e["status"], e["group_size"]) for e in steps[p.name]]
            for p in living
        },
        times={p.name: [round(e["t"], 3) for e in steps[p.name]] for p in living},
        common_round=common,
        end_states=len(ends),
        errors={p.name: repr(p.error) for p in sim.peers if p.error is not None},
        calls=sim.net.calls,
        virtual_s=end,
        wall_s=wall_s,
        log_hash=sim.net.trace.hexdigest(),
    )
