"""SWARM runs of simulated real peers (swarmd/node/sim/peers.py) driven by a test's async body:
the process tests' `receive` loops become waits for a peer's next event in virtual time."""

from __future__ import annotations

import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.sim.peers import Event, SimPeer, SimPeers
from swarmd.node.sim.virtual import run_virtual
from swarmd.node.timing import TimingProfile


class SwarmSim:
    """One SWARM run: ``add`` starts a peer (the first creates the run), ``next`` waits for a
    peer's next event of a kind."""

    def __init__(self, sim: SimPeers, nursery: trio.Nursery, boot: str, config: RunConfig):
        self.sim = sim
        self.nursery = nursery
        self.boot = boot
        self.config = config
        #: How many of each peer's events `next` has handed out.
        self._read: dict[str, int] = {}

    def add(self, name: str, **more: Any) -> SimPeer:
        """A started peer; ``more``: JoinOptions fields (``role``, ``stage``, ``swarm_audit``,
        ``slowdown``, ``max_steps``)."""
        first = not self.sim.peers
        peer = self.sim.add(
            name,
            run=self.config.name,
            peers=[self.boot],
            create_run=self.config if first else None,
            **more,
        )
        self.nursery.start_soon(self.sim.run, peer)
        return peer

    def servers(self, *stages: int, prefix: str = "s") -> list[SimPeer]:
        """One server of each of ``stages``, named ``{prefix}{stage}``."""
        return [self.add(f"{prefix}{s}", role="server", stage=s) for s in stages]

    async def three_stages(self) -> list[SimPeer]:
        """A server on each of 3 stages (``s0``-``s2``), serving; then a trainer (``t``).
        Returns [s0, s1, s2, trainer]."""
        servers = self.servers(0, 1, 2)
        for s in servers:
            await self.next(s, "stage")
        return [*servers, self.add("t", role="trainer")]

    async def next(
        self,
        peer: SimPeer,
        kind: str,
        where: Callable[[Event], bool] = lambda e: True,
        limit_s: float = 60.0,
        seen: list[Event] | None = None,
    ) -> Event:
        """``peer``'s first event of ``kind`` that ``where`` accepts, after the last one this
        returned for it; the events passed over on the way go to ``seen``. Fails after
        ``limit_s`` virtual seconds with the peer's last events and warnings."""
        try:
            with trio.fail_after(limit_s):
                while True:
                    events = peer.out.events
                    start = self._read.get(peer.name, 0)
                    for i in range(start, len(events)):
                        e = events[i]
                        if e["event"] == kind and where(e):
                            if seen is not None:
                                seen.extend(events[start:i])
                            self._read[peer.name] = i + 1
                            return e
                    await trio.sleep(0.1)
        except trio.TooSlowError:
            tail = [(e["event"], round(e["t"], 1)) for e in peer.out.events[-10:]]
            why = f"{peer.name}: no {kind} in {limit_s} s: {tail} {peer.logs[-5:]}"
            raise AssertionError(why) from None

    async def trained_round(self, peer: SimPeer, limit_s: float = 60.0) -> Event:
        """``peer``'s next stage round that applied micro-batches."""
        return await self.next(peer, "stage_round", lambda e: e["micro_batches"] > 0, limit_s)


def swarm_run(
    root: Path,
    run: str,
    body: Callable[[SwarmSim], Awaitable[None]],
    seed: int = 0,
    timings: TimingProfile | None = None,
) -> SimPeers:
    """Runs ``body`` on a SWARM run of ``run`` (a run file's text) in virtual time, every
    peer with ``timings`` (default: the defaults); then stops
    every peer still running, as SIGTERM would, and waits for each to leave."""

    async def main() -> SimPeers:
        sim = SimPeers(root, seed=seed, timings=timings)
        config = RunConfig.from_mapping(tomllib.loads(run), name="swarm")
        async with trio.open_nursery() as nursery:
            boot = await sim.bootstrap(nursery)
            await body(SwarmSim(sim, nursery, boot, config))
            for peer in sim.peers:
                if not peer.done.is_set():
                    sim.stop(peer)
            with trio.fail_after(120):
                for peer in sim.peers:
                    await peer.done.wait()
            nursery.cancel_scope.cancel()
        return sim

    return run_virtual(main, seed=seed)
