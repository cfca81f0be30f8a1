"""`swarmd join`: one peer of a run, from identity to graceful leave, whatever the algorithm.

The daemon is one trio run. Its gRPC server carries every service (peer, DHT, all-reduce, state
donor); background tasks (DHT upkeep, heartbeat, progress) live in one nursery; the torch work
runs in worker threads so the event loop keeps serving other peers while it trains.

Lifecycle: join the DHT through --peers; read the run's signed config from the DHT (or publish
it with --create-run); hand the peer to the run's strategy (strategy.py), which takes the state
to start from and trains; announce the heartbeat once it has a state; print progress; on
SIGINT/SIGTERM the strategy stops at its next step boundary, the last state is already saved,
and the peer leaves (the heartbeat lapses; groups drop it by their deadlines).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
from typing import cast

import torch
import trio

from swarmd.node.access import AccessError, AccessMode, RunAccess, publish_list
from swarmd.node.averaging.allreduce import AllReduceConfig, Averager
from swarmd.node.averaging.reduction import Aggregation
from swarmd.node.bans import Bans, Rejection
from swarmd.node.dht import BootstrapError
from swarmd.node.dht.dialback import Reachability, reachability_of
from swarmd.node.metrics import Metrics, MetricsServer
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.local.attach import attach_local
from swarmd.node.peer.local.ranks import LocalRankError
from swarmd.node.peer.membership import LivePeers, heartbeat
from swarmd.node.peer.net import PeerNet, Served, SocketNet
from swarmd.node.peer.options import JoinError, JoinOptions
from swarmd.node.peer.progress import Progress, report_progress
from swarmd.node.peer.progress_publish import PeerFacts, publish_progress
from swarmd.node.peer.runconfig import RunConfig, RunConfigError
from swarmd.node.peer.runrecord import choose, claims, publish_config
from swarmd.node.peer.service import Scratch, peer_service
from swarmd.node.peer.strategy import HostParts, Strategies, Strategy, strategy_for
from swarmd.node.runtime import offload
from swarmd.node.runtime.errors import innermost
from swarmd.node.runtime.heap import settle_heap
from swarmd.node.statesync.donor import StateDonor
from swarmd.node.timing import TimingProfile
from swarmd.protocol import rpc
from swarmd.protocol.address import parse_address
from swarmd.protocol.errors import ProtocolError
from swarmd.protocol.identity import PeerId
from swarmd.workloads import AllowedWorkloads, WorkloadNotAllowed, resolve_device

log = logging.getLogger("swarmd.join")

#: How often a peer re-reads its run's access list and member tokens.
ACCESS_REFRESH_S = 5.0


class Peer:
    """The training peer; `run()` is the whole lifecycle."""

    def __init__(
        self,
        options: JoinOptions,
        strategies: Strategies,
        net: PeerNet | None = None,
        timings: TimingProfile | None = None,
    ) -> None:
        self.opts = options
        self.strategies = strategies
        #: Sockets in a daemon; the simulator's in-memory network in `swarmd sim` (net.py).
        self.net: PeerNet = net or SocketNet()
        self.out = Progress(options.log_format)
        self.identity = self.net.identity(options.state_dir)
        self.metrics = Metrics()
        self.transport = rpc.TransportConfig(
            max_concurrent_rpcs=32,
            bulk=options.bulk_port is not None,
            bulk_port=options.bulk_port or 0,
            rate_limits=options.rate_limits,
        )
        self.client = self.net.client(self.identity, self.transport, self.metrics)
        #: Every protocol timing (node/timing.py): the defaults in a daemon.
        self.timings = timings or TimingProfile()
        self.dht = self.net.dht(self.identity, self.client, self.timings.dht)
        #: Whom this peer refuses for what they sent (bans.py): the averager and
        #: state sync share it; each ban is a `peer_banned` event with its evidence.
        self.bans = Bans(observer=self.metrics, on_ban=self._banned, own=self.identity.peer_id)
        self.metrics.watch_bans(self.bans.active)
        self.averager = Averager(
            self.client, self.identity.peer_id, AllReduceConfig(), self.metrics, bans=self.bans
        )
        self.donor = StateDonor(clock=self.net.monotonic)
        #: What each algorithm serves on every peer (DeMo's all-gather, SWARM's stage calls):
        #: the run's algorithm is not known until its config is read.
        parts = HostParts(self.client, self.identity.peer_id, self.metrics, self.bans, self.net)
        self.hosts = {
            algo: host for algo, s in strategies.items() if (host := s.host(parts)) is not None
        }
        self.address = ""
        #: Set on SIGINT/SIGTERM: the trainer stops at its next step boundary.
        self.stopping = trio.Event()
        #: The run's access rules, once its config is read; until then run calls are refused.
        self.access: RunAccess | None = None
        self.run_paths: frozenset[str] = frozenset()
        #: Whether others can dial this peer (set on join, before the DHT starts).
        self.reach = Reachability("unknown")

    def _banned(self, peer: PeerId, seconds: float, why: Rejection) -> None:
        self.out.event(
            "peer_banned",
            f"banned {peer.short()} for {seconds:.0f} s ({why.offence}): {why}",
            peer_id=str(peer),
            seconds=round(seconds, 1),
            offence=why.offence,
            evidence=str(why),
        )

    def _services(self) -> list[rpc.Service]:
        """Every capability a peer serves, whatever the run's algorithm: it is not known until
        the run config is read, which takes the DHT, which takes the server. The run's own
        services are gated by its access rules (access.py); Ping and the DHT are not."""
        run = [
            dataclasses.replace(s, gate=self._gate)
            for s in (
                self.averager.service(),
                self.donor.service(),
                *(host.service() for host in self.hosts.values()),
            )
        ]
        self.run_paths = frozenset(rpc.method_path(s.name, m.name) for s in run for m in s.methods)
        return [peer_service(self.identity, Scratch(1 << 20)), self.dht.service(), *run]

    def _gate(self, ctx: rpc.CallContext) -> None:
        if self.access is None:
            raise rpc.RpcError(rpc.StatusCode.UNAVAILABLE, "this peer has not joined a run yet")
        self.access.gate(ctx)

    async def run(self) -> None:
        opts = self.opts
        metrics_server = (
            MetricsServer(self.metrics, opts.metrics.host, opts.metrics.port)
            if opts.metrics
            else None
        )
        try:
            async with (
                self.net.serve(
                    self._services(), opts.listen, self.transport, self.metrics, self.identity
                ) as server,
                trio.open_nursery() as nursery,
            ):
                self.address = str(await self.net.advertised(server, opts.peers))
                self.out.announce(
                    "listening",
                    address=self.address,
                    peer_id=str(self.identity.peer_id),
                    metrics_port=metrics_server.port if metrics_server else None,
                )
                if self.net.signals:
                    nursery.start_soon(self._stop_on_signal)
                await self._check_reachable(server)
                # A client-mode peer's DHT node says no port: others leave it out of their
                # tables (they could not dial it) and it only calls out.
                port = 0 if self.reach.client_mode else server.address.port
                await nursery.start(self.dht.run, port, list(opts.peers))
                config, creator = await self._run_config()
                await self._enter(config, creator, nursery)
                await self._train(config, creator, nursery)
                nursery.cancel_scope.cancel()
        finally:
            if metrics_server:
                metrics_server.close()
            self.client.close()

    async def _enter(self, config: RunConfig, creator: PeerId, nursery: trio.Nursery) -> None:
        """Takes on the run's access rules, and checks this peer may take part before it
        trains: a secret run needs the right secret, an allowlisted run the creator's
        `swarmd run allow` (waited for until --join-timeout)."""
        me, mode = self.identity.peer_id, cast(AccessMode, config.access)
        try:
            access = RunAccess(
                config.name, mode, creator, me, self.opts.secret, paths=self.run_paths
            )
        except AccessError as exc:
            raise JoinError(str(exc)) from None
        await access.publish_token(self.dht)
        if creator == me and self.opts.create_run is not None and mode == "allowlist":
            await access.refresh(self.dht)  # a restarted creator keeps its list
            if access.listed.version == 0:
                await publish_list(self.dht, config.name, access.listed)
        with trio.move_on_after(self.opts.join_timeout_s):
            told = False
            while True:
                tokens = await access.refresh(self.dht)
                if access.creator_token_mismatch(tokens):
                    raise JoinError(
                        f"the secret in --secret-file is not run {config.name!r}'s (the "
                        "creator's member token does not verify with it)"
                    )
                if me in access.listed.deny and me != creator:
                    raise JoinError(f"this peer ({me}) is banned from run {config.name!r}")
                if access.listed_in():
                    break
                if not told:
                    self.out.event(
                        "access_wait",
                        f"run {config.name!r} is allowlisted and this peer is not on it: ask "
                        f"its creator to run `swarmd run allow {me} --run {config.name}`",
                        peer_id=str(me),
                    )
                    told = True
                await trio.sleep(2.0)
        if told and access.listed_in():
            # Just allowed: give every peer of the run a re-read of the list (they re-read at
            # once when refused a key, else every ACCESS_REFRESH_S) before asking them for a
            # state; a refused first download started this joiner from scratch.
            await trio.sleep(2.0)
        if not access.listed_in():
            raise JoinError(
                f"this peer ({me}) is not on run {config.name!r}'s allowlist; its creator "
                f"admits it with `swarmd run allow {me} --run {config.name}`"
            )
        self.access = access
        self.dht.owner_filter = access.dht_filter
        self.client.access_tag = access.request_tag
        nursery.start_soon(self._keep_access, access)

    async def _keep_access(self, access: RunAccess) -> None:
        """Re-reads the access list and member tokens: a `swarmd run allow|deny` takes effect
        on every peer within ACCESS_REFRESH_S."""
        while True:
            # Every ACCESS_REFRESH_S, or within a second of meeting a key not (yet) admitted:
            # a newly allowed joiner's first calls are refused only that long.
            waited = 0.0
            while waited < ACCESS_REFRESH_S and not access.missed:
                await trio.sleep(1.0)
                waited += 1.0
            access.missed = False
            with trio.move_on_after(30.0):
                try:
                    await access.refresh(self.dht)
                except (rpc.RpcError, ProtocolError, OSError) as exc:  # the next one may do
                    log.warning("could not re-read run %r's access list: %s", access.run, exc)

    async def _check_reachable(self, server: Served) -> None:
        """Whether others can dial this peer (dialback.py); unreachable: client mode."""
        self.reach = reach = await reachability_of(
            self.opts.reachable,
            self.client,
            self.opts.peers,
            server.address.port,
            server.bulk_port,
            parse_address(self.address).host,
        )
        mode = "client" if reach.client_mode else "server"
        text = (
            f"other peers cannot dial this one ({reach.detail or reach.observed}): client mode, "
            "it trains and sends its updates but reduces no part and serves no state"
            if reach.client_mode
            else f"reachable ({reach.detail or 'dialled back at ' + reach.observed})"
        )
        self.out.event(
            "reachability", text, verdict=reach.verdict, mode=mode, observed=reach.observed
        )

    async def _stop_on_signal(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.out.event("leaving", f"{signal.Signals(signum).name}: leaving the run")
                self.stopping.set()
                return

    async def _run_config(self) -> tuple[RunConfig, PeerId]:
        """The run's config and who signed it."""
        opts = self.opts
        if opts.create_run is not None:
            config = opts.create_run
            self._check_allowed(config, opts.allowed.with_own_run(config.model, config.data))
            await publish_config(self.dht, config)
            self.out.event(
                "run_created",
                f"created run {config.name!r} (config {config.hash}); others join it with "
                f"--run {config.name} --creator {self.identity.peer_id}",
                run=config.name,
                config_hash=config.hash,
                creator=str(self.identity.peer_id),
            )
            return config, self.identity.peer_id
        with trio.move_on_after(opts.join_timeout_s):
            while True:
                claim = choose(await claims(self.dht, opts.run), opts.run, opts.creator)
                if claim is not None:
                    config = self._check_config(claim.raw)
                    pinned = "" if opts.creator else f"; pin it with --creator {claim.creator}"
                    self.out.event(
                        "run_joined",
                        f"joined run {config.name!r} (config {config.hash}, created by "
                        f"{claim.creator.short()}{pinned})",
                        run=config.name,
                        config_hash=config.hash,
                        creator=str(claim.creator),
                    )
                    return config, claim.creator
                await trio.sleep(1.0)
        by = f" signed by {opts.creator}" if opts.creator else ""
        raise JoinError(
            f"no run named {opts.run!r}{by} was found in the DHT within "
            f"{opts.join_timeout_s:.0f}s; check --run, or create it with --create-run FILE"
        )

    def _check_config(self, raw: bytes) -> RunConfig:
        """The run config read from the DHT, if it is the run the user asked for and names
        only workloads the user allowed."""
        try:
            config = RunConfig.from_json(raw)
        except RunConfigError as exc:
            raise JoinError(str(exc)) from None
        if config.name != self.opts.run:
            raise JoinError(f"the DHT holds a config for {config.name!r}, not {self.opts.run!r}")
        if self.opts.algo is not None and config.algo != self.opts.algo:
            raise JoinError(
                f"run {config.name!r} trains with {config.algo}, not {self.opts.algo}; "
                "--algo only chooses the algorithm of a run made with --create-run"
            )
        self._check_allowed(config, self.opts.allowed)
        return config

    @staticmethod
    def _check_allowed(config: RunConfig, allowed: AllowedWorkloads) -> None:
        try:
            allowed.check_model(config.model)
            allowed.check_data(config.data)
        except WorkloadNotAllowed as exc:
            raise JoinError(str(exc)) from None

    async def _train(self, config: RunConfig, creator: PeerId, nursery: trio.Nursery) -> None:
        unsupported = strategy_for(self.strategies, config.algo).needs_reachable(self.opts)
        if self.reach.client_mode and unsupported:
            raise JoinError(
                f"run {config.name!r} uses {config.algo}, whose peers must all be reachable "
                f"({unsupported}), and others cannot dial this one: open its ports (or forward "
                "them on the router), or join a run whose algorithm takes client-mode peers"
            )
        peer = PeerContext(
            opts=self.opts,
            config=config,
            identity=self.identity,
            address=self.address,
            client=self.client,
            dht=self.dht,
            averager=self.averager,
            donor=self.donor,
            hosts=self.hosts,
            metrics=self.metrics,
            out=self.out,
            live=LivePeers(self.dht, config, self.timings.membership),
            timings=self.timings,
            net=self.net,
            stopping=self.stopping,
            creator=creator,
            client_mode=self.reach.client_mode,
        )
        self.averager.limit_weights(config.max_weight)
        aggregation = cast(Aggregation, config.aggregation)
        self.averager.set_reduction(
            dataclasses.replace(
                self.averager.config.reduction,
                aggregation=aggregation,
                drop_opposed=config.drop_opposed,
            )
        )
        strategy = strategy_for(self.strategies, config.algo)(peer)
        await strategy.join()
        try:
            await self._start_local(peer, strategy)
            await self._trained(peer, strategy, nursery)
        finally:
            if peer.ranks is not None:
                with trio.CancelScope(shield=True):
                    await offload.run_sync(peer.ranks.close)

    async def _start_local(self, peer: PeerContext, strategy: Strategy) -> None:
        """The strategy's inner steps on this machine's ranks, precision and compiler."""
        local = self.opts.local_config()
        if local.workers > peer.config.max_local_workers:
            raise JoinError(
                f"--local-workers {local.workers}: run {peer.config.name!r} allows at most "
                f"{peer.config.max_local_workers} local ranks per peer (max_local_workers)"
            )
        target = strategy.local_target()
        if target is None:
            if local.workers > 1:
                raise JoinError(f"--local-workers: {peer.config.algo} trains in one process only")
            return
        peer.ranks = await offload.run_sync(
            attach_local, target, local, peer.config, self.opts.state_dir
        )
        if local.workers > 1 or local.precision != "fp32" or local.compile:
            ranks = (
                f"{local.workers} local ranks ({local.backend}) from " if local.workers > 1 else ""
            )
            self.out.event(
                "local_ranks",
                f"inner steps on {ranks}{local.device}, {local.precision}"
                f"{', compiled' if local.compile else ''}",
                workers=local.workers,
                pids=peer.ranks.pids if peer.ranks is not None else [],
                device=local.device,
                precision=local.precision,
                compile=local.compile,
            )

    async def _trained(self, peer: PeerContext, strategy: Strategy, nursery: trio.Nursery) -> None:
        config = peer.config
        self.metrics.watch_training(lambda: peer.stats.figures(peer.clock.wait_s))
        nursery.start_soon(
            heartbeat, self.dht, config, self.address, peer.client_mode, peer.timings.membership
        )
        nursery.start_soon(
            report_progress, self.out, peer.stats, self.metrics, self.opts.progress_interval_s
        )
        facts = PeerFacts(
            config.name, config.algo, str(resolve_device(self.opts.device)), self.opts.public_name
        )
        nursery.start_soon(
            publish_progress,
            self.dht,
            facts,
            peer.stats,
            self.metrics,
            self.opts.progress_interval_s,
            self.out.notices,
        )
        start = time.monotonic()
        step = await strategy.train(nursery)
        self._stopped(peer, step, strategy.round, time.monotonic() - start)

    def _stopped(self, peer: PeerContext, step: int, round_no: int, wall: float) -> None:
        wait_s, metrics = peer.clock.wait_s, self.metrics
        self.out.event(
            "stopped",
            f"stopped after {step} inner steps, sent {metrics.sent_total / 2**20:.1f} MiB, "
            f"waited {wait_s:.1f}s of {wall:.1f}s for the network",
            step=step,
            round=round_no,
            sent_bytes=metrics.sent_total,
            received_bytes=metrics.received_total,
            sent_by_method=dict(sorted(metrics.sent_by_method.items())),
            wall_s=round(wall, 3),
            wait_s=round(wait_s, 3),
            held_s=round(peer.clock.held_s, 3),
            utilisation=round(1.0 - wait_s / wall, 4) if wall > 0 else None,
        )


