"""A SWARM stage server: the stage it serves, its rounds, and its moves between stages.

The strategy (swarm.py) makes one when the peer serves (`--role server|both`). It builds its
stage from the run's seeded model, takes the stage's state from the stage's servers (or the
seed), attaches the stage to the peer's Stage service (stage_service.py), and then, every
`round_s` of wall-clock time, averages the stage's accumulated gradients with the stage's other
servers and steps (`_round`); now and then it looks whether to move to the bottleneck stage
(`_maybe_move`). docs/architecture.md, "SWARM", says why each rule is what it is.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import trio

from swarmd.node.algorithms.swarm import copies, directory, recovery
from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.algorithms.swarm.cut import cut_stages, probe_shape
from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.follow import countable, state_to_follow
from swarmd.node.algorithms.swarm.rebalance import (
    Looks,
    Move,
    choose_move,
    contest,
    least_served,
)
from swarmd.node.algorithms.swarm.stage_clock import next_boundary, stage_matchmaking
from swarmd.node.algorithms.swarm.stage_service import StageHost, StageJob, StageShape
from swarmd.node.averaging.allreduce import Member
from swarmd.node.averaging.codecs import CodecName
from swarmd.node.averaging.matchmaking import form_group
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.model import build_model
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.sharedstate import SharedState
from swarmd.node.runkeys import stage_round_key
from swarmd.node.runtime import offload
from swarmd.optim.stage import StageTrainer
from swarmd.protocol import faults
from swarmd.protocol.identity import PeerId

log = logging.getLogger("swarmd.swarm")

#: Lone rounds in a row a server carries before it steps alone (`StageServer._round`): the
#: others that did not come are late a boundary or two, or (past this) not coming to its
#: state at all: a server stuck on another state must not stop its stage's training.
MAX_CARRIED = 2


class StageServer:
    """This peer's stage: what it serves, with whom it averages, where it moves."""

    def __init__(self, peer: PeerContext, swarm: SwarmConfig, audit: Path | None) -> None:
        #: The Stage service this peer serves (stage_service.py), its stage attached to it.
        self.host = peer.host("swarm", StageHost)
        self.peer = peer
        self.swarm = swarm
        self.job: StageJob | None = None
        self.state: SharedState | None = None
        self.me = Member(
            peer.identity.peer_id, peer.address, peer.opts.bandwidth, client=peer.client_mode
        )
        #: Stage rounds this server took part in (its steps, for --max-steps of a server).
        self.rounds = 0
        #: The run's stage servers as last read, and whether a read was made yet.
        self._directory: dict[PeerId, StageRecord] = {}
        self._directory_read = trio.Event()
        #: Whether this server's stage state may be its own (its last round was not one
        #: whole round with every server of the stage, or it just joined and the stage may
        #: have stepped since its download): it looks at the stage's until sure.
        self._unsure = True
        #: Lone rounds carried in a row (MAX_CARRIED), and the boundary of this round.
        self._carried = self._boundary = 0
        self._me = str(peer.identity.peer_id)
        self._nursery: trio.Nursery | None = None
        self._audit = audit
        #: The stage this server is moving to while it downloads that stage's state.
        self._moving_to: int | None = None
        #: When this server began rebuilding its lost stage (until its first step).
        self._recovered_at: float | None = None
        self._looks = Looks()
        #: CheckFree+: the copies of a neighbouring end stage's edge layers this one keeps.
        self._copies = copies.Keeper(peer, swarm.stages)
        #: A test's fault plan (`round_overrun_s`), if the process runs under one.
        self._faults = faults.from_env()

    async def start(self) -> None:
        """Takes the first stage (--stage, or the least served) and serves it."""
        stage = self.peer.opts.stage
        if stage is None:
            stage = await self._least_served()
        elif stage >= self.swarm.stages:
            raise JoinError(
                f"--stage {stage}: run {self.peer.config.name!r} has {self.swarm.stages} "
                f"stages (0 to {self.swarm.stages - 1})"
            )
        self.job, self.state = await self._take_stage(stage)
        self.host.attach(self.job)

    async def _least_served(self) -> int:
        records = await directory.read(self.peer.dht, self.peer.config.name, self.swarm.stages)
        return least_served(records, self.swarm.stages)

    def _build_stages(self) -> tuple[list[StageTrainer], StageShape]:
        config = self.peer.config
        model = build_model(config, "cpu")
        stages = cut_stages(model, self.swarm.stages)
        shape = probe_shape(stages, config.batch_size, config.block_size)
        return recovery.build_all(self.peer, stages), shape

    async def _take_stage(self, stage: int) -> tuple[StageJob, SharedState]:
        """Builds `stage`, takes its servers' state (or rebuilds it if it was lost, or the
        seeded one at the run's start), publishes it."""
        trainers, shape = await offload.run_sync(self._build_stages)
        trainer = trainers[stage]
        state = SharedState(self.peer, trainer, scope=f"stage{stage}")
        t0 = self.peer.net.monotonic()
        origin, rebuilt = await recovery.take_stage_state(self.peer, stage, trainers, state)
        self._recovered_at = t0 if rebuilt else None
        if self.swarm.swap > 0:
            self._copies.serving(recovery.edge_sizes(trainers))
        job = StageJob(
            trainer,
            shape,
            activations=self.swarm.activations,
            slowdown=self.peer.opts.slowdown,
            on_applied=self._log_applied if self._audit else None,
            # A trainer gives up a call after call_timeout_s: a server must not compute
            # (and apply) one after its caller went elsewhere.
            max_wait_s=self.swarm.call_timeout_s / 3,
        )
        await self._warm_up(job)
        await state.publish(0)
        job.version = state.last_hash or b""
        self.peer.out.event(
            "stage",
            f"serving stage {stage} of {self.swarm.stages}: {trainer.numel / 1e6:.2f}M "
            f"parameters, round {trainer.round} ({origin} start), "
            f"{job.rate:.1f} micro-batches/s",
            stage=stage,
            stages=self.swarm.stages,
            params=trainer.numel,
            origin=origin,
            round=trainer.round,
            rate=round(job.rate, 3),
        )
        return job, state

    async def _warm_up(self, job: StageJob) -> None:
        """One micro-batch of zeros through the stage (gradients dropped), so its first record
        already says how fast it computes."""
        s, t = job.shape, job.trainer
        x = (
            torch.zeros(s.batch, s.block, dtype=torch.int64)
            if t.first
            else torch.zeros(s.batch, s.block, s.width)
        )
        host = self.host
        if t.last_stage:
            y = torch.zeros(s.batch, s.block, dtype=torch.int64)
            await host.compute("last", lambda: t.last(x, y), job)
        else:
            out = await host.compute("forward", lambda: t.forward(x), job)
            g = torch.zeros_like(out)
            await host.compute("backward", lambda: t.backward(x, g), job)
        await host.compute("take", t.take, job)

    def _log_applied(self, call: str) -> None:
        assert self._audit is not None
        with self._audit.open("a") as f:
            f.write(call + "\n")

    async def leave(self) -> None:
        if self.job is None:
            return
        self.host.attach(None)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await self._publish(directory.gone(self._record()))

    # -- serve -------------------------------------------------------------------------------

    def _record(self, state: str = "serving") -> StageRecord:
        assert self.job is not None
        if self._moving_to is not None and state == "serving":
            # Counted at the stage it moves to while it downloads (see rebalance.py).
            return StageRecord(
                stage=self._moving_to,
                address=self.peer.address,
                rate=min(self.job.rate, 1e6),
                queue=self.host.queue,
                state="joining",
                round=0,
            )
        return StageRecord(
            stage=self.job.index,
            address=self.peer.address,
            rate=min(self.job.rate, 1e6),
            queue=self.host.queue,
            state=state,
            round=self.job.trainer.round,
            grad_norm=min(self.job.trainer.last_grad_norm, 1e29),
        )

    async def _publish(self, record: StageRecord | None = None) -> None:
        """Stores (or refreshes) this server's record (default: what it does now)."""
        peer = self.peer
        record = record or self._record()
        ttl_s = peer.timings.swarm.record_ttl_s
        await directory.publish(peer.dht, peer.config.name, peer.identity.peer_id, record, ttl_s)

    async def _publish_records(self) -> None:
        """Refreshes this server's record, and reads the stage directory (what rounds and
        moves use: a read per round cost each round a DHT lookup)."""
        while True:
            peer = self.peer
            await self._publish()
            self._directory = await directory.read(peer.dht, peer.config.name, self.swarm.stages)
            self._directory_read.set()
            await trio.sleep(peer.timings.swarm.refresh_s)

    async def serve(self) -> None:
        """Stage rounds on the wall clock's `round_s` boundaries (`next_boundary`: a round that
        overran by much skips a boundary)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._publish_records)
            await self._directory_read.wait()
            # The first look after a whole period at least: rates measured on real traffic,
            # not the warm-up's alone.
            next_look = (
                self.peer.net.monotonic() + self._look_after() + 0.5 * self.swarm.rebalance_s
            )
            period, last = self.swarm.round_s, -1
            gather = stage_matchmaking(period, 2).gather_s
            while True:
                r = next_boundary(self.peer.net.wall(), period, last, gather)
                last = self._boundary = r
                await trio.sleep(max(0.0, r * period - self.peer.net.wall()))
                if self._unsure:
                    # At the boundary, before this round's matchmaking: the stage's servers
                    # have published the state they now matchmake under (the gather waits
                    # for a late member while the download runs).
                    with trio.move_on_after(period):
                        await self._guarded(self._follow_stage)
                await self._guarded(self._round)
                if self._faults is not None and (overrun := self._faults.plan().round_overrun_s):
                    said = f"the fault plan holds this server {overrun:.1f} s past its round"
                    self.peer.out.event("stage_overrun", said, seconds=overrun)
                    await trio.sleep(overrun)
                if self.swarm.swap > 0 and self.job is not None:
                    self._copies.after_round(self._nursery, self.job.index, self._directory)
                if self.swarm.rebalance_s > 0 and self.peer.net.monotonic() >= next_look:
                    await self._guarded(self._maybe_move)
                    next_look = self.peer.net.monotonic() + self._look_after()

    async def _guarded(self, step: Callable[[], Awaitable[object]]) -> None:
        """One step of the loop; what fails in it is said, and the server goes on (unsure of
        its state) rather than take the peer down."""
        try:
            await step()
        except Exception as exc:
            log.exception("stage server: %s failed", step.__name__)
            self._unsure = True
            self.peer.out.event(
                "stage_error",
                f"stage server: {step.__name__.strip('_')} failed: {exc}",
                what=step.__name__.strip("_"),
                error=str(exc)[:300],
            )

    def _look_after(self) -> float:
        return self.swarm.rebalance_s * random.uniform(0.5, 1.5)

    def _stage_peers(self) -> dict[str, StageRecord]:
        """The stage's serving servers, as last read (a refresh ago at most)."""
        assert self.job is not None
        return {
            str(p): r
            for p, r in self._directory.items()
            if r.stage == self.job.index and r.state == "serving"
        }

    async def _round(self) -> None:
        """One stage round: take, average with the stage's servers, step, publish.

        The matchmaking key is the stage's state hash and the round's boundary: servers
        holding the same state meet at each boundary (one that started late is waited for up
        to the gather time). A round nobody else came to is carried (`_carry`). The boundary
        keeps a carried state's next round off the lone round's key, whose group of one
        would read to a late server as a group formed without it."""
        job, state, host = self.job, self.state, self.host
        assert job is not None and state is not None and state.last_hash is not None
        t0 = self.peer.net.monotonic()
        peers = self._stage_peers()
        target = len(set(peers) | {self._me})
        key = stage_round_key(self.peer.config.name, job.index, state.last_hash, self._boundary)
        group = None
        if target > 1:
            mm = stage_matchmaking(self.swarm.round_s, target)
            group = await form_group(self.peer.dht, key, self.me, mm)
            if (group is None or len(group.members) < 2) and self._carried < MAX_CARRIED:
                self._carry(target)
                return
        # Taken once the group is known: the gathering's micro-batches count in this round,
        # and a carried round leaves them where they are.
        grad, count = await host.compute("take", job.trainer.take, job)
        self._carried = 0
        group_size, dropped, avg, whole = 1, 0, grad, True
        if group is not None and len(group.members) > 1:
            result = await self.peer.averager.allreduce(
                group,
                grad,
                StageTrainer.weight(count),
                key=f"stage{job.index}",
                codec=self._codec(),
            )
            avg, group_size, dropped = result.tensor, len(group.members), len(result.dropped)
            whole = result.ok and not dropped
            state.meet(m.peer_id for m in group.members if m.peer_id not in result.dropped)
            state.averaged("averaged", group_size, dropped)
        if not bool(avg.any()):
            # Nobody of the group had a micro-batch (an idle pipeline): no step, only the
            # round moves on. Every member sees the same average: the same decision.
            await host.compute("skip", job.trainer.skip, job)
            await state.publish(job.trainer.round, background=self._nursery)
            job.version = state.last_hash or b""
            self._unsure = not (whole and group_size == target)
            return
        await host.compute("apply", lambda: _apply(job, avg), job)
        snap = await state.publish(job.trainer.round, background=self._nursery)
        job.version = snap.state_hash
        # A round with all of the stage's servers leaves them identical by construction;
        # otherwise this server may hold a state of its own now.
        # A dropped member or a part that failed leaves members with their own values there.
        self._unsure = not (whole and group_size == target)
        self._report(count, group_size, dropped, snap.state_hash, self.peer.net.monotonic() - t0)

    def _report(
        self, count: int, group_size: int, dropped: int, state_hash: bytes, seconds: float
    ) -> None:
        """Counts a stepped round and says it (`stage_round`)."""
        job = self.job
        assert job is not None
        self.rounds += 1
        self.peer.stats.round = job.trainer.round
        loss = job.trainer.taken_loss
        if math.isfinite(loss):
            self.peer.stats.loss = loss
        recovery_s = None
        if self._recovered_at is not None and count > 0:
            recovery_s = round(self.peer.net.monotonic() - self._recovered_at, 3)
            self._recovered_at = None
        self.peer.out.event(
            "stage_round",
            f"stage {job.index} round {job.trainer.round}: {count} micro-batches"
            f"{f', loss {loss:.4f}' if math.isfinite(loss) else ''}, group of "
            f"{group_size}{f', {dropped} dropped' if dropped else ''}, "
            f"{job.rate:.1f} micro-batches/s",
            stage=job.index,
            round=job.trainer.round,
            micro_batches=count,
            loss=round(loss, 5) if math.isfinite(loss) else None,
            group_size=group_size,
            dropped=dropped,
            rate=round(job.rate, 3),
            state_hash=state_hash.hex(),
            seconds=round(seconds, 3),
            # After a rebuild: seconds from the lost stage's detection to its first step.
            **({"recovery_s": recovery_s} if recovery_s is not None else {}),
            left_out=job.trainer.taken_left_out,  # of the sum, per caller (grad_bound.py)
        )

    def _carry(self, target: int) -> None:
        """A round nobody else of the stage came to: no step, the gradients keep
        accumulating and the state stays, so a server a boundary late meets this one at the
        next (stepped alone, the two stepped apart in turn: docs/architecture.md, SWARM)."""
        job = self.job
        assert job is not None
        self._carried += 1
        self._unsure = True
        said = f"stage {job.index} round {job.trainer.round}: none of {target - 1} others came"
        n, r = self._carried, job.trainer.round
        self.peer.out.event("stage_carried", said, stage=job.index, round=r, carried=n)

    def _codec(self) -> CodecName:
        """The run's codec for stage gradients (topk and lowrank are for DiLoCo's
        pseudo-gradients: a stage round's dense gradient goes as int8)."""
        codec = self.peer.config.codec
        return "fp16" if codec == "fp16" else "fp32" if codec == "fp32" else "int8"

    async def _follow_stage(self) -> bool:
        """Takes the state most of the stage's servers hold when this server's is another
        (it missed a round: no group, a late join); True if it did."""
        state, peers = self.state, self._stage_peers()
        assert state is not None and self.job is not None
        mine, my_round = state.last_hash, self.job.trainer.round
        assert mine is not None
        # A stranger's advert of a far later round must not pull the stage to its state.
        # Met servers and the run's creator, once this one has met any (until then: all).
        known = state.met | ({state.creator} if state.creator and state.met else set())
        stage = [a for a in await state.adverts() if a.owner in peers]
        adverts = countable(stage, known, mine)
        best = state_to_follow(mine, my_round, ((a.state_hash, a.round) for a in adverts))
        if best == mine:
            # Sure again once another server holds this state too (or there is none).
            shared = any(a.state_hash == mine for a in adverts)
            self._unsure = not shared and len(set(peers) - {self._me}) > 0
            return False
        self.job.version = b""  # the download replaces the parameters
        if not await state.sync_to([a for a in adverts if a.state_hash == best]):
            return False
        self._unsure = False
        snap = await state.publish(self.job.trainer.round, background=self._nursery)
        self.job.version = snap.state_hash
        self.peer.out.event(
            "stage_sync",
            f"stage {self.job.index}: took the state of the stage's servers, round "
            f"{self.job.trainer.round}",
            stage=self.job.index,
            round=self.job.trainer.round,
            state_hash=snap.state_hash.hex(),
        )
        return True

    async def _maybe_move(self) -> None:
        """Moves when two looks in a row name the same move (rebalance.Looks)."""
        assert self.job is not None
        peer, named = self.peer, self._looks.named
        if named:
            # A confirming look reads the directory afresh: another server of the stage that
            # moved since the last refresh is then counted (joining) and this one stays.
            self._directory = await directory.read(peer.dht, peer.config.name, self.swarm.stages)
        records = dict(self._directory)
        me = peer.identity.peer_id
        records[me] = self._record()
        move = choose_move(records, me, self.swarm.stages, self.swarm.rebalance_gain, named)
        if self._looks.confirm(move):
            assert move is not None
            await self._move(move)

    async def _claim(self, target: int) -> bool:
        """Publishes this server as joining `target`, then reads whether another server
        claims it too (rebalance.py, `contest`): True when this one goes; otherwise it
        publishes itself serving its stage again."""
        peer, me = self.peer, self.peer.identity.peer_id
        await self._publish()
        stages = self.swarm.stages
        verdict = contest(await directory.read(peer.dht, peer.config.name, stages), me, target)
        if verdict == "wait":
            await trio.sleep(peer.timings.swarm.contest_wait_s)
            records = await directory.read(peer.dht, peer.config.name, stages)
            verdict = "go" if contest(records, me, target) == "go" else "yield"
        if verdict != "go":
            self._moving_to = None
            log.info("left the move to stage %d to another server", target)
            await self._publish()
        return verdict == "go"

    async def _move(self, move: Move) -> None:
        """Serves `move.target` instead: announced as joining it, its state downloaded, then
        switched (the old stage keeps its other servers)."""
        assert self.job is not None
        peer = self.peer
        self._moving_to = move.target
        if not await self._claim(move.target):
            return
        peer.out.event(
            "rebalance",
            f"moving from stage {move.source} to stage {move.target}: the slowest stage's "
            f"throughput {move.before:.2f} -> {move.after:.2f} micro-batches/s",
            source=move.source,
            target=move.target,
            before=round(move.before, 3),
            after=round(move.after, 3),
        )
        try:
            job, state = await self._take_stage(move.target)
        finally:
            self._moving_to = None
        # The old stage's gradients of the micro-batches since its last round (a move follows
        # a round at once, so few) are dropped with it.
        self.job, self.state, self._unsure = job, state, True
        self.host.attach(job)
        await self._publish()


def _apply(job: StageJob, avg: torch.Tensor) -> None:
    """A round's step, under the device lock: the answers computed from here until the new
    state is published name no state, so none is compared with another server's."""
    job.version = b""
    job.trainer.apply(avg)
