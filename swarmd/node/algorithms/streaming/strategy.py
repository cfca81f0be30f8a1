"""Streaming DiLoCo (Douillard et al. 2025): the outer step is per fragment, every H/P inner
steps, and its matchmaking + all-reduce run in the background from τ steps before it, while the
trainer keeps training. The optimisation is `swarmd.optim.streaming.StreamingDiLoCo`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import trio

from swarmd.node.algorithms.loop import OuterLoopStrategy
from swarmd.node.averaging.allreduce import AllReduceResult
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runend import leave_on_one_state
from swarmd.node.runtime import offload
from swarmd.optim.streaming import FragmentReport, FragmentRound, StreamingDiLoCo

log = logging.getLogger("swarmd.daemon")

#: First DHT poll of an overlapped fragment round's matchmaking: training goes on meanwhile,
#: so a later group costs nothing, and fewer reads keep the round's bytes down.
OVERLAPPED_POLL_S = 0.5


@dataclass
class _Flight:
    """One streaming fragment round on the wire: matchmaking + all-reduce in the background."""

    round: FragmentRound
    #: Wall-clock times (for logs that compare peers) and the trainer's step count.
    started: float
    finished: float | None = None
    done: trio.Event = field(default_factory=trio.Event)
    result: torch.Tensor | AllReduceResult | None = None
    group_size: int = 1
    dropped: int = 0
    live: int = 0
    #: Inner steps the trainer took while the round was on the wire.
    steps_in_flight: int = 0
    #: Bytes this peer sent while the round was on the wire (matchmaking and all-reduce),
    #: and the same by RPC method (short names).
    sync_bytes: int = 0
    sync_by_method: dict[str, int] = field(default_factory=dict)


class StreamingStrategy(OuterLoopStrategy[StreamingDiLoCo]):
    """The trainer loop of streaming DiLoCo.

    A fragment's round (matchmaking + all-reduce) runs as a task in the lifecycle's nursery
    from `begin_round` on, τ inner steps before its outer step, while the loop keeps training;
    at the outer step it waits only if the round is late (eager: it applies a stand-in and goes
    on). The next round cannot begin before the previous one is applied (its result is part of
    the state hash that keys the next round's matchmaking), so one fragment at most is on the
    wire.
    """

    algo = "streaming-diloco"

    #: The fragment round on the wire, if any (one at most).
    _flight: _Flight | None = None

    def make_optimizer(self, model: torch.nn.Module) -> StreamingDiLoCo:
        try:
            return StreamingDiLoCo(model, self.peer.config.streaming_config())
        except ValueError as exc:  # e.g. fewer layers than fragments
            raise JoinError(f"streaming-diloco: {exc}") from None

    def describe(self) -> str:
        config = self.peer.config
        return (
            f", {config.fragments} fragments ({config.fragment_layout}), overlap "
            f"{config.overlap_steps}, alpha {config.mix_alpha}{', eager' if config.eager else ''}"
        )

    async def train(self, nursery: trio.Nursery) -> int:
        start = await self._begin()
        step = self.first_step
        opt = self.opt
        while not self.peer.should_stop(step, start, self.opt.progress):
            await self.inner_step(step)
            step += 1
            flight = self._flight
            if flight is not None and flight.done.is_set() and flight.round.stand_in_applied:
                await self._finish(flight, step, 0.0)
            if opt.round_due():
                begun = await self._begin_round(step, nursery)
                if begun == "stopping":
                    break
                if begun == "synced":
                    continue  # took the group's state instead: no round this time
            if opt.outer_due() and not await self._outer_step(step):
                break  # stopping: the round is abandoned, the last saved state stands
        if not self.peer.stopping.is_set() and self.peer.at_end(self.opt.progress):
            await self._leave_on_one_state(step)
        return step

    async def _leave_on_one_state(self, step: int) -> None:
        """The run's end, as DiLoCo's (peer/runend.py): every live peer it met advertises
        one state of the last turn before it leaves. A last turn can end differently on
        different peers (one averaged, another deferred its fragment), and without this the
        peers left on two states. An eager stand-in still waiting for its average is
        replaced first: the stand-in is this peer's alone."""
        if not await self._settle_flight(step):
            return
        opt = self.opt
        await leave_on_one_state(
            self.state,
            lambda: self.took_group_state(
                step, self.peer.net.monotonic(), fragment=None, turn=opt.turn
            ),
        )

    async def _begin_round(
        self, step: int, nursery: trio.Nursery
    ) -> Literal["started", "synced", "stopping"]:
        """Starts the due fragment's round in the background, unless this peer takes the
        group's state instead ("synced") or is stopped while an eager stand-in still waits for
        its average ("stopping")."""
        if not await self._settle_flight(step):
            return "stopping"
        t0 = self.peer.net.monotonic()
        # A peer whose state is not the group's takes the group's first (see DiLoCo's outer
        # step). The matchmaking key carries the hash of the whole state, not only this
        # fragment's: it is the hash state adverts already carry, so "same key" and "same
        # advertised state" are one notion, and a peer that differs in any fragment is caught
        # up by one state sync, which replaces every fragment anyway. Per-fragment keys would
        # let it average the fragments it still agrees on, for more bookkeeping (per-fragment
        # adverts and sync).
        if await self.state.catch_up():
            await self.took_group_state(step, t0, fragment=None, turn=self.opt.turn)
            return "synced"
        self.peer.clock.wait_s += self.peer.net.monotonic() - t0
        rnd = await offload.run_sync(self.opt.begin_round)
        self._flight = _Flight(rnd, started=self.peer.net.wall())
        self.peer.stats.in_flight = rnd.fragment
        nursery.start_soon(
            self._fragment_round, self._flight, self.round_key(rnd.turn, rnd.fragment)
        )
        # `turn` numbers outer steps from 1 as outer_step events do: this round's.
        self.peer.out.event(
            "round_started",
            f"fragment {rnd.fragment} round {rnd.round + 1} (turn {rnd.turn + 1}) started",
            fragment=rnd.fragment,
            turn=rnd.turn + 1,
            step=step,
        )
        self.peer.clock.held(t0)
        return "started"

    async def _settle_flight(self, step: int) -> bool:
        """Applies the round still on the wire, if any (an eager stand-in waiting for its
        average), waiting for it; False if the peer was stopped while it waited."""
        flight = self._flight
        if flight is None:
            return True
        waited = await self._wait_for(flight)
        if not flight.done.is_set():
            return False
        await self._finish(flight, step, waited)
        return True

    async def _outer_step(self, step: int) -> bool:
        """The fragment's outer step: its average (or, eager, a stand-in while it is late);
        False if the peer is stopping while it waited."""
        flight = self._flight
        assert flight is not None
        if self.opt.config.eager and not flight.done.is_set():
            report = await offload.run_sync(self.opt.apply_stand_in)
            self.peer.out.event(
                "eager_step",
                f"fragment {report.fragment}: average not here yet, applied this "
                "peer's own pseudo-gradient as a stand-in",
                fragment=report.fragment,
                turn=report.turn,
            )
            return True
        return await self._settle_flight(step)

    async def _wait_for(self, flight: _Flight) -> float:
        """The trainer waits for a late round (or for a stop signal: the caller checks
        `flight.done`); returns (and accounts) the seconds."""
        t0 = self.peer.net.monotonic()
        await self.peer.unless_stopping(flight.done.wait)
        waited = self.peer.net.monotonic() - t0
        self.peer.clock.wait_s += waited
        self.peer.clock.held_s += waited
        return waited

    async def _fragment_round(self, flight: _Flight, key: str) -> None:
        """Matchmaking and all-reduce of one fragment's pseudo-gradient; never raises (a
        failed round is `result` None, which the optimiser's failure policy handles)."""
        rnd = flight.round
        sent0 = dict(self.peer.metrics.sent_by_method)
        try:
            # Gridded as DiLoCo's rounds are (see its `_outer_step`): the live count afresh.
            gridded = self.peer.config.grouping == "grid"
            flight.live, target = await self.peer.live.group_target(fresh=gridded)
            overlapped = self.peer.config.overlap_steps > 0
            ef_key = f"fragment/{rnd.fragment}"  # error feedback per fragment
            if self.on_grid(flight.live):
                avg = await self.average_grid(key, rnd.pseudo_grad, rnd.weight, ef_key + "/grid")
            else:
                avg = await self.average(
                    key,
                    rnd.pseudo_grad,
                    rnd.weight,
                    target=target,
                    ef_key=ef_key,
                    poll_s=OVERLAPPED_POLL_S if overlapped else None,
                    layout=(
                        self.opt.fragment_names(rnd.fragment),
                        self.opt.fragment_shapes(rnd.fragment),
                    ),
                )
            flight.group_size, flight.dropped = avg.group_size, avg.dropped
            if avg.mean is not None:
                flight.result = avg.mean
            elif avg.sat_out:
                # Outside the round's grid: the round fails here (the run's failure policy),
                # and the next round's catch-up takes the state its peers then publish.
                flight.result = None
            elif avg.result is not None:
                flight.result = avg.result
            elif avg.formed:
                # A group of one (min_group_size 1, nobody else here): its average is its own.
                flight.result = rnd.pseudo_grad
        except Exception:  # a round that breaks must not take the trainer down with it
            log.exception("fragment %d round (turn %d) failed", rnd.fragment, rnd.turn)
            flight.result = None
        finally:
            flight.steps_in_flight = self.opt.steps - rnd.began_at_step
            flight.sync_by_method = self.peer.metrics.sent_since(sent0)
            flight.sync_bytes = sum(flight.sync_by_method.values())
            flight.finished = self.peer.net.wall()
            flight.done.set()

    async def _finish(self, flight: _Flight, step: int, waited: float) -> None:
        """Applies a finished round's result, publishes the state and reports the step."""
        self._flight = None
        self.peer.stats.in_flight = None
        t0 = self.peer.net.monotonic()
        report = await offload.run_sync(self.opt.finish_round, flight.result)
        self.state.averaged(report.status, flight.group_size, flight.dropped)
        snap = await self.state.publish(step)
        # Validate once per H steps (after the last fragment's turn), as plain DiLoCo does.
        val = (
            await offload.run_sync(self.validate) if report.turn % self.opt.fragments == 0 else None
        )
        self.peer.stats.outer_done(self.opt.round, flight.group_size, report.status, val)
        self._report(report, flight, snap.state_hash.hex(), val, waited, self.peer.clock.held(t0))

    def _report(
        self,
        report: FragmentReport,
        flight: _Flight,
        state_hash: str,
        val: float | None,
        waited: float,
        held: float,
    ) -> None:
        size, dropped = flight.group_size, flight.dropped
        self.peer.out.event(
            "outer_step",
            f"fragment {report.fragment} round {report.round}: {report.status} with {size} "
            f"peer(s){f', {dropped} dropped' if dropped else ''}"
            f"{' (replaced the stand-in)' if report.replaced_stand_in else ''}, "
            f"{flight.steps_in_flight} step(s) during the round, waited {waited:.2f}s"
            f"{f', validation loss {val:.4f}' if val is not None else ''}, "
            f"state {state_hash[:12]}",
            round=self.opt.round,
            fragment=report.fragment,
            fragment_round=report.round,
            turn=report.turn,
            status=report.status,
            group_size=size,
            live_peers=flight.live,
            dropped=dropped,
            val_loss=val,
            state_hash=state_hash,
            steps_in_flight=flight.steps_in_flight,
            sync_bytes=flight.sync_bytes,
            sync_by_method=flight.sync_by_method,
            replaced_stand_in=report.replaced_stand_in,
            started=round(flight.started, 3),
            finished=round(flight.finished or self.peer.net.wall(), 3),
            wait_s=round(waited, 3),
            seconds=round(held + waited, 3),
        )
