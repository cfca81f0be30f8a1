"""DiLoCo (Douillard et al. 2023): H inner steps, then the whole trainer waits for one outer
step: catch up if behind, matchmaking, all-reduce of the pseudo-gradient, outer Nesterov step,
publish. The optimisation itself is `swarmd.optim.diloco.DiLoCo` (pure torch, no I/O)."""

from __future__ import annotations

import logging

import torch
import trio

from swarmd.node.algorithms.loop import Averaging, OuterLoopStrategy
from swarmd.node.peer.runend import leave_on_one_state
from swarmd.node.runtime import offload
from swarmd.optim.diloco import DiLoCo, OuterStepReport

log = logging.getLogger(__name__)


class DiLoCoStrategy(OuterLoopStrategy[DiLoCo]):
    algo = "diloco"

    def make_optimizer(self, model: torch.nn.Module) -> DiLoCo:
        return DiLoCo(model, self.peer.config.diloco_config())

    async def train(self, nursery: trio.Nursery) -> int:
        start = await self._begin()
        step = self.first_step
        while not self.peer.should_stop(step, start, self.opt.progress):
            await self.inner_step(step)
            step += 1
            if not self.opt.should_sync():
                continue
            # H steps before the round's inner_seconds: wait them out, so this peer comes to
            # the round's group with the others (DiLoCo.time_left).
            with trio.move_on_after(self.opt.time_left()):
                await self.peer.stopping.wait()
            dropped = self.opt.steps_since_sync
            if await self._outer_step(step, nursery):
                # The round's inner steps were dropped for the group's state: they do not
                # count toward --max-steps. Counted, a peer that caught up stopped a round
                # before the peers it had caught up with, and the last of those averaged its
                # final round alone, ending on another state (a CI failure under load).
                step -= dropped
        if not self.peer.stopping.is_set() and self.peer.at_end(self.opt.progress):
            await leave_on_one_state(
                self.state, lambda: self.took_group_state(step, self.peer.net.monotonic())
            )
        await self.reports_drained()
        return step

    async def _outer_step(self, step: int, nursery: trio.Nursery) -> bool:
        """One outer step; True if it took the group's state instead (a catch-up)."""
        t0 = self.peer.net.monotonic()
        # A peer whose state is not the group's (it missed a round, or the group moved on
        # while it trained) takes the group's state first; its inner steps of this round are
        # dropped.
        if await self.state.catch_up():
            await self.took_group_state(step, t0)
            return True
        sent0 = dict(self.peer.metrics.sent_by_method)
        pg = await offload.run_sync(self.opt.pseudo_gradient)
        # Wait for as many peers as are alive in the run (their heartbeats), not for the
        # configured maximum: a small run should not sit out the whole gather deadline.
        # On the grid, whether this round is gridded is read afresh too: a peer that counted
        # 2 of 3 peers from a view kept 10 s averaged flat in pairs while the third stood
        # alone on its grid for a whole run.
        gridded = self.peer.config.grouping == "grid"
        live, target = await self.peer.live.group_target(fresh=gridded)
        key = self.round_key(self.opt.round)
        if self.on_grid(live):
            avg = await self.average_grid(key, pg, self.opt.weight())
        else:
            avg = await self.average(key, pg, self.opt.weight(), target=target, ef_key="diloco")
        if avg.sat_out:
            # Outside the round's grid, or its group fell short: it carries the round at once
            # and says so (its advert), then takes the round's state if most of the roster
            # averaged (a catch-up: its inner steps are dropped). When every group fell short
            # (a block dropped above the rows is dropped in every column alike), all carry
            # and stay on one state; applying each its own pseudo-gradient made a state
            # apiece. Waiting for an averaged state before carrying, every member waited all
            # of `lone_wait_s` for states nobody would publish (12 peers in groups of 4: a
            # third of the run's time).
            report = self.opt.carry(pg)
            snap = await self.state.publish(step)
            if await self.state.catch_up(publishers=avg.publishers):
                await self.took_group_state(step, t0)
                return True
        if avg.left:  # no lone step on the way out: the saved state stays the run's
            log.info(
                "round %d: leaving before a group formed; its inner steps are dropped",
                self.opt.round,
            )
            return False
        # Plain DiLoCo's trainer waits for all of it: catch-up check, matchmaking, all-reduce.
        waited = self.peer.net.monotonic() - t0
        sync_by_method = self.peer.metrics.sent_since(sent0)
        self.peer.clock.wait_s += waited
        result = avg.mean if avg.mean is not None else avg.result
        if not avg.sat_out:
            report = await offload.run_sync(self.opt.apply_outer, pg, result)
            self.state.averaged(report.status, avg.group_size, avg.dropped)
            snap = await self.state.publish(step, background=nursery)
        # The new global parameters are validated (and the state saved) beside the next inner
        # steps, not before them; the round's `outer_step` line follows when both are done.
        params = await offload.run_sync(self.global_params if avg.sat_out else self.params_now)
        held = self.peer.clock.held(t0)
        self.report_later()
        nursery.start_soon(
            self._report, params, held, report, avg, live, waited, sync_by_method,
            snap.state_hash.hex(),
        )  # fmt: skip
        return False

    async def _report(
        self,
        params: dict[str, torch.Tensor],
        held: float,
        report: OuterStepReport,
        avg: Averaging,
        live: int,
        waited: float,
        sync_by_method: dict[str, int],
        state_hash: str,
    ) -> None:
        try:
            val = await self.validate_params(params)
            await self.state.saved()  # an `outer_step` line means the round is on disk
        finally:
            self.report_done()
        round_no, status = report.round, report.status
        self.peer.stats.outer_done(round_no, avg.group_size, status, val)
        size, dropped = avg.group_size, avg.dropped
        self.peer.out.event(
            "outer_step",
            f"round {round_no}: {status} with {size} peer(s)"
            f"{f', {dropped} dropped' if dropped else ''}, validation loss {val:.4f}, "
            f"state {state_hash[:12]}, {held:.1f}s",
            round=round_no,
            status=status,
            group_size=size,
            live_peers=live,
            dropped=dropped,
            val_loss=val,
            state_hash=state_hash,
            wait_s=round(waited, 3),
            sync_bytes=sum(sync_by_method.values()),
            sync_by_method=sync_by_method,
            seconds=round(held, 3),
            # This peer's inner steps in the round: H, or fewer when inner_seconds ended it.
            inner_steps=report.inner_steps,
        )
