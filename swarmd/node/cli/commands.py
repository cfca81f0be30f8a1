"""What each `swarmd` sub-command runs, given its parsed options.

Each imports what it needs when it runs, not at module import: `swarmd dht`, `swarmd ping` and
`swarmd --help` must not pay for torch, grpc or trio they never use.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import swarmd
from swarmd.node.cli.options import (
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    rate_limits,
)
from swarmd.node.runtime.heap import settle_heap

if TYPE_CHECKING:
    from swarmd.node.peer.runconfig import RunConfig


def cmd_version(args: argparse.Namespace) -> int:
    print(f"swarmd {swarmd.__version__}")
    return EXIT_OK


def cmd_identity_create(args: argparse.Namespace) -> int:
    from swarmd.protocol.errors import IdentityError
    from swarmd.protocol.identity import Identity

    try:
        identity = Identity.create(args.state_dir, overwrite=args.force)
    except (IdentityError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(f"created identity in {args.state_dir}")
    print(f"peer id: {identity.peer_id}")
    return EXIT_OK


def cmd_identity_show(args: argparse.Namespace) -> int:
    from swarmd.protocol.errors import IdentityError
    from swarmd.protocol.identity import Identity

    try:
        identity = Identity.load(args.state_dir)
    except (IdentityError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(f"peer id: {identity.peer_id}")
    print(f"public key: {identity.public_key.hex()}")
    return EXIT_OK


def cmd_ping(args: argparse.Namespace) -> int:
    from swarmd.node.cli.ping import ping

    return ping(args.address, count=args.count, timeout=args.timeout, state_dir=args.state_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from swarmd.node.peer.service import PeerConfig, run_peer
    from swarmd.protocol import rpc

    config = PeerConfig(
        listen=args.listen,
        state_dir=args.state_dir,
        metrics=args.metrics,
        transport=rpc.TransportConfig(rate_limits=rate_limits(args)),
    )
    settle_heap()
    try:
        trio.run(run_peer, config)
    except OSError as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK


def cmd_dht(args: argparse.Namespace) -> int:
    import trio

    from swarmd.node.dht.main import DHTNodeOptions, parse_peers, run_dht_node
    from swarmd.node.dht.node import BootstrapError

    try:
        peers = parse_peers([args.peers])
    except ValueError as exc:
        raise CliError(f"bad --peers: {exc}", EXIT_USAGE) from None
    options = DHTNodeOptions(
        listen=args.listen,
        peers=peers,
        state_dir=args.state_dir,
        log_interval_s=args.log_interval,
        rate_limits=rate_limits(args),
    )
    settle_heap()
    try:
        trio.run(run_dht_node, options)
    except BootstrapError as exc:
        raise CliError(str(exc), EXIT_UNREACHABLE) from None
    except OSError as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK


def read_secret(path: Path | None) -> bytes | None:
    """A run secret from its file (surrounding whitespace dropped), or None."""
    if path is None:
        return None
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise CliError(f"--secret-file: {exc}", EXIT_USAGE) from None
    if len(secret) < 16:
        raise CliError(
            f"--secret-file {path}: a run secret must be at least 16 bytes; make one with "
            "`swarmd run secret > FILE`",
            EXIT_USAGE,
        )
    return secret


def cmd_join(args: argparse.Namespace) -> int:
    from swarmd.node.algorithms.registry import STRATEGIES
    from swarmd.node.peer.lifecycle import run_join
    from swarmd.node.peer.local.config import LocalConfigError, count_workers
    from swarmd.node.peer.options import JoinOptions
    from swarmd.node.peer.runconfig import RunConfig, RunConfigError
    from swarmd.protocol.identity import PeerId
    from swarmd.workloads import AllowedWorkloads

    if "@" in args.run:  # NAME@CREATOR: the run id --create-run prints
        name, _, creator = args.run.partition("@")
        try:
            pinned = PeerId.from_string(creator)
        except ValueError as exc:
            raise CliError(f"--run {args.run}: {exc}", EXIT_USAGE) from None
        if args.creator is not None and args.creator != pinned:
            raise CliError(f"--run {args.run} names another creator than --creator", EXIT_USAGE)
        args.run, args.creator = name, pinned
    try:
        local_workers = count_workers(args.local_workers, args.device)
    except (LocalConfigError, ValueError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    create = None
    if args.create_run is not None:
        try:
            create = (
                RunConfig(name=args.run)
                if str(args.create_run) == "-"
                else RunConfig.from_toml(args.create_run, name=args.run)
            )
            if args.algo is not None:
                create = dataclasses.replace(create, algo=args.algo)
        except RunConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    try:
        options = JoinOptions(
            run=args.run,
            state_dir=args.state_dir,
            listen=args.listen,
            peers=args.peers,
            metrics=args.metrics,
            create_run=create,
            max_steps=args.max_steps,
            duration_s=args.duration,
            log_format=args.log_format,
            progress_interval_s=args.progress_interval,
            join_timeout_s=args.join_timeout,
            algo=args.algo,
            data_shard=args.data_shard,
            bulk_port=None if args.no_bulk else args.bulk_port,
            reachable=args.reachable,
            rate_limits=rate_limits(args),
            device=args.device,
            creator=args.creator,
            allowed=AllowedWorkloads(tuple(args.model), tuple(args.data)),
            public_name=args.public_name,
            local_workers=local_workers,
            precision=args.precision,
            compile=args.compile,
            role=args.role,
            stage=args.stage,
            slowdown=args.slowdown,
            swarm_audit=args.swarm_audit,
            secret=read_secret(args.secret_file),
            init_weights=args.init_weights,
        )
    except ValueError as exc:  # an option out of range (JoinOptions says which)
        raise CliError(str(exc), EXIT_USAGE) from None
    if create is not None and args.init_weights is not None:
        _check_init_weights(create, args.init_weights)
    return run_join(options, STRATEGIES)


def _check_init_weights(config: RunConfig, path: Path) -> None:
    """The weights must fit the run's model before anything is published."""
    from swarmd.node.peer.model import build_model
    from swarmd.node.peer.options import JoinError
    from swarmd.workloads.weights import WeightsError

    try:
        build_model(config, "cpu", path)
    except (WeightsError, JoinError) as exc:
        raise CliError(f"--init-weights: {exc}", EXIT_USAGE) from None


