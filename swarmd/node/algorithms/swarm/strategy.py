"""SWARM parallelism (`algo = "swarm"`): a peer serves a pipeline stage, drives micro-batches
through the stages as a trainer, or both (`swarmd join --role`).

A server (server_role.py) builds the run's seeded model, keeps the layers of its stage and
serves them (stage_service.py). Every `round_s` of wall-clock time the servers of a stage take
the gradients they accumulated, average them through matchmaking and the all-reduce (keyed by
the stage state's hash, so only servers holding the same state average) and each takes the
same AdamW step: the stage's servers stay identical. A server whose state is not the one most
of its stage holds (it missed a round) downloads theirs; a joiner downloads its stage's state
(sharedstate.py, scoped to the stage). Now and then (`rebalance_s`) a server looks whether it
should move to the bottleneck stage (rebalance.py); if so it downloads that stage's
state first and only then stops serving its old one, which keeps at least one server.

A trainer (trainer.py) reads its data shard and runs `inflight` micro-batches at a time
through the pipeline. Its steps are micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import trio

from swarmd.node.algorithms.loop import choose_shard
from swarmd.node.algorithms.swarm import directory
from swarmd.node.algorithms.swarm.server_role import StageServer
from swarmd.node.algorithms.swarm.stage_service import StageHost
from swarmd.node.algorithms.swarm.trainer import MicroBatchFailed, SwarmTrainer
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.options import JoinOptions
from swarmd.node.peer.strategy import HostParts, Strategy
from swarmd.node.runtime import offload
from swarmd.workloads import TokenSource, load_source

AUDIT_FILE = "stage-applied.log"
#: With --swarm-audit, a trainer writes the micro-batches it completed here when it stops.
COMPLETED_FILE = "trainer-completed.log"


class SwarmStrategy(Strategy):
    algo = "swarm"

    @classmethod
    def needs_reachable(cls, opts: JoinOptions) -> str | None:
        """A trainer only dials out; a server is dialled by every trainer."""
        if opts.role == "trainer":
            return None
        return (
            f"trainers dial the stage servers, and --role {opts.role} serves a stage; a peer "
            "behind NAT can join as --role trainer"
        )

    @classmethod
    def host(cls, parts: HostParts) -> StageHost:
        """The Stage service every peer serves: it answers once a stage is attached."""
        return StageHost(parts.net)

    def __init__(self, peer: PeerContext) -> None:
        super().__init__(peer)
        self.swarm = peer.config.swarm_config()
        role = peer.opts.role
        self.serving = role in ("server", "both", "auto")
        self.training = role in ("trainer", "both", "auto")
        self.trainer: SwarmTrainer | None = None
        self.server: StageServer | None = None
        self._source: TokenSource | None = None
        self.shard = 0
        self._audit = peer.opts.state_dir if peer.opts.swarm_audit else None
        # A stage's servers average the gradients of whichever micro-batches each got, so
        # the run's outlier rules for pseudo-gradients do not fit their averaging:
        # - weights differ by design (the router sends more to faster servers);
        # - so do norms: a server that got no micro-batch sends zeros, and a 10x-its-own
        #   bound then refused its partner's part (stages split under load). Finite checks,
        #   the proofs and the stage's clip of the averaged gradient bound a step;
        # - opposed contributions are dropped for pseudo-gradients, which agree; these are
        #   noisier, and a drop leaves the servers unsure of their state: never measured.
        peer.averager.set_reduction(
            dataclasses.replace(
                peer.averager.config.reduction,
                weight_outlier_factor=1e9,
                norm_outlier_factor=math.inf,
                drop_opposed=False,
            )
        )

    @property
    def round(self) -> int:
        """The served stage's round (a trainer alone has none: 0)."""
        job = self.server.job if self.server is not None else None
        return job.trainer.round if job is not None else 0

    # -- join --------------------------------------------------------------------------------

    async def join(self) -> None:
        config = self.peer.config
        if self.training:
            self.shard = choose_shard(self.peer)
            self._source = await offload.run_sync(load_source, config.data)
            self.trainer = SwarmTrainer(
                self.peer.client,
                functools.partial(directory.read, self.peer.dht, config.name, self.swarm.stages),
                self.swarm,
                self.peer.out.event,
                keep_completed=self._audit is not None,
                rng=self.peer.net.rng,
                timings=self.peer.timings.swarm,
            )
        if self.serving:
            audit = self._audit / AUDIT_FILE if self._audit is not None else None
            self.server = StageServer(self.peer, self.swarm, audit)
            await self.server.start()

    # -- train -------------------------------------------------------------------------------

    async def train(self, nursery: trio.Nursery) -> int:
        start = self.peer.net.monotonic()
        roles = [r for r, on in (("server", self.serving), ("trainer", self.training)) if on]
        self.peer.out.event(
            "training",
            f"SWARM: {' and '.join(roles)}, {self.swarm.stages} stages, rounds every "
            f"{self.swarm.round_s:g} s, activations {self.swarm.activations}",
            algo="swarm",
            roles=roles,
            stages=self.swarm.stages,
        )
        server = self.server
        try:
            async with trio.open_nursery() as inner:
                if server is not None:
                    inner.start_soon(server.serve)
                if self.training:
                    await self._train_loop(start)
                else:
                    assert server is not None
                    while not self.peer.should_stop(server.rounds, start):
                        await trio.sleep(0.2)
                inner.cancel_scope.cancel()
        finally:
            if server is not None:
                await server.leave()
        if self.trainer is not None:
            return self.trainer.stats.done
        return server.rounds if server is not None else 0

    async def _train_loop(self, start: float) -> None:
        trainer, config = self.trainer, self.peer.config
        assert trainer is not None and self._source is not None
        source = self._source
        seqs = itertools.count()
        stats = self.peer.stats

        async def worker() -> None:
            while not self.peer.should_stop(trainer.stats.done, start):
                seq = next(seqs)
                if self.peer.opts.max_steps is not None and seq >= self.peer.opts.max_steps:
                    return
                batch = source.train_batch(
                    self.shard, config.data_shards, config.batch_size, config.block_size,
                    config.seed, seq,
                )  # fmt: skip
                try:
                    loss = await trainer.micro_batch(seq, batch)
                except MicroBatchFailed as exc:
                    trainer.stats.failed += 1
                    self.peer.out.event(
                        "micro_batch_failed",
                        f"micro-batch {seq} given up: {exc}",
                        seq=seq,
                        why=str(exc),
                    )
                    continue
                stats.step, stats.loss = trainer.stats.done, loss
                stats.tokens = trainer.stats.tokens

        async def drain_on_stop(scope: trio.CancelScope) -> None:
            while not self.peer.should_stop(trainer.stats.done, start):
                await trio.sleep(0.2)
            await trio.sleep(self.peer.timings.swarm.drain_s)
            scope.cancel()

        async with trio.open_nursery() as workers:
            workers.start_soon(drain_on_stop, workers.cancel_scope)
            async with trio.open_nursery() as pool:
                for _ in range(self.swarm.inflight):
                    pool.start_soon(worker)
            workers.cancel_scope.cancel()
        self.peer.out.event(
            "trainer_done",
            f"trained {trainer.stats.done} micro-batches ({trainer.stats.retries} hops "
            f"retried, {trainer.stats.failed} micro-batches given up, {trainer.stats.audits} "
            f"answers checked, {trainer.stats.caught} liars caught), last loss "
            f"{trainer.stats.loss:.4f}",
            micro_batches=trainer.stats.done,
            retries=trainer.stats.retries,
            failed=trainer.stats.failed,
            audits=trainer.stats.audits,
            unmatched=trainer.stats.unmatched,
            caught=trainer.stats.caught,
            loss=trainer.stats.loss,
        )
        if self._audit is not None:
            done = self._audit / COMPLETED_FILE
            done.write_text("".join(f"{seq}\n" for seq in trainer.stats.completed))