#: Times `swarmd join` starts a peer again after one of its local ranks died.
LOCAL_RESTARTS = 3
#: Exit code when local ranks kept dying.
EXIT_LOCAL_RANK = 4


def run_join(options: JoinOptions, strategies: Strategies) -> int:
    """`swarmd join`'s exit code: 0, 2 for what the user must fix, 3 if no peer answered, 4 if
    a local rank died and kept dying after LOCAL_RESTARTS restarts of the peer."""
    torch.set_num_threads(1)
    settle_heap()
    for attempt in range(LOCAL_RESTARTS + 1):
        try:
            trio.run(Peer(options, strategies).run)
        except BaseExceptionGroup as group:
            leaf = innermost(group)
            if isinstance(leaf, JoinError):
                print(f"swarmd: error: {leaf}", file=sys.stderr)
                return 2
            if isinstance(leaf, BootstrapError):
                print(f"swarmd: error: {leaf}", file=sys.stderr)
                return 3
            if not isinstance(leaf, LocalRankError):
                raise
            if attempt == LOCAL_RESTARTS:
                print(f"swarmd: error: {leaf}; gave up after {attempt} restarts", file=sys.stderr)
                return EXIT_LOCAL_RANK
            # The peer's state on disk is its last outer step's (ranks write nothing), so
            # the restarted peer resumes from there with fresh ranks.
            Progress(options.log_format).event(
                "restarting",
                f"{leaf}: the peer stopped; starting it again ({attempt + 1}/{LOCAL_RESTARTS})",
                reason=str(leaf),
                attempt=attempt + 1,
            )
            continue
        return 0
    return EXIT_LOCAL_RANK