def cmd_run_secret(args: argparse.Namespace) -> int:
    import secrets

    print(secrets.token_hex(32))
    return EXIT_OK


def cmd_run_access(args: argparse.Namespace) -> int:
    from swarmd.node.cli.runaccess import change_access

    return change_access(args.run, args.peers, args.state_dir, args.action, args.key)


def cmd_status(args: argparse.Namespace) -> int:
    from swarmd.node.cli.status import status

    return status(args.run, args.peers, args.json)


def cmd_export(args: argparse.Namespace) -> int:
    from swarmd.node.cli.export import export

    if args.run is not None and not args.peers:
        raise CliError("swarmd export: --run needs --peers HOST:PORT", EXIT_USAGE)
    return export(
        args.out,
        run=args.run,
        peers=args.peers or (),
        state_dir=args.state_dir,
        dtype=args.dtype,
        quorum=args.quorum,
        deadline_s=args.timeout,
    )


def cmd_dashboard(args: argparse.Namespace) -> int:
    from swarmd.node.dashboard.server import DashboardOptions, dashboard

    try:
        options = DashboardOptions(
            run=args.run, peers=tuple(args.peers), listen=args.listen, poll_s=args.poll
        )
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return dashboard(options)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.transport_only:
        from swarmd.node.cli.transport_demo import run_demo as transport_demo

        return transport_demo(peers=args.peers, tensor_mib=args.tensor_mib)
    if args.algo == "swarm":
        from swarmd.node.cli.showcase_swarm import run_swarm_demo

        return run_swarm_demo(
            duration_s=args.duration,
            dashboard=None if args.no_dashboard else str(args.dashboard),
        )
    from swarmd.node.cli.showcase import run_demo

    return run_demo(
        peers=args.peers,
        duration_s=args.duration,
        inner_steps=args.inner_steps,
        algo=args.algo,
        dashboard=None if args.no_dashboard else str(args.dashboard),
    )


def cmd_chaos(args: argparse.Namespace) -> int:
    from swarmd.node.chaos import ChaosOptions, run_chaos
    from swarmd.node.chaos.schedule import ScheduleError

    try:
        options = ChaosOptions(
            peers=args.peers,
            duration_s=args.duration,
            seed=args.seed,
            out_dir=args.out,
            schedule_file=args.schedule,
            inner_steps=args.inner_steps,
            algo=args.algo,
            byzantine=args.byzantine,
            resume_bound_s=args.resume_bound,
            liveness_bound_s=args.liveness_bound,
        )
        return run_chaos(options)
    except (ValueError, ScheduleError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
