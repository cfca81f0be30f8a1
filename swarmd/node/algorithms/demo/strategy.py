"""DeMo (Peng, Quesnelle, Kingma 2024) as a swarm strategy: every inner step, each member of a
sticky group sends the fast-moving part of its momentum and applies the sign of everyone's.

The optimisation is `swarmd.optim.demo` (pure torch); the exchange is gather.py.
Per-step DHT matchmaking would take seconds a step, so the group is formed once per period of
`inner_steps` steps (a "round"): at each round boundary the members publish their state (its
hash keys the next matchmaking, so only peers holding the very same parameters meet; joiners
download it), validate, and re-form the group, which lets newcomers in and leaves the dead
out. Within a round, a member late past the step deadline is skipped for that step and dropped
after two; a member whose parameters drifted from the others' (it missed a payload the others
got: its state hash, sent every HASH_EVERY steps, is not the majority's) leaves the group and
takes the group's state at the next boundary (sharedstate.py's catch-up). Every member decodes
and applies the same payloads in the same order (sorted by peer id, its own decoded from its
own bytes), so members that heard the same payloads hold bit-identical parameters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch
import trio

from swarmd.compression import CompressionError
from swarmd.compression.sparse_wire import (
    SparseLayout,
    SparseUpdate,
    decode_sparse,
    encode_sparse,
)
from swarmd.node.algorithms.demo.gather import Gatherer, GatherResult
from swarmd.node.algorithms.loop import (
    choose_shard,
    judge_state,
    matchmaking_config,
    validation_loss,
)
from swarmd.node.averaging.group import Group, Member
from swarmd.node.averaging.matchmaking import (
    form_group,
)
from swarmd.node.averaging.probes import answering
from swarmd.node.bans import Bans, Rejection
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.model import build_model
from swarmd.node.peer.sharedstate import SharedState
from swarmd.node.peer.strategy import HostParts, LocalTarget, Strategy
from swarmd.node.runkeys import is_client, state_round_key
from swarmd.node.runtime import offload
from swarmd.node.statesync.snapshot import StateSnapshot
from swarmd.optim.demo_state import DeMoRun
from swarmd.optim.diloco import trainable
from swarmd.protocol.identity import PeerId
from swarmd.workloads import TokenSource, load_source

log = logging.getLogger("swarmd.demo")

#: Steps between state-hash checks in the exchange (a hash costs a pass over the parameters).
HASH_EVERY = 10


def decode_payloads(
    payloads: Mapping[PeerId, bytes],
    layout: SparseLayout,
    max_bytes: int,
    bans: Bans | None = None,
) -> list[list[SparseUpdate]]:
    """Every payload that decodes against this model's layout, in peer-id order (the order
    every member applies them in). A malformed one (another shape, indices out of range,
    NaN, sizes that do not add up) is refused with a log line naming its sender, who is left
    out of this step; every member decodes the same bytes the same way, so all leave it out
    (a sender that sends different bytes to different members makes their states differ,
    which the state-hash check finds). Bytes that do not decode are evidence: with ``bans``,
    their sender is banned (its later payloads are refused and not waited for)."""
    return [updates for _, updates in decode_senders(payloads, layout, max_bytes, bans)]


def decode_senders(
    payloads: Mapping[PeerId, bytes],
    layout: SparseLayout,
    max_bytes: int,
    bans: Bans | None = None,
) -> list[tuple[PeerId, list[SparseUpdate]]]:
    """`decode_payloads`, each with its sender."""
    out: list[tuple[PeerId, list[SparseUpdate]]] = []
    for sender in sorted(payloads, key=str):
        try:
            out.append((sender, decode_sparse(payloads[sender], layout, max_bytes)))
        except CompressionError as exc:
            log.warning("refused DeMo payload from %s: %s", sender.short(), exc)
            if bans is not None:
                bans.offence(sender, Rejection(f"DeMo payload: {exc}", "undecodable"))
    return out


class DeMoStrategy(Strategy):
    algo = "demo"

    @classmethod
    def host(cls, parts: HostParts) -> Gatherer:
        """The sticky-group all-gather, served by every peer whatever its run's algorithm."""
        return Gatherer(parts.client, parts.peer_id, metrics=parts.metrics, bans=parts.bans)

    def __init__(self, peer: PeerContext) -> None:
        super().__init__(peer)
        self._run: DeMoRun | None = None
        self._source: TokenSource | None = None
        self._state: SharedState | None = None
        self.gatherer = peer.host(self.algo, Gatherer)
        self.me = Member(
            peer.identity.peer_id, peer.address, peer.opts.bandwidth, client=peer.client_mode
        )
        self.shard = 0
        self.origin = "fresh"
        #: The group of this round (None: training alone until the next boundary).
        self.group: Group | None = None
        #: Peers the exchange dropped or a probe found dead, whose heartbeats may still be
        #: live, with when: boundaries do not wait for them (10 s a boundary until the
        #: heartbeat lapsed, seen). Forgotten once they lapse, are seen in a group again, or
        #: answer a probe made `DemoTimings.gone_recheck_s` later.
        self.gone: dict[PeerId, float] = {}
        self._published: StateSnapshot | None = None
        self.started, self.steps = 0.0, 0
        #: Members whose payloads this peer applied in its last step (1: alone, 0: none yet):
        #: a boundary's `outer_step` reports the round that just ended.
        self.last_size = 0
        self.mm = matchmaking_config(peer.config, peer.timings)

    @property
    def run(self) -> DeMoRun:
        assert self._run is not None, "join() first"
        return self._run

    @property
    def state(self) -> SharedState:
        assert self._state is not None, "join() first"
        return self._state

    @property
    def round(self) -> int:
        return self.run.step // self.peer.config.inner_steps

    def _build(self) -> tuple[DeMoRun, TokenSource]:
        config = self.peer.config
        model = build_model(config, self.peer.opts.device, self.peer.opts.init_weights)
        run = DeMoRun(model, config.demo_config(), config.lr_schedule_config())
        return run, load_source(config.data)

    def local_target(self) -> LocalTarget:
        # The ranks average their gradients inside the backward; the DeMo step (momentum,
        # DCT, top-k, the exchange with the swarm) is rank 0's alone, and its result reaches
        # the ranks as parameters before the next step.
        _, params = trainable(self.run.model)
        return LocalTarget(self.run.model, params, self.run, self.shard, None)

    async def join(self) -> None:
        self.shard = choose_shard(self.peer)
        self._run, self._source = await offload.run_sync(self._build)
        self._state = SharedState(self.peer, self.run, self.judge)
        self.origin, _ = await self._state.take_initial()

    # -- the loop ----------------------------------------------------------------------------

    async def train(self, nursery: trio.Nursery) -> int:
        config, run = self.peer.config, self.run
        self.peer.out.event(
            "training",
            f"training {run.numel / 1e6:.2f}M parameters with demo (top {config.demo_topk} "
            f"of each {config.demo_chunk}-wide DCT block as {run.opt.config.value_dtype}, decay "
            f"{config.demo_decay}), group "
            f"re-formed every {config.inner_steps} steps, data shard {self.shard}/"
            f"{config.data_shards} ({self.origin} start)",
            params=run.numel,
            origin=self.origin,
            algo=config.algo,
        )
        first_val = await offload.run_sync(self.validate)
        self.peer.stats.val_loss, self.peer.stats.params = first_val, run.numel
        self.peer.out.event(
            "validation", f"validation loss {first_val:.4f}", round=self.round, val_loss=first_val
        )
        self.started, self.steps = self.peer.net.monotonic(), 0
        while not self._should_stop():
            # Groups re-form at each boundary; a member that left its group mid-round (its
            # state drifted) at once, unless the run lets a peer train alone.
            if self.steps == 0 or run.step % config.inner_steps == 0 or self._must_wait():
                await self._boundary(nursery)
                if self._must_wait():
                    continue  # stopping while waiting for a first group
            await self._step()
            self.steps += 1
        self.gatherer.stop()
        return self.steps

    def _should_stop(self) -> bool:
        return self.peer.should_stop(self.steps, self.started, self.run.step)

    def _must_wait(self) -> bool:
        """No group, and none ever: with the run's min_group_size above one such a peer waits
        for a group rather than stepping alone. Lone states of peers that never met anyone
        can never be reconciled (a peer follows only states of peers it met, or that several
        hold): seen, three peers that started a few seconds apart each trained alone for the
        whole demo. A peer that has been in a group trains alone when none forms (its
        partners left or stalled) and takes the group's state at a later boundary."""
        return self.group is None and self.peer.config.min_group_size > 1 and not self.state.met

    async def _boundary(self, nursery: trio.Nursery) -> None:
        """Publish, validate, then find the group (waiting for a first one: `_must_wait`,
        taking the group's newer state as it appears)."""
        t0 = self.peer.net.monotonic()
        snap = await self._sync_and_publish()
        val = await offload.run_sync(self.validate)
        live = await self._form(nursery, snap, self.mm.gather_s)
        # Others are alive but no group formed (they were still downloading the state this
        # peer kept, or saw another set of peers): come round again, taking the group's
        # newer state as it appears, before stepping alone. Without this, peers whose
        # states had split each took the state they agreed on (15 s to download under a
        # 5 Mbit/s limit), missed the 10 s window of the one that kept it, and all trained
        # alone from then on (benchmarks/convergence.py --algos demo).
        regroup_until = self.peer.net.monotonic() + self.peer.timings.demo.regroup_wait_s
        if self.group is None and live > 1:
            log.info("step %d: no group; looking again", self.run.step)
        while self._must_wait() or (
            self.group is None and live > 1 and self.peer.net.monotonic() < regroup_until
        ):
            if self._should_stop():
                return
            snap = await self._sync_and_publish()
            live = await self._form(nursery, snap, self.peer.timings.demo.retry_gather_s)
        size = len(self.group.members) if self.group else 1
        status = "averaged" if self.last_size > 1 else "alone" if self.last_size else "start"
        waited = self.peer.net.monotonic() - t0
        self.peer.clock.wait_s += waited
        self.peer.stats.outer_done(self.round, size, status, val)
        self.peer.out.event(
            "outer_step",
            f"round {self.round}: {status} with {max(self.last_size, 1)} peer(s), now a group "
            f"of {size} at step {self.run.step}, validation loss {val:.4f}, state "
            f"{snap.state_hash.hex()[:12]}, {waited:.1f}s",
            round=self.round,
            status=status,
            group_size=max(self.last_size, 1),
            next_group_size=size,
            live_peers=live,
            dropped=0,
            val_loss=val,
            state_hash=snap.state_hash.hex(),
            wait_s=round(waited, 3),
            seconds=round(self.peer.clock.held(t0), 3),
        )

    async def _sync_and_publish(self) -> StateSnapshot:
        """This peer's state published (once per step), then the group's instead if this
        one is not it. Publishing first matters: the catch-up compares the group's adverts
        with the hash this peer last published, and DeMo's parameters move every step; with
        the previous boundary's hash, peers holding the very state the others advertised
        downloaded it again (10 s at 5 Mbit/s), and the group split while they did."""
        if self._published is None or self._published.round != self.run.step:
            self._published = await self.state.publish(self.run.step)
        if await self.state.catch_up():
            log.info("took the group's state at step %d", self.run.step)
            self._published = await self.state.publish(self.run.step)
        return self._published

    async def _form(self, nursery: trio.Nursery, snap: StateSnapshot, gather_s: float) -> int:
        """Matchmaking for this step and state; starts the exchange with the group found.
        Returns the live peer count it waited for."""
        await self._find_gone()
        live, target = await self.peer.live.group_target(self.gone)
        if not self.state.met:
            # A run's first group: peers that start together may not see each other's
            # heartbeats yet, and groups formed from who was visible then never meet again
            # (their states differ, and a peer follows only states of peers it met): seen, 4
            # peers split 2+2 at step 0 for a whole run. Wait the gather window for the run's
            # target instead, once.
            target = self.peer.config.target_group_size
        key = state_round_key(self.peer.config.name, self.run.step, snap.state_hash)
        mm = dataclasses.replace(self.mm, target_group_size=target, gather_s=gather_s)
        gathered = self.peer.live.gathering()
        group = await form_group(self.peer.dht, key, self.me, mm, gathered)
        self.peer.live.came(key, gathered)
        self.group = group if group is not None and len(group.members) > 1 else None
        if self.group is not None:
            for m in self.group.members:
                self.gone.pop(m.peer_id, None)
            self.gatherer.start(self.group, self.run.step, nursery)
        else:
            self.gatherer.stop()
        return live

    async def _find_gone(self) -> None:
        """Live heartbeats of peers that do not answer (killed: a heartbeat outlives its
        peer by up to 30 s) are not waited for: without this each boundary in those 30 s sat
        out matchmaking's whole 10 s gather window. Members of this round's group answered
        every step and are not probed; peers taken for gone are probed again after
        `DemoTimings.gone_recheck_s`."""
        live = await self.peer.live.addresses()
        now = self.peer.net.monotonic()
        self.gone = {p: at for p, at in self.gone.items() if p in live}
        known = {m.peer_id for m in self.group.members} if self.group else set()
        recheck = self.peer.timings.demo.gone_recheck_s
        known |= {p for p, at in self.gone.items() if now - at < recheck}
        known.add(self.me.peer_id)
        # A client-mode peer cannot be probed (nobody can dial it): its live heartbeat is
        # the evidence, and a dead one costs a group one step's deadline.
        others = [Member(p, a) for p, a in live.items() if p not in known and not is_client(a)]
        if not others:
            return
        alive = await answering(self.peer.dht, others, self.peer.timings.demo.probe_s)
        for m in others:
            if m.peer_id in alive:
                if self.gone.pop(m.peer_id, None) is not None:
                    log.info("peer %s answers again; waiting for it in groups", m.peer_id)
            else:
                if m.peer_id not in self.gone:
                    log.info("peer %s does not answer; not waiting for it", m.peer_id)
                self.gone[m.peer_id] = now

    async def _step(self) -> None:
        config, run = self.peer.config, self.run
        batch = self.source.train_batch(
            self.shard,
            config.data_shards,
            config.batch_size,
            config.block_size,
            config.seed,
            self.peer.batch_index(run.step),
        )
        loss = await offload.run_sync(run.gradients, batch)
        mine = await offload.run_sync(run.prepare)
        senders: list[PeerId] = []
        if self.group is None:
            gathered, shared = [mine], False
        else:
            senders, gathered, shared = await self._exchange(mine)
        left_out = await offload.run_sync(run.apply, gathered)
        if left_out and shared:
            log.info(
                "step %d: left out of the mean, opposed to the others: %s",
                run.step,
                ", ".join(senders[j].short() for j in left_out),
            )
        if shared:  # the step every member that heard the same payloads took alike
            self.state.averaged("averaged", len(gathered), 0)
        self.last_size = len(gathered) if shared else 1
        stats = self.peer.stats
        stats.step, stats.loss = run.step, loss
        stats.tokens += config.batch_size * config.block_size * run.forward.world

    async def _exchange(
        self, mine: list[SparseUpdate]
    ) -> tuple[list[PeerId], list[list[SparseUpdate]], bool]:
        """This step's updates of every member heard, in peer-id order, each decoded from
        the bytes that travelled (this peer's own too: the others see its rounding), their
        senders, and whether the step was shared with others."""
        run = self.run
        payload = await offload.run_sync(encode_sparse, mine, run.opt.config.value_dtype)
        check = run.step % HASH_EVERY == 0
        state_hash = await offload.run_sync(run.param_hash) if check else b""
        t0 = self.peer.net.monotonic()
        result = await self.gatherer.gather(payload, state_hash)
        self.peer.clock.wait_s += self.peer.net.monotonic() - t0
        self.gone.update(dict.fromkeys(result.dropped, self.peer.net.monotonic()))
        decoded = await offload.run_sync(self._decode_all, result)
        senders, gathered = [p for p, _ in decoded], [u for _, u in decoded]
        if result.agree(self.peer.identity.peer_id) is False:
            log.warning(
                "step %d: this peer's parameters differ from the group's; leaving the group "
                "to take its state at the next boundary",
                run.step,
            )
            self.group = None
            self.gatherer.stop()
            return senders, gathered, False
        self.state.meet(result.payloads)
        return senders, gathered, len(gathered) > 1

    def _decode_all(self, result: GatherResult) -> list[tuple[PeerId, list[SparseUpdate]]]:
        limit = self.gatherer.config.max_payload_bytes
        return decode_senders(result.payloads, self.run.opt.layout(), limit, self.gatherer.bans)

    # -- validation and judging offered states -------------------------------------------------

    @property
    def source(self) -> TokenSource:
        assert self._source is not None, "join() first"
        return self._source

    def validate(self) -> float:
        return validation_loss(self.run.model, self.source, self.peer.config)

    def judge(self, state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        run, config = self.run, self.peer.config
        return judge_state(run.model, run.names, self.source, config, state, run.state_dict())
