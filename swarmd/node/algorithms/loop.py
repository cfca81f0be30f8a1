"""What DiLoCo and streaming DiLoCo share: local inner steps, an outer step that averages
pseudo-gradients in a group of peers holding the same state, and the shared state joiners take.

`OuterLoopStrategy` is the base of both strategies. It builds the model and the optimiser,
takes the state to start from (sharedstate.py), runs inner steps on this peer's data shard,
validates, and provides the one averaging step both outer loops use: find the group for a key
(matchmaking through the DHT), then all-reduce with it. When and how often that happens, and
what is done with the result, is each subclass's loop (diloco.py, streaming.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import trio

from swarmd.compression.lowrank import PowerSGD, PowerSGDConfig
from swarmd.node.averaging.allreduce import AllReduceResult, Member
from swarmd.node.averaging.gridround import GridConfig, on_roster, roll_call, roll_verdict
from swarmd.node.averaging.lowrank import allreduce_lowrank
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.model import build_model
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.peer.sharedstate import SharedState
from swarmd.node.peer.strategy import LocalTarget, Strategy
from swarmd.node.runkeys import state_round_key
from swarmd.node.runtime import offload
from swarmd.node.timing import TimingProfile
from swarmd.optim.diloco import DiLoCo, trainable
from swarmd.optim.statedicts import GLOBAL_PREFIX
from swarmd.optim.streaming import StreamingDiLoCo
from swarmd.protocol import faults
from swarmd.protocol.identity import PeerId
from swarmd.workloads import TokenSource, evaluate, load_source, shard_for_peer

#: Validation batches per evaluation: enough to compare peers, cheap enough for every round.
VALIDATION_BATCHES = 4
#: zstd level when the run asks for zstd frames: level 3 runs at ~300 MB/s per core and
#: higher levels gained nothing measurable on int8 codes (level 19: same ratio, 70x slower).
ZSTD_LEVEL = 3

Opt = TypeVar("Opt", DiLoCo, StreamingDiLoCo)

log = logging.getLogger(__name__)


def matchmaking_config(config: RunConfig, timings: TimingProfile) -> MatchmakingConfig:
    """How a run's peers form groups (every strategy that matchmakes through the DHT): the
    profile's timings, the run's group sizes."""
    return dataclasses.replace(
        timings.matchmaking,
        target_group_size=config.target_group_size,
        min_group_size=config.min_group_size,
    )


def choose_shard(peer: PeerContext) -> int:
    """The data shard this peer reads: --data-shard, else the one its peer id hashes to."""
    config, shard = peer.config, peer.opts.data_shard
    if shard is None:
        return shard_for_peer(peer.identity.peer_id.raw, config.data_shards)
    if shard >= config.data_shards:
        raise JoinError(
            f"--data-shard {shard}: run {config.name!r} cuts its data into "
            f"{config.data_shards} shards (0 to {config.data_shards - 1})"
        )
    return shard


def validation_loss(
    model: torch.nn.Module,
    source: TokenSource,
    config: RunConfig,
    params: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """The model's loss on the run's first VALIDATION_BATCHES validation batches (with
    ``params`` in place of its own, if given): the same batches on every peer."""
    batches = source.validation_batches(
        config.batch_size, config.block_size, max_batches=VALIDATION_BATCHES
    )
    return evaluate(model, batches, params)


def judge_state(
    model: torch.nn.Module,
    names: list[str],
    source: TokenSource,
    config: RunConfig,
    offered: Mapping[str, torch.Tensor],
    ours: Mapping[str, torch.Tensor],
) -> tuple[float, float]:
    """The loss of an offered state's global parameters and of this peer's own, on the same
    validation batches (statesync/vet.py decides what is too much worse)."""
    return tuple(  # type: ignore[return-value]
        validation_loss(model, source, config, {n: s[GLOBAL_PREFIX + n] for n in names})
        for s in (offered, ours)
    )


@dataclass
class Averaging:
    """What one matchmaking + all-reduce gave: no group, a group of one, or a real average."""

    #: A group was formed (of one peer, if nobody else came and the run allows it).
    formed: bool = False
    #: The peer was told to stop while it waited for a group: it leaves without this round.
    left: bool = False
    group_size: int = 1
    dropped: int = 0
    result: AllReduceResult | None = None
    #: A grid round (`average_grid`): the mean of every contribution that made the round.
    mean: torch.Tensor | None = None
    #: A grid round this peer had no part in (its roster did not name it, or its group
    #: closed before it came): it takes the round's state, that of ``publishers``.
    sat_out: bool = False
    publishers: frozenset[PeerId] = frozenset()


class OuterLoopStrategy(Strategy, Generic[Opt]):
    """Inner steps on local data; outer steps that average with a group (the DiLoCo family)."""

    def __init__(self, peer: PeerContext) -> None:
        super().__init__(peer)
        self._opt: Opt | None = None
        self._source: TokenSource | None = None
        self._state: SharedState | None = None
        self.origin = "fresh"
        #: The inner step to resume the data order at (a resumed peer does not redraw batches).
        self.first_step = 0
        self.shard = 0
        self.me = Member(
            peer.identity.peer_id, peer.address, peer.opts.bandwidth, client=peer.client_mode
        )
        config = peer.config
        self.mm = matchmaking_config(config, peer.timings)
        #: codec lowrank's state: warm-started Q and error feedback per tensor.
        self.powersgd = PowerSGD(PowerSGDConfig(rank=config.lowrank_rank, seed=config.seed))
        #: A copy of the model that validations run on (in their own thread, while the
        #: trainer goes on), one at a time; made at the first.
        self._twin: torch.nn.Module | None = None
        self._validating = trio.CapacityLimiter(1)
        self._reports_pending = 0
        self._reports_done = trio.Event()
        #: Whether this peer has said why it sits rounds out (once a run is enough).
        self._told_late = False
        #: A chaos plan's slower GPU (`step_delay_s`), if the process runs under one.
        self._faults = faults.from_env()

    # -- what the subclasses supply --------------------------------------------------------

    @abstractmethod
    def make_optimizer(self, model: torch.nn.Module) -> Opt:
        """The algorithm's optimiser around `model` (raise JoinError for a config it can't
        use)."""

    def describe(self) -> str:
        """The algorithm's settings for the `training` line, after H (empty: none)."""
        return ""

    # -- the parts every outer loop uses ---------------------------------------------------

    @property
    def opt(self) -> Opt:
        assert self._opt is not None, "join() first"
        return self._opt

    @property
    def source(self) -> TokenSource:
        assert self._source is not None, "join() first"
        return self._source

    @property
    def state(self) -> SharedState:
        assert self._state is not None, "join() first"
        return self._state

    @property
    def round(self) -> int:
        return self.opt.round

    def _build(self) -> tuple[Opt, TokenSource]:
        opts = self.peer.opts
        model = build_model(self.peer.config, opts.device, opts.init_weights)
        return self.make_optimizer(model), load_source(self.peer.config.data)

    async def join(self) -> None:
        self.shard = choose_shard(self.peer)
        opt, self._source = await offload.run_sync(self._build)
        self._opt, self._state = opt, SharedState(self.peer, opt, self.judge)
        self.origin, self.first_step = await self._state.take_initial()
        config, averager = self.peer.config, self.peer.averager
        # The run decides how its parts look on the wire (receivers read it from each header).
        averager.set_config(dataclasses.replace(
            averager.config,
            int8_block_size=config.int8_block_size,
            int8_bits=config.int8_bits,
            topk_density=float(config.topk_density),
            topk_bits=config.topk_bits,
            zstd_level=ZSTD_LEVEL if config.zstd else None,
        ))  # fmt: skip

    async def _begin(self) -> float:
        """Says what it trains, publishes the starting state (its hash keys the first round)
        and validates it; returns the loop's start time."""
        config, opt = self.peer.config, self.opt
        detail = {
            "int8": f" (block {config.int8_block_size}, {config.int8_bits} bits)",
            "topk": f" (density {config.topk_density:.4g}, {config.topk_bits} bits)",
            "lowrank": f" (rank {config.lowrank_rank})",
        }.get(config.codec, "")
        self.peer.out.event(
            "training",
            f"training {opt.numel / 1e6:.2f}M parameters with {config.algo}, "
            f"H={config.inner_steps}{self.describe()}, codec {config.codec}"
            f"{detail}"
            f"{' + zstd' if config.zstd else ''}, data shard "
            f"{self.shard}/{config.data_shards} ({self.origin} start)",
            params=opt.numel,
            origin=self.origin,
            algo=config.algo,
        )
        await self.state.publish(self.first_step)
        start = self.peer.net.monotonic()
        first_val = await offload.run_sync(self.validate)
        self.peer.stats.val_loss, self.peer.stats.params = first_val, opt.numel
        self.peer.out.event(
            "validation", f"validation loss {first_val:.4f}", round=opt.round, val_loss=first_val
        )
        return start

    async def inner_step(self, step: int) -> None:
        config = self.peer.config
        batch = self.source.train_batch(
            self.shard,
            config.data_shards,
            config.batch_size,
            config.block_size,
            config.seed,
            self.peer.batch_index(step),
        )
        loss = await offload.run_sync(self.opt.inner_step, batch)
        if self._faults is not None and (delay := self._faults.plan().step_delay_s):
            await trio.sleep(delay)
        await self.peer.net.inner_step()
        stats = self.peer.stats
        stats.step, stats.loss = step + 1, loss
        stats.tokens += config.batch_size * config.block_size * self.opt.forward.world

    def validate(self) -> float:
        return validation_loss(self.opt.model, self.source, self.peer.config)

    def params_now(self) -> dict[str, torch.Tensor]:
        """Copies of the model's parameters by name, to validate later (`validate_params`)."""
        with torch.no_grad():
            return {n: p.detach().clone() for n, p in self.opt.model.named_parameters()}

    def global_params(self) -> dict[str, torch.Tensor]:
        """Copies of the global parameters by name: the state, where the model holds this
        peer's own local parameters (the same after an applied round, not after a carried
        one: validated on the local ones, 12 peers on one carried state reported losses
        2.82-2.99, and a run ending on it 18% apart)."""
        state = self.opt.state_dict()
        return {n: state[GLOBAL_PREFIX + n] for n in self.opt.names}

    async def validate_params(self, params: dict[str, torch.Tensor]) -> float:
        """The validation loss of `params` on a twin of the model, in a worker thread: the
        trainer's own thread keeps training meanwhile (validation cost a DiLoCo round of the
        default model 3.5% of its time when it held the trainer: benchmarks/inner_loop.py)."""

        def run() -> float:
            if self._twin is None:
                self._twin = copy.deepcopy(self.opt.model)
            return validation_loss(self._twin, self.source, self.peer.config, params)

        return await offload.run_sync(run, limiter=self._validating)

    def report_later(self) -> None:
        """Counts a report task about to start in the background (see `reports_drained`)."""
        if self._reports_pending == 0:
            self._reports_done = trio.Event()
        self._reports_pending += 1

    def report_done(self) -> None:
        self._reports_pending -= 1
        if self._reports_pending == 0:
            self._reports_done.set()

    async def reports_drained(self) -> None:
        """Waits for the reports still validating (so the last round is reported before the
        peer says it stopped)."""
        if self._reports_pending:
            await self._reports_done.wait()

    def local_target(self) -> LocalTarget:
        opt = self.opt
        _, params = trainable(opt.model)
        return LocalTarget(opt.model, params, opt, self.shard, opt.local_state_dict())

    def judge(self, state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        names, _ = trainable(self.opt.model)
        config = self.peer.config
        return judge_state(self.opt.model, names, self.source, config, state, self.opt.state_dict())

    def round_key(self, round_no: int, fragment: int = 0) -> str:
        """The matchmaking key of a round: per round (and fragment), and only among peers
        holding the very same global state (all fragments). A peer that drifted (a missed
        round) can never blend its different parameters into the group's: it catches up by
        state sync instead."""
        assert self.state.last_hash is not None, "the starting state is published first"
        return state_round_key(self.peer.config.name, round_no, self.state.last_hash, fragment)

    async def average(
        self,
        key: str,
        vector: torch.Tensor,
        weight: float,
        *,
        target: int,
        ef_key: str,
        poll_s: float | None = None,
        layout: tuple[list[str], list[torch.Size]] | None = None,
    ) -> Averaging:
        """Matchmaking for `key` (waiting for `target` peers), then the all-reduce of `vector`
        with the group; `ef_key` names the error-feedback residual the codec keeps. `layout`:
        the names and shapes `vector` flattens (codec lowrank factors each 2-D one; default
        the whole model's trainable parameters; a streaming fragment passes its own)."""
        mm = dataclasses.replace(self.mm, target_group_size=target)
        if poll_s is not None:
            mm = dataclasses.replace(mm, poll_s=poll_s)
        gathered = self.peer.live.gathering()
        group = await self.peer.unless_stopping(
            lambda: form_group(self.peer.dht, key, self.me, mm, gathered)
        )
        if group is None and self.peer.stopping.is_set():
            return Averaging(left=True)
        self.peer.live.came(key, gathered)
        out = Averaging(formed=group is not None)
        if group is not None and len(group.members) > 1:
            out.group_size = len(group.members)
            if self.peer.config.codec == "lowrank":
                if layout is None:
                    names, params = trainable(self.opt.model)
                    layout = (names, [p.shape for p in params])
                out.result = await allreduce_lowrank(
                    self.peer.averager, group, vector, weight, self.powersgd, *layout
                )
            else:
                out.result = await self.peer.averager.allreduce(
                    group,
                    vector,
                    weight,
                    key=ef_key,
                    codec=self.peer.config.codec,  # type: ignore[arg-type]
                )
            out.dropped = len(out.result.dropped)
            self.state.meet(m.peer_id for m in group.members if m.peer_id not in out.result.dropped)
        return out

    def on_grid(self, live: int) -> bool:
        """Whether a round with ``live`` peers averages on the grid: more peers than a group
        holds (codec lowrank's two passes are not gridded: flat)."""
        c = self.peer.config
        grid = c.grouping == "grid" and c.codec != "lowrank" and c.target_group_size >= 2
        return grid and live > c.target_group_size

    async def average_grid(
        self, key: str, vector: torch.Tensor, weight: float, ef_key: str = "grid"
    ) -> Averaging:
        """The round under ``key`` on the grid (grid.py) of a roster every member agrees on,
        once `group_target(fresh=True)` counted the live peers: a roll call first (one
        gathering of every live peer, no tensor, whose leader commits the member list:
        matchmaking.py), then the grid planned from that list, each level's group built
        from the list's members with no gathering, so every member plans the same groups and
        ends with the same mean.

        Planned from each peer's own read of the heartbeats, rosters differed whenever a
        heartbeat appeared or lapsed between two peers' reads, and the round forked (6 peers
        in groups of 2, 150 steps: 1.27 states a round, 5.9x one group's wall time, and a
        3-peer run stalled 2 times in 3); with the roster agreed but each level's groups
        gathered by matchmaking, an upper group closed at its window before a late member
        and results under one roster differed (7.2x one group's wall time). The roll call
        reads every announcement under one key, as one flat group of all does: O(N^2)
        records a round over the run. ``ef_key`` names the vector's error-feedback residual
        (see `average`)."""
        # The live peers the round's group_target just read afresh (no second read).
        gathered = self.peer.live.gathering()
        expected = self.peer.live.expected()
        roll = await self.peer.unless_stopping(
            lambda: roll_call(self.peer.dht, key, self.me, self.mm, expected, gathered)
        )
        if roll is None and self.peer.stopping.is_set():
            return Averaging(left=True)
        self.peer.live.came(key, gathered)
        # The roll's peers held this peer's state (its hash is in the key): their adverts
        # count in its catch-up. Meeting only grid partners, a peer whose partners had all
        # left (the creator, killed) and that missed the next roll never knew the others'
        # adverts and stepped alone for the rest of the run (a CI rehearsal: 17 rounds).
        self.state.meet(gathered.announced)
        verdict = roll_verdict(roll, gathered, self.me.peer_id)
        if verdict == "sit_out":
            self._tell_late(key)
            return Averaging(formed=True, sat_out=True, publishers=gathered.committed)
        if verdict == "alone" or roll is None:
            return Averaging(formed=roll is not None)
        config = self.peer.config
        cfg = GridConfig(config.target_group_size, config.codec, ef_key)  # type: ignore[arg-type]
        grid, peer = on_roster(roll, key, self.peer.averager, self.me, cfg)
        got = await self.peer.unless_stopping(lambda: peer.average(grid, key, vector, weight))
        if got is None:
            return Averaging(left=True)
        self.state.meet(got.met)
        if got.result is None:
            roster = frozenset(m.peer_id for m in roll.members) - {self.me.peer_id}
            return Averaging(formed=True, sat_out=True, publishers=roster)
        # Its size: the peers it averaged with at any level, itself included.
        return Averaging(
            formed=True, group_size=len(got.met) + 1, dropped=got.dropped, mean=got.result
        )

    def _tell_late(self, key: str) -> None:
        """Once a run: this peer came after a roll call had closed, so its round's inner
        steps are dropped. A peer slower than the rest does so every round unless the run
        bounds rounds in time; its user should know why it contributes nothing, and whom to
        ask."""
        if self._told_late:
            return
        self._told_late = True
        hint = (
            "; a peer slower than the others sits every round out unless the run sets "
            "inner_seconds (ask the run's creator)"
            if not self.peer.config.inner_seconds
            else ""
        )
        log.warning(
            "%s: came after the round's roll call closed; its steps are dropped%s", key, hint
        )

    async def took_group_state(self, step: int, t0: float, **fields: object) -> None:
        """After a catch-up: publishes the group's state as this peer's and says so."""
        waited = self.peer.net.monotonic() - t0
        self.peer.clock.wait_s += waited
        snap = await self.state.publish(step)
        opt = self.opt
        self.peer.out.event(
            "outer_step",
            f"round {opt.round}: took the group's state, {snap.state_hash.hex()[:12]}",
            round=opt.round,
            **fields,
            status="synced",
            group_size=0,
            dropped=0,
            val_loss=await offload.run_sync(self.validate),
            state_hash=snap.state_hash.hex(),
            wait_s=round(waited, 3),
            seconds=round(self.peer.clock.held(t0), 3),
        )
