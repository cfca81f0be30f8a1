"""`swarmd join`: one peer of a DiLoCo run, from identity to graceful leave.

The daemon is one trio run. Its gRPC server carries every service (peer, DHT, all-reduce, state
donor); background tasks (DHT upkeep, heartbeat, progress) live in one nursery; the torch work
runs in a worker thread so the event loop keeps serving other peers while it trains.

Lifecycle: join the DHT through --peers; read the run's signed config from the DHT (or publish
it with --create-run); start from the group's newest state if anyone advertises one, else from
this peer's own saved state, else from the run's seeded initial weights (identical on every
peer); then train: H inner steps, matchmaking, all-reduce of the pseudo-gradient, outer step,
publish and save the new state. SIGINT/SIGTERM stop at the next step boundary, save, and leave
(the heartbeat lapses; groups drop us by their deadlines).

With `algo = "streaming-diloco"` the outer step is per fragment, every H/P steps, and its
matchmaking + all-reduce run in the background from τ steps before it (`_train_streaming`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from swarmd.node.averaging.allreduce import AllReduceConfig, AllReduceResult, Averager, Member
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group, round_key
from swarmd.node.dht import BootstrapError, DHTNode, KeyReader
from swarmd.node.metrics import Metrics, MetricsServer
from swarmd.node.runtime.errors import innermost
from swarmd.node.runtime.heap import settle_heap
from swarmd.node.server.advertise import advertised_address
from swarmd.node.server.peer import Scratch, announce, peer_service
from swarmd.node.statesync.catchup import state_to_take
from swarmd.node.statesync.donor import StateAdvert, StateDonor, advert_key, choose_donors
from swarmd.node.statesync.download import StateSyncError, download_state
from swarmd.node.statesync.snapshot import StateSnapshot
from swarmd.node.training.runconfig import (
    CONFIG_TTL_S,
    RunConfig,
    RunConfigError,
    config_key,
    peers_key,
)
from swarmd.optim.diloco import DiLoCo
from swarmd.optim.streaming import FragmentRound, StreamingDiLoCo, state_age
from swarmd.protocol import rpc
from swarmd.protocol.address import Address
from swarmd.protocol.identity import Identity
from swarmd.workloads import (
    GPT,
    GPTConfig,
    ModelLoadError,
    TokenSource,
    evaluate,
    load_model,
    load_source,
    resolve_device,
    shard_for_peer,
)

log = logging.getLogger("swarmd.daemon")

#: The run's optimiser (RunConfig.algo): both keep the global state joiners download.
Optimizer = DiLoCo | StreamingDiLoCo

STATE_FILE = "state.pt"
NUM_SHARDS = 64
VALIDATION_BATCHES = 4
#: zstd level when the run asks for zstd frames: level 3 runs at ~300 MB/s per core and
#: higher levels gained nothing measurable on int8 codes (level 19: same ratio, 70x slower).
ZSTD_LEVEL = 3
#: How stale the count of live peers may be once it reaches the run's target group size.
LIVE_PEERS_MAX_AGE_S = 10.0
#: First DHT poll of an overlapped fragment round's matchmaking: training goes on meanwhile,
#: so a later group costs nothing, and fewer reads keep the round's bytes down.
OVERLAPPED_POLL_S = 0.5
#: How long a peer whose last round was its own waits for the other live peers' adverts of
#: that round before it decides whose state to follow (see _catch_up), and how often it looks.
LONE_WAIT_S = 10.0
LONE_POLL_S = 0.2


class JoinError(Exception):
    """Joining failed in a way the user must fix; the message says how."""


@dataclass(frozen=True)
class JoinOptions:
    run: str
    state_dir: Path
    listen: Address = field(default_factory=lambda: Address("127.0.0.1", 0))
    peers: tuple[str, ...] = ()
    metrics: Address | None = None
    create_run: RunConfig | None = None
    #: Stop after this many inner steps or seconds (None: run until signalled).
    max_steps: int | None = None
    duration_s: float | None = None
    log_format: str = "text"
    progress_interval_s: float = 5.0
    join_timeout_s: float = 60.0
    #: Advertised bandwidth (bytes/s) for part sizing; the all-reduce measures the real one.
    bandwidth: float = 1e8
    #: Refuse to join a run whose config names another algorithm (None: any).
    algo: str | None = None
    #: The training shard to read (None: the one the peer id hashes to). For experiments
    #: that must compare methods on the same data; peers sharing a shard draw the same
    #: batches, so a swarm should leave this unset.
    data_shard: int | None = None
    #: The bulk data plane's port (0: the OS picks; None: tensors go over gRPC only).
    bulk_port: int | None = 0
    #: Where the model trains (swarmd/workloads/device.py): a peer's own choice.
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.data_shard is not None and not 0 <= self.data_shard < NUM_SHARDS:
            raise ValueError(f"data_shard must be in [0, {NUM_SHARDS}), got {self.data_shard}")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be in [0, 65535], got {self.bulk_port}")
        resolve_device(self.device)  # a missing GPU is a usage error, said before joining


class Progress:
    """Terminal or JSON-lines output of what the peer is doing."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    def event(self, kind: str, text: str, **fields: Any) -> None:
        if self.fmt == "json":
            print(json.dumps({"event": kind, "time": round(time.time(), 3), **fields}), flush=True)
        else:
            print(f"[swarmd] {text}", file=sys.stderr, flush=True)


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a crash leaves the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_saved(path: Path, config_hash: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        state: dict[str, Any] = torch.load(path, weights_only=True)
    except Exception as exc:  # a torn or foreign file must not stop the peer: start over
        log.warning("ignoring unreadable saved state %s: %s", path, exc)
        return None
    if state.get("config_hash") != config_hash:
        log.warning("saved state %s belongs to another run config; ignoring it", path)
        return None
    return state


@dataclass
class _Flight:
    """One streaming fragment round on the wire: matchmaking + all-reduce in the background."""

    round: FragmentRound
    #: Wall-clock times (for logs that compare peers) and the trainer's step count.
    started: float = field(default_factory=time.time)
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


class Peer:
    """The training peer; `run()` is the whole lifecycle."""

    def __init__(self, options: JoinOptions) -> None:
        self.opts = options
        self.out = Progress(options.log_format)
        self.identity = Identity.load_or_create(options.state_dir)
        self.metrics = Metrics()
        self.transport = rpc.TransportConfig(
            max_concurrent_rpcs=32,
            bulk=options.bulk_port is not None,
            bulk_port=options.bulk_port or 0,
        )
        self.client = rpc.RpcClient(self.identity, self.transport, self.metrics)
        self.dht = DHTNode(self.identity, self.client)
        self.averager = Averager(
            self.client, self.identity.peer_id, AllReduceConfig(), self.metrics
        )
        self.donor = StateDonor()
        self.address = ""
        self.stats: dict[str, Any] = {"step": 0, "round": 0, "loss": math.nan, "peers": 1}
        #: Set with stop_requested: a trainer waiting for a streaming round stops waiting.
        self.stopping = trio.Event()

    async def run(self) -> None:
        opts = self.opts
        metrics_server = (
            MetricsServer(self.metrics, opts.metrics.host, opts.metrics.port)
            if opts.metrics
            else None
        )
        services = [
            peer_service(self.identity, Scratch(1 << 20)),
            self.dht.service(),
            self.averager.service(),
            self.donor.service(),
        ]
        try:
            async with (
                rpc.serve(
                    services,
                    opts.listen.host,
                    opts.listen.port,
                    config=self.transport,
                    observer=self.metrics,
                ) as server,
                trio.open_nursery() as nursery,
            ):
                address = await trio.to_thread.run_sync(
                    advertised_address, server.address, opts.peers
                )
                self.address = str(address)
                announce(
                    "listening",
                    address=self.address,
                    peer_id=str(self.identity.peer_id),
                    metrics_port=metrics_server.port if metrics_server else None,
                )
                nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
                await nursery.start(self.dht.run, server.address.port, list(opts.peers))
                config = await self._run_config()
                await self._train(config, nursery)
                nursery.cancel_scope.cancel()
        finally:
            if metrics_server:
                metrics_server.close()
            self.client.close()

    async def _stop_on_signal(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.out.event("leaving", f"{signal.Signals(signum).name}: leaving the run")
                self.stop_requested = True
                self.stopping.set()
                return

    stop_requested = False
    #: Hash of the global state this peer last published (None before its first round).
    last_hash: bytes | None = None
    #: The state's age (`Optimizer.age`: the round; the turn in streaming DiLoCo) when this
    #: peer's state was last also others' (averaged in a group, or downloaded); what it did
    #: after that it did alone and does not compare with the group's.
    shared_round = 0
    #: Seconds the trainer waited for the network (matchmaking, all-reduce, state sync): with
    #: the run's wall time it gives compute utilisation, 1 - wait / wall.
    wait_s = 0.0
    #: Seconds the trainer spent outside inner steps for outer steps (waiting included).
    held_s = 0.0
    #: (monotonic time, count) of the last read of the run's heartbeats; see _live_peers.
    _live: tuple[float, int] = (-math.inf, 0)
    _heartbeats: KeyReader | None = None

    async def _live_peers(self, config: RunConfig) -> int:
        """How many peers' heartbeats the run has: the group size a round waits for.

        Read before every round while it is below the run's target group size (a joiner must
        be waited for at once), but at most every LIVE_PEERS_MAX_AGE_S once it reaches it:
        more peers cannot raise the target then, and a departure shows within the heartbeat's
        30 s anyway. Each read is a few KB (every heartbeat record, from three nodes), paid
        in every streaming fragment round's peak otherwise.
        """
        at, count = self._live
        fresh = time.monotonic() - at < LIVE_PEERS_MAX_AGE_S
        if not (fresh and count >= config.target_group_size):
            if self._heartbeats is None:
                # Re-reads transfer only heartbeats (refreshes, withdrawals) not read before.
                self._heartbeats = self.dht.reader(peers_key(config.name))
            count = len(await self._heartbeats.peers())
            self._live = (time.monotonic(), count)
        return count

    async def _run_config(self) -> RunConfig:
        opts = self.opts
        if opts.create_run is not None:
            config = opts.create_run
            await self.dht.store(
                config_key(config.name), config.to_json(), self.dht.now() + CONFIG_TTL_S
            )
            self.out.event(
                "run_created",
                f"created run {config.name!r} (config {config.hash})",
                run=config.name,
                config_hash=config.hash,
            )
            return config
        with trio.move_on_after(opts.join_timeout_s):
            while True:
                value = await self.dht.get_value(config_key(opts.run))
                if value is not None:
                    try:
                        config = RunConfig.from_json(value.value)
                    except RunConfigError as exc:
                        raise JoinError(str(exc)) from None
                    if config.name != opts.run:
                        raise JoinError(
                            f"the DHT holds a config for {config.name!r}, not {opts.run!r}"
                        )
                    if opts.algo is not None and config.algo != opts.algo:
                        raise JoinError(
                            f"run {config.name!r} trains with {config.algo}, not {opts.algo}; "
                            "--algo only chooses the algorithm of a run made with --create-run"
                        )
                    self.out.event(
                        "run_joined",
                        f"joined run {config.name!r} (config {config.hash}, created by "
                        f"{value.owner.short()})",
                        run=config.name,
                        config_hash=config.hash,
                    )
                    return config
                await trio.sleep(1.0)
        raise JoinError(
            f"no run named {opts.run!r} was found in the DHT within {opts.join_timeout_s:.0f}s; "
            "check --run, or create it with --create-run FILE"
        )

    # -- training ---------------------------------------------------------------------------

    def _build(self, config: RunConfig) -> tuple[Optimizer, TokenSource]:
        torch.manual_seed(config.seed)  # a user model's init is then the same on every peer
        model: torch.nn.Module
        if config.model == "builtin":
            model = GPT(
                GPTConfig(
                    n_layer=config.n_layer,
                    n_head=config.n_head,
                    n_embd=config.n_embd,
                    block_size=config.block_size,
                ),
                seed=config.seed,
            )
        else:
            try:
                model = load_model(config.model)
            except ModelLoadError as exc:
                raise JoinError(str(exc)) from None
        model.to(resolve_device(self.opts.device))
        opt: Optimizer
        if config.algo == "streaming-diloco":
            try:
                opt = StreamingDiLoCo(model, config.streaming_config())
            except ValueError as exc:  # e.g. fewer layers than fragments
                raise JoinError(f"streaming-diloco: {exc}") from None
        else:
            opt = DiLoCo(model, config.diloco_config())
        return opt, load_source(config.data)

    async def _adverts(self, config: RunConfig) -> list[StateAdvert]:
        adverts: list[StateAdvert] = []
        for peer, value in (await self.dht.get_map(advert_key(config.name))).items():
            if peer == str(self.identity.peer_id):
                continue
            try:
                adverts.append(StateAdvert.from_bytes(value.value))
            except ValueError:
                continue
        return adverts

    async def _sync_from_group(
        self, config: RunConfig, diloco: Optimizer, adverts: list[StateAdvert]
    ) -> bool:
        """Downloads the state most donors advertise and loads it; False if that failed."""
        want, donors = choose_donors(adverts)
        try:
            snap = await download_state(self.client, donors, deadline_s=120.0, want_hash=want)
        except StateSyncError as exc:
            log.warning("state sync failed (%s); going on with this peer's state", exc)
            return False
        if snap.meta.get("config") != config.hash:
            log.warning("donors' state belongs to another config; ignoring it")
            return False
        await trio.to_thread.run_sync(diloco.load_state_dict, snap.to_state_dict())
        self.shared_round = diloco.age
        self.out.event(
            "state_synced",
            f"downloaded the group's state (round {snap.round}) from {len(donors)} donor(s)",
            round=snap.round,
        )
        return True

    async def _initial_state(self, config: RunConfig, diloco: Optimizer) -> tuple[str, int]:
        """Loads the newest state: the group's, else ours, else the seeded init. Returns where
        it came from and the inner step to resume the data order at."""
        adverts = await self._adverts(config)
        saved = load_saved(self.opts.state_dir / STATE_FILE, config.hash)
        saved_round = state_age(saved["global"]) if saved else -1
        if saved is None and adverts and max(a.round for a in adverts) == 0:
            # Round 0 is the seeded init, which this peer builds itself bit for bit: a run's
            # first peers would otherwise each download the whole state (parameters and
            # momentum, 8 bytes a parameter) for nothing. The hash proves it is the same.
            want, _ = choose_donors(adverts)
            mine = await trio.to_thread.run_sync(self._snapshot, config, diloco)
            if mine.state_hash == want:
                return "fresh", 0
        if (
            adverts
            and max(a.round for a in adverts) > saved_round
            and await self._sync_from_group(config, diloco, adverts)
        ):
            return "group", int(saved.get("step", 0)) if saved else 0
        if saved is not None:
            await trio.to_thread.run_sync(diloco.load_state_dict, saved["global"])
            diloco.load_local_state_dict(saved["local"])
            self.out.event(
                "resumed", f"resumed from saved state (round {saved_round})", round=saved_round
            )
            return "saved", int(saved.get("step", 0))
        return "fresh", 0

    async def _catch_up(self, config: RunConfig, diloco: Optimizer, my_hash: bytes) -> bool:
        """A peer that missed a round (no group, a late join) holds a state nobody else has;
        it takes the group's instead of drifting apart forever."""
        adverts = await self._adverts(config)
        if diloco.age > self.shared_round:
            adverts = await self._await_adverts_of(config, diloco.age, adverts)
        want = state_to_take(adverts, diloco.age, my_hash, self.shared_round)
        if want is None:
            return False
        return await self._sync_from_group(
            config, diloco, [a for a in adverts if a.state_hash == want]
        )

    async def _await_adverts_of(
        self, config: RunConfig, age: int, adverts: list[StateAdvert]
    ) -> list[StateAdvert]:
        """Waits (at most LONE_WAIT_S) until every other live peer advertises a state of `age`
        or newer; returns the adverts then.

        A peer whose last round was its own (it came late to a round the others had already
        formed) holds a state of the same age as the group's but its own: in streaming DiLoCo
        a deferred fragment round moves the turn. The others publish their state of that age
        only when their round ends, which with overlap and eager updates is after this peer
        begins its next round. Deciding on the adverts of that moment, it kept its own state
        and matchmade alone under a key nobody else would use, while the others waited for it
        (it is live) until their gather deadline: 10 s stalls, twice, seen in CI. Once their
        adverts are in it takes the group's state and meets the group's next round under the
        group's key. If the whole group failed the round, their adverts show this peer's very
        state and it keeps it."""
        deadline = trio.current_time() + LONE_WAIT_S
        while trio.current_time() < deadline:
            others = await self._live_peers(config) - 1
            if sum(a.round >= age for a in adverts) >= others:
                break
            await trio.sleep(LONE_POLL_S)
            adverts = await self._adverts(config)
        return adverts

    async def _train(self, config: RunConfig, nursery: trio.Nursery) -> None:
        diloco, source = await trio.to_thread.run_sync(self._build, config)
        origin, step = await self._initial_state(config, diloco)
        self.shared_round = diloco.age
        shard = self.opts.data_shard
        if shard is None:
            shard = shard_for_peer(self.identity.peer_id.raw, config.data_shards)
        elif shard >= config.data_shards:
            raise JoinError(
                f"--data-shard {shard}: run {config.name!r} cuts its data into "
                f"{config.data_shards} shards (0 to {config.data_shards - 1})"
            )
        me = Member(self.identity.peer_id, self.address, self.opts.bandwidth)
        mm = MatchmakingConfig(
            target_group_size=config.target_group_size,
            min_group_size=config.min_group_size,
            gather_s=10.0,
            # A follower must outwait the leader's own gathering, or it gives up on a group
            # record that is about to appear and trains alone.
            commit_wait_s=15.0,
        )
        # The run decides how its parts look on the wire (receivers read it from each header).
        self.averager.config = dataclasses.replace(
            self.averager.config,
            int8_block_size=config.int8_block_size,
            int8_bits=config.int8_bits,
            zstd_level=ZSTD_LEVEL if config.zstd else None,
        )
        nursery.start_soon(self._heartbeat, config)
        nursery.start_soon(self._report_progress)
        streaming = (
            f", {config.fragments} fragments ({config.fragment_layout}), overlap "
            f"{config.overlap_steps}, alpha {config.mix_alpha}{', eager' if config.eager else ''}"
            if isinstance(diloco, StreamingDiLoCo)
            else ""
        )
        int8_detail = f" (block {config.int8_block_size}, {config.int8_bits} bits)"
        self.out.event(
            "training",
            f"training {diloco.numel / 1e6:.2f}M parameters with {config.algo}, "
            f"H={config.inner_steps}{streaming}, codec {config.codec}"
            f"{int8_detail if config.codec == 'int8' else ''}"
            f"{' + zstd' if config.zstd else ''}, data shard "
            f"{shard}/{config.data_shards} ({origin} start)",
            params=diloco.numel,
            origin=origin,
            algo=config.algo,
        )
        await self._publish(config, diloco, step)  # also sets last_hash, the matchmaking key
        start = time.monotonic()
        self.stats["started"] = start
        first_val = await trio.to_thread.run_sync(self._validate, diloco, source, config)
        self.out.event(
            "validation", f"validation loss {first_val:.4f}", round=diloco.round, val_loss=first_val
        )
        if isinstance(diloco, StreamingDiLoCo):
            step = await self._train_streaming(
                config, diloco, source, shard, me, mm, step, start, nursery
            )
        else:
            while not self._should_stop(step, start):
                await self._inner_step(config, diloco, source, shard, step)
                step += 1
                if diloco.should_sync():
                    await self._outer_step(config, diloco, source, me, mm, step)
        wall = time.monotonic() - start
        self.out.event(
            "stopped",
            f"stopped after {step} inner steps, sent {self.metrics.sent_total / 2**20:.1f} MiB, "
            f"waited {self.wait_s:.1f}s of {wall:.1f}s for the network",
            step=step,
            round=diloco.round,
            sent_bytes=self.metrics.sent_total,
            received_bytes=self.metrics.received_total,
            sent_by_method=dict(sorted(self.metrics.sent_by_method.items())),
            wall_s=round(wall, 3),
            wait_s=round(self.wait_s, 3),
            held_s=round(self.held_s, 3),
            utilisation=round(1.0 - self.wait_s / wall, 4) if wall > 0 else None,
        )

    async def _inner_step(
        self, config: RunConfig, opt: Optimizer, source: TokenSource, shard: int, step: int
    ) -> None:
        batch = source.train_batch(
            shard, config.data_shards, config.batch_size, config.block_size, config.seed, step
        )
        loss = await trio.to_thread.run_sync(opt.inner_step, batch)
        tokens = int(self.stats.get("tokens", 0)) + config.batch_size * config.block_size
        self.stats.update(step=step + 1, loss=loss, tokens=tokens)

    # -- streaming DiLoCo ------------------------------------------------------------------

    async def _train_streaming(
        self,
        config: RunConfig,
        opt: StreamingDiLoCo,
        source: TokenSource,
        shard: int,
        me: Member,
        mm: MatchmakingConfig,
        step: int,
        start: float,
        nursery: trio.Nursery,
    ) -> int:
        """The trainer loop of streaming DiLoCo; returns the step count it stopped at.

        A fragment's round (matchmaking + all-reduce) runs as a task in the daemon's nursery
        from `begin_round` on, τ inner steps before its outer step, while this loop keeps
        training; at the outer step it waits only if the round is late (eager: it applies a
        stand-in and goes on). The next round cannot begin before the previous one is applied
        (its result is part of the state hash that keys the next round's matchmaking), so one
        fragment at most is on the wire.
        """
        flight: _Flight | None = None
        while not self._should_stop(step, start):
            await self._inner_step(config, opt, source, shard, step)
            step += 1
            if flight is not None and flight.done.is_set() and flight.round.stand_in_applied:
                await self._finish_fragment(config, opt, source, flight, step, 0.0)
                flight = None
            if opt.round_due():
                t0 = time.monotonic()
                waited = 0.0
                if flight is not None:  # an eager stand-in still waits for its average
                    waited = await self._wait_for(flight)
                    if not flight.done.is_set():
                        break  # stopping
                    await self._finish_fragment(config, opt, source, flight, step, waited)
                    flight = None
                    t0 = time.monotonic()
                # A peer whose state is not the group's takes the group's first (see
                # _outer_step). The matchmaking key carries the hash of the whole state, not
                # only this fragment's: it is the hash state adverts already carry, so "same
                # key" and "same advertised state" are one notion, and a peer that differs in
                # any fragment is caught up by one state sync, which replaces every fragment
                # anyway. Per-fragment keys would let it average the fragments it still
                # agrees on, for more bookkeeping (per-fragment adverts and sync).
                assert self.last_hash is not None
                if await self._catch_up(config, opt, self.last_hash):
                    self.wait_s += time.monotonic() - t0
                    await self._synced_event(config, opt, source, step, t0)
                    continue
                self.wait_s += time.monotonic() - t0
                rnd = await trio.to_thread.run_sync(opt.begin_round)
                flight = _Flight(rnd)
                nursery.start_soon(
                    self._fragment_round, config, opt, flight, self.last_hash, me, mm
                )
                # `turn` numbers outer steps from 1 as outer_step events do: this round's.
                self.out.event(
                    "round_started",
                    f"fragment {rnd.fragment} round {rnd.round + 1} (turn {rnd.turn + 1}) started",
                    fragment=rnd.fragment,
                    turn=rnd.turn + 1,
                    step=step,
                )
                self._held(t0)
            if opt.outer_due():
                assert flight is not None
                if opt.config.eager and not flight.done.is_set():
                    report = await trio.to_thread.run_sync(opt.apply_stand_in)
                    self.out.event(
                        "eager_step",
                        f"fragment {report.fragment}: average not here yet, applied this "
                        "peer's own pseudo-gradient as a stand-in",
                        fragment=report.fragment,
                        turn=report.turn,
                    )
                    continue
                waited = await self._wait_for(flight)
                if not flight.done.is_set():
                    break  # stopping: the round is abandoned, the last saved state stands
                await self._finish_fragment(config, opt, source, flight, step, waited)
                flight = None
        return step

    async def _wait_for(self, flight: _Flight) -> float:
        """The trainer waits for a late round (or for a stop signal: the caller checks
        `flight.done`); returns (and accounts) the seconds."""
        t0 = time.monotonic()
        async with trio.open_nursery() as nursery:

            async def on_stop() -> None:
                await self.stopping.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_stop)
            await flight.done.wait()
            nursery.cancel_scope.cancel()
        waited = time.monotonic() - t0
        self.wait_s += waited
        self.held_s += waited
        return waited

    async def _fragment_round(
        self,
        config: RunConfig,
        opt: StreamingDiLoCo,
        flight: _Flight,
        state_hash: bytes,
        me: Member,
        mm: MatchmakingConfig,
    ) -> None:
        """Matchmaking and all-reduce of one fragment's pseudo-gradient; never raises (a
        failed round is `result` None, which the optimiser's failure policy handles)."""
        rnd = flight.round
        sent0 = dict(self.metrics.sent_by_method)
        try:
            flight.live = await self._live_peers(config)
            target = max(config.min_group_size, min(config.target_group_size, flight.live))
            # Per fragment and turn, and only among peers holding the very same global state
            # (all fragments), as in _outer_step.
            key = f"{round_key(config.name, rnd.turn, rnd.fragment)}/{state_hash.hex()[:16]}"
            poll_s = OVERLAPPED_POLL_S if config.overlap_steps > 0 else mm.poll_s
            group = await form_group(
                self.dht, key, me, dataclasses.replace(mm, target_group_size=target, poll_s=poll_s)
            )
            if group is not None and len(group.members) > 1:
                flight.group_size = len(group.members)
                result = await self.averager.allreduce(
                    group,
                    rnd.pseudo_grad,
                    rnd.weight,
                    key=f"fragment/{rnd.fragment}",  # error feedback per fragment
                    codec=config.codec,  # type: ignore[arg-type]
                )
                flight.dropped = len(result.dropped)
                flight.result = result
            elif group is not None:
                # A group of one (min_group_size 1, nobody else here): its average is its own.
                flight.result = rnd.pseudo_grad
        except Exception:  # a round that breaks must not take the trainer down with it
            log.exception("fragment %d round (turn %d) failed", rnd.fragment, rnd.turn)
            flight.result = None
        finally:
            flight.steps_in_flight = opt.steps - rnd.began_at_step
            flight.sync_by_method = self.metrics.sent_since(sent0)
            flight.sync_bytes = sum(flight.sync_by_method.values())
            flight.finished = time.time()
            flight.done.set()

    async def _finish_fragment(
        self,
        config: RunConfig,
        opt: StreamingDiLoCo,
        source: TokenSource,
        flight: _Flight,
        step: int,
        waited: float,
    ) -> None:
        t0 = time.monotonic()
        report = await trio.to_thread.run_sync(opt.finish_round, flight.result)
        if report.status == "averaged" and flight.group_size - flight.dropped > 1:
            self.shared_round = opt.age  # not if the all-reduce dropped everyone else
        snap = await self._publish(config, opt, step)
        # Validate once per H steps (after the last fragment's turn), as plain DiLoCo does.
        val = (
            await trio.to_thread.run_sync(self._validate, opt, source, config)
            if report.turn % opt.fragments == 0
            else None
        )
        self.stats.update(round=opt.round, peers=flight.group_size, last_outer=report.status)
        size, dropped = flight.group_size, flight.dropped
        self.out.event(
            "outer_step",
            f"fragment {report.fragment} round {report.round}: {report.status} with {size} "
            f"peer(s){f', {dropped} dropped' if dropped else ''}"
            f"{' (replaced the stand-in)' if report.replaced_stand_in else ''}, "
            f"{flight.steps_in_flight} step(s) during the round, waited {waited:.2f}s"
            f"{f', validation loss {val:.4f}' if val is not None else ''}, "
            f"state {snap.state_hash.hex()[:12]}",
            round=opt.round,
            fragment=report.fragment,
            fragment_round=report.round,
            turn=report.turn,
            status=report.status,
            group_size=size,
            live_peers=flight.live,
            dropped=dropped,
            val_loss=val,
            state_hash=snap.state_hash.hex(),
            steps_in_flight=flight.steps_in_flight,
            sync_bytes=flight.sync_bytes,
            sync_by_method=flight.sync_by_method,
            replaced_stand_in=report.replaced_stand_in,
            started=round(flight.started, 3),
            finished=round(flight.finished or time.time(), 3),
            wait_s=round(waited, 3),
            seconds=round(self._held(t0) + waited, 3),
        )

    async def _synced_event(
        self, config: RunConfig, opt: StreamingDiLoCo, source: TokenSource, step: int, t0: float
    ) -> None:
        snap = await self._publish(config, opt, step)
        self.out.event(
            "outer_step",
            f"round {opt.round}: took the group's state, {snap.state_hash.hex()[:12]}",
            round=opt.round,
            fragment=None,
            turn=opt.turn,
            status="synced",
            group_size=0,
            dropped=0,
            val_loss=await trio.to_thread.run_sync(self._validate, opt, source, config),
            state_hash=snap.state_hash.hex(),
            wait_s=round(time.monotonic() - t0, 3),
            seconds=round(self._held(t0), 3),
        )

    def _should_stop(self, step: int, start: float) -> bool:
        opts = self.opts
        if self.stop_requested:
            return True
        if opts.max_steps is not None and step >= opts.max_steps:
            return True
        return opts.duration_s is not None and time.monotonic() - start >= opts.duration_s

    def _validate(self, diloco: Optimizer, source: TokenSource, config: RunConfig) -> float:
        batches = source.validation_batches(
            config.batch_size, config.block_size, max_batches=VALIDATION_BATCHES
        )
        return evaluate(diloco.model, batches)

    async def _outer_step(
        self,
        config: RunConfig,
        diloco: DiLoCo,
        source: TokenSource,
        me: Member,
        mm: MatchmakingConfig,
        step: int,
    ) -> None:
        t0 = time.monotonic()
        # A peer whose state is not the group's (it missed a round, or the group moved on while
        # it trained) takes the group's state first: averaging pseudo-gradients cannot bring
        # diverged global parameters back together. Its inner steps of this round are dropped.
        if self.last_hash is not None and await self._catch_up(config, diloco, self.last_hash):
            waited = time.monotonic() - t0
            self.wait_s += waited
            snap = await self._publish(config, diloco, step)
            self.out.event(
                "outer_step",
                f"round {diloco.round}: took the group's state, {snap.state_hash.hex()[:12]}",
                round=diloco.round,
                status="synced",
                group_size=0,
                dropped=0,
                val_loss=await trio.to_thread.run_sync(self._validate, diloco, source, config),
                state_hash=snap.state_hash.hex(),
                wait_s=round(waited, 3),
                seconds=round(self._held(t0), 3),
            )
            return
        sent0 = dict(self.metrics.sent_by_method)
        pg = await trio.to_thread.run_sync(diloco.pseudo_gradient)
        # Wait for as many peers as are alive in the run (their heartbeats), not for the
        # configured maximum: a small run should not sit out the whole gather deadline.
        live = await self._live_peers(config)
        target = max(config.min_group_size, min(config.target_group_size, live))
        mm = dataclasses.replace(mm, target_group_size=target)
        # Only peers holding the very same global state average together: the key carries the
        # state hash, so a peer that drifted (a missed round) can never blend its different
        # parameters into the group's; it catches up by state sync instead.
        assert self.last_hash is not None
        key = f"{round_key(config.name, diloco.round)}/{self.last_hash.hex()[:16]}"
        group = await form_group(self.dht, key, me, mm)
        result = None
        size, dropped = 1, 0
        if group is not None and len(group.members) > 1:
            size = len(group.members)
            result = await self.averager.allreduce(
                group,
                pg,
                diloco.weight(),
                key="diloco",
                codec=config.codec,  # type: ignore[arg-type]
            )
            dropped = len(result.dropped)
        # Plain DiLoCo's trainer waits for all of it: catch-up check, matchmaking, all-reduce.
        waited = time.monotonic() - t0
        sync_by_method = self.metrics.sent_since(sent0)
        sync_bytes = sum(sync_by_method.values())
        self.wait_s += waited
        report = await trio.to_thread.run_sync(diloco.apply_outer, pg, result)
        if report.status == "averaged" and size - dropped > 1:  # not if it dropped everyone
            self.shared_round = diloco.age
        snap = await self._publish(config, diloco, step)
        val = await trio.to_thread.run_sync(self._validate, diloco, source, config)
        self.stats.update(round=diloco.round, peers=size, last_outer=report.status)
        self.out.event(
            "outer_step",
            f"round {report.round}: {report.status} with {size} peer(s)"
            f"{f', {dropped} dropped' if dropped else ''}, validation loss {val:.4f}, "
            f"state {snap.state_hash.hex()[:12]}, {time.monotonic() - t0:.1f}s",
            round=report.round,
            status=report.status,
            group_size=size,
            live_peers=live,
            dropped=dropped,
            val_loss=val,
            state_hash=snap.state_hash.hex(),
            wait_s=round(waited, 3),
            sync_bytes=sync_bytes,
            sync_by_method=sync_by_method,
            seconds=round(self._held(t0), 3),
        )

    def _held(self, t0: float) -> float:
        """Adds the time since `t0` to the trainer's time outside inner steps; returns it."""
        held = time.monotonic() - t0
        self.held_s += held
        return held

    @staticmethod
    def _snapshot(config: RunConfig, diloco: Optimizer) -> StateSnapshot:
        return StateSnapshot.build(
            diloco.state_dict(), round=diloco.age, meta={"config": config.hash}
        )

    async def _publish(self, config: RunConfig, diloco: Optimizer, step: int) -> StateSnapshot:
        """Serves the new global state to joiners, advertises it, and saves it to disk."""
        snap = await trio.to_thread.run_sync(self._snapshot, config, diloco)
        self.last_hash = snap.state_hash
        self.donor.publish(snap)
        await self.dht.store(
            advert_key(config.name),
            StateAdvert.of(snap, self.address).to_bytes(),
            self.dht.now() + 120.0,
            subkey=str(self.identity.peer_id),
        )
        state = {
            "config_hash": config.hash,
            "global": diloco.state_dict(),
            "local": diloco.local_state_dict(),
            "step": step,
        }
        await trio.to_thread.run_sync(save_state, self.opts.state_dir / STATE_FILE, state)
        return snap

    async def _heartbeat(self, config: RunConfig) -> None:
        async with self.dht.announce(peers_key(config.name), self.address.encode(), ttl=30.0):
            await trio.sleep_forever()

    async def _report_progress(self) -> None:
        last_tokens, last_time = 0, time.monotonic()
        while True:
            await trio.sleep(self.opts.progress_interval_s)
            now = time.monotonic()
            step = int(self.stats["step"])
            tokens = int(self.stats.get("tokens", 0))
            tokens_per_s = (tokens - last_tokens) / max(now - last_time, 1e-9)
            last_tokens, last_time = tokens, now
            sent = self.metrics.sent_total
            self.out.event(
                "progress",
                f"step {step} loss {self.stats['loss']:.4f} | {tokens_per_s:.0f} tokens/s | "
                f"round {self.stats['round']} ({self.stats.get('last_outer', '-')}, "
                f"{self.stats['peers']} peers) | sent {sent / 2**20:.1f} MiB",
                step=step,
                loss=self.stats["loss"],
                tokens_per_s=round(tokens_per_s, 1),
                round=self.stats["round"],
                sent_bytes=sent,
            )


def run_join(options: JoinOptions) -> int:
    torch.set_num_threads(1)
    settle_heap()
    try:
        trio.run(Peer(options).run)
    except BaseExceptionGroup as group:
        leaf = innermost(group)
        if isinstance(leaf, JoinError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, BootstrapError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return 3
        raise
    return 0
