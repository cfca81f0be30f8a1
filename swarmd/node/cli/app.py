"""The `swarmd` command line.

Every option can also come from a TOML file (``--config FILE``, keys named like the long
options, per sub-command table or at top level) or an environment variable ``SWARMD_<OPTION>``
(e.g. ``SWARMD_STATE_DIR``). Precedence: command line, then environment, then file, then the
built-in default.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 3 peer unreachable or unhealthy.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import swarmd
from swarmd.node.runtime.heap import settle_heap
from swarmd.protocol.address import Address, parse_address

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class CliError(Exception):
    """A failure to report as one line, with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def default_state_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "swarmd"


def _address(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listen_address(text: str) -> Address:
    try:
        return parse_address(text, allow_port_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="directory for this peer's identity key, state and logs "
        "(default: %(default)s; env SWARMD_STATE_DIR)",
    )


def _add_listen(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        type=_listen_address,
        default=Address("127.0.0.1", 0),
        help="HOST:PORT to listen on; port 0 lets the OS choose (default: 127.0.0.1:0)",
    )


def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics",
        type=_listen_address,
        default=None,
        help="serve Prometheus metrics on HOST:PORT",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmd",
        description="swarmd: train one model together with strangers' machines, "
        "over the internet, without a central server.",
        epilog="Options also come from --config FILE (TOML) and SWARMD_<OPTION> environment "
        "variables. Run `swarmd COMMAND --help` for a command's options.",
    )
    parser.add_argument("--config", type=Path, help="TOML file with option defaults")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("version", help="print the swarmd version")
    p.set_defaults(func=cmd_version)

    p = sub.add_parser("identity", help="create or show this peer's Ed25519 identity")
    isub = p.add_subparsers(dest="identity_command", metavar="ACTION")
    c = isub.add_parser("create", help="create a new identity key (mode 0600)")
    _add_state_dir(c)
    c.add_argument("--force", action="store_true", help="replace an existing key")
    c.set_defaults(func=cmd_identity_create)
    s = isub.add_parser("show", help="print the peer id of the stored identity")
    _add_state_dir(s)
    s.set_defaults(func=cmd_identity_show)
    p.set_defaults(func=lambda args: _usage(p))

    p = sub.add_parser(
        "ping",
        help="check a peer: gRPC health, then signed round trips",
        description="Checks a peer's grpc.health.v1 status, then sends signed Ping requests "
        "and prints each round-trip time. Exit code 3 if the peer cannot be reached.",
    )
    p.add_argument("address", type=_address, help="the peer, HOST:PORT")
    p.add_argument(
        "--count",
        type=_non_negative_int,
        default=3,
        help="round trips after the health check (default: 3; 0: health check only, which "
        "also suits a DHT node: it serves no Ping)",
    )
    p.add_argument(
        "--timeout", type=_positive_float, default=5.0, help="seconds per call (default: 5)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="sign with this identity instead of a throw-away one",
    )
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser(
        "serve",
        help="run a bare peer (transport only: ping and tensor put/get)",
        description="Runs a peer that answers Ping, PutTensor and GetTensor and the gRPC "
        "health service, until SIGINT or SIGTERM. Prints one JSON line with its address.",
    )
    _add_listen(p)
    _add_metrics(p)
    _add_state_dir(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "dht",
        help="run a DHT-only node (e.g. a bootstrap node; no training, no torch)",
        description="Runs a DHT node until SIGINT or SIGTERM: joins through --peers (or starts "
        "a new DHT without them), prints one JSON line with its address and peer id, then logs "
        "its routing table size periodically. Exit code 3 if no bootstrap peer answers.",
    )
    _add_listen(p)
    p.add_argument(
        "--peers",
        default="",
        help="bootstrap peers, HOST:PORT[,HOST:PORT...]; omit to start a new DHT",
    )
    p.add_argument(
        "--log-interval",
        type=_positive_float,
        default=30.0,
        help="seconds between routing table reports (default: 30)",
    )
    _add_state_dir(p)
    p.set_defaults(func=cmd_dht)

    p = sub.add_parser(
        "join",
        help="train with a run's peers (DiLoCo)",
        description="Joins a training run: bootstraps into the DHT through --peers, reads the "
        "run's configuration from it (or publishes one with --create-run), downloads the "
        "group's newest state or resumes this peer's saved state, then trains with DiLoCo "
        "until SIGINT/SIGTERM, --max-steps or --duration. Exit code 2 if the run cannot be "
        "joined, 3 if no bootstrap peer answers.",
    )
    p.add_argument("--run", required=True, help="the run's name")
    p.add_argument(
        "--peers",
        type=_address_list,
        default=(),
        help="bootstrap peers, HOST:PORT[,HOST:PORT...] (omit only for the first peer)",
    )
    _add_listen(p)
    p.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="port of the bulk data plane: tensors (all-reduce parts, state downloads) travel "
        "there as plain TCP beside the gRPC port, at about half gRPC's CPU cost; 0 lets the OS "
        "choose (default). Peers learn it over gRPC and fall back to gRPC if it is unreachable",
    )
    p.add_argument(
        "--no-bulk",
        action="store_true",
        help="send tensors over the gRPC port only (a host that can open just one port)",
    )
    p.add_argument(
        "--create-run",
        type=Path,
        default=None,
        metavar="FILE",
        help="publish a new run from this TOML file (keys: see swarmd/node/training/runconfig.py; "
        "'-' for the built-in defaults)",
    )
    p.add_argument(
        "--algo",
        choices=["diloco", "streaming-diloco"],
        default=None,
        help="with --create-run: the run's algorithm (overrides the file's `algo`); without "
        "it: refuse to join a run that uses another one",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the model trains: auto (the first CUDA GPU if torch sees one, else the "
        "CPU), cpu, cuda, cuda:N or mps (default: auto). A peer's own choice: peers on GPUs "
        "and CPUs train the same run, and what they exchange is the same fp32 CPU vector",
    )
    p.add_argument("--max-steps", type=_positive_int, default=None, help="stop after N steps")
    p.add_argument(
        "--data-shard",
        type=int,
        default=None,
        metavar="N",
        help="read training shard N of 64 instead of the one the peer id picks (for "
        "experiments on fixed data; peers given the same shard draw the same batches)",
    )
    p.add_argument("--duration", type=_positive_float, default=None, help="stop after S seconds")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text progress on stderr, or JSON lines on stdout (default: text)",
    )
    p.add_argument(
        "--progress-interval", type=_positive_float, default=5.0, help="seconds between lines"
    )
    p.add_argument(
        "--join-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds to wait for the run's config in the DHT (default: 60)",
    )
    _add_metrics(p)
    _add_state_dir(p)
    p.set_defaults(func=cmd_join)

    p = sub.add_parser(
        "status",
        help="what the DHT knows of a run: config, live peers, their rounds",
        description="Joins the DHT as a client only, prints the run's configuration, its live "
        "peers (heartbeats) with the outer round and state hash each advertises, and the "
        "current outer round. Exit code 1 if the run is unknown, 3 if no bootstrap answers.",
    )
    p.add_argument("--run", required=True, help="the run's name")
    p.add_argument(
        "--peers", type=_address_list, required=True, help="bootstrap peers, HOST:PORT[,...]"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "demo",
        help="run a real multi-peer training run on this machine",
        description="Starts a `swarmd dht` bootstrap and several `swarmd join` peers on "
        "loopback, trains the built-in GPT on the built-in corpus with DiLoCo for a few "
        "minutes, SIGKILLs one peer and adds a new one midway, then prints a summary (loss "
        "start -> end, whether the survivors hold identical states, bytes sent vs "
        "data-parallel, peers joined/left). --transport-only runs the short transport demo.",
    )
    p.add_argument("--peers", type=_positive_int, default=3, help="peer processes (default: 3)")
    p.add_argument("--duration", type=_positive_float, default=150.0, help="seconds (default: 150)")
    p.add_argument("--inner-steps", type=_positive_int, default=25, help="DiLoCo H (default: 25)")
    p.add_argument(
        "--transport-only",
        action="store_true",
        help="instead: relay a tensor through peers, ping, forged request (seconds)",
    )
    p.add_argument(
        "--tensor-mib",
        type=_positive_int,
        default=64,
        help="transport demo: size of the relayed tensor in MiB (default: 64)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "chaos",
        help="real peers under a seeded schedule of faults, then check the invariants",
        description="Starts a `swarmd dht` bootstrap and --peers `swarmd join` processes on "
        "loopback and, once they train, applies a schedule of faults drawn from --seed (or "
        "read from --schedule): SIGKILL and restart from the same state dir, SIGSTOP/SIGCONT "
        "pauses, network partitions, latency/jitter/loss, bandwidth limits and clock skew "
        "(injected in the transport through SWARMD_FAULTS plan files). Everything is recorded "
        "in OUT/chaos.jsonl; then the invariants are checked: the live peers hold the same "
        "state after the final round, validation loss fell, nobody died except on purpose, no "
        "traceback in any log, restarted peers resumed within --resume-bound, and while a "
        "group could form an outer round completed at least every --liveness-bound seconds. "
        "Prints a report, writes OUT/report.txt and OUT/timeline.png; the last line is "
        "key=value figures. Exit code 1 if an invariant fails. --duration 600 is the soak.",
    )
    p.add_argument("--peers", type=_positive_int, default=6, help="peer processes (default: 6)")
    p.add_argument(
        "--duration",
        type=_positive_float,
        default=300.0,
        help="seconds of chaos after all peers train (default: 300)",
    )
    p.add_argument("--seed", type=int, default=0, help="schedule seed (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="directory for JSONL, logs, report, PNG")
    p.add_argument(
        "--schedule", type=Path, default=None, help="JSON schedule instead of a seeded one"
    )
    p.add_argument("--inner-steps", type=_positive_int, default=10, help="DiLoCo H (default: 10)")
    p.add_argument(
        "--resume-bound",
        type=_positive_float,
        default=90.0,
        help="seconds a restarted peer may take to train again (default: 90)",
    )
    p.add_argument(
        "--liveness-bound",
        type=_positive_float,
        default=90.0,
        help="longest wait for an outer round while a group can form (default: 90)",
    )
    p.set_defaults(func=cmd_chaos)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(_subparsers(child))
    return found


def _apply_overlays(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Sets defaults from the TOML file and SWARMD_* variables, below the command line."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or (
        Path(os.environ["SWARMD_CONFIG"]) if os.environ.get("SWARMD_CONFIG") else None
    )
    file_values: dict[str, Any] = {}
    if config_path is not None:
        try:
            file_values = tomllib.loads(config_path.read_text())
        except FileNotFoundError:
            raise CliError(f"config file {config_path} does not exist", EXIT_USAGE) from None
        except tomllib.TOMLDecodeError as exc:
            raise CliError(
                f"config file {config_path} is not valid TOML: {exc}", EXIT_USAGE
            ) from None
    for p in _subparsers(parser):
        command = p.prog.split()[-1]
        table = file_values.get(command, {})
        overlay: dict[str, Any] = {}
        for action in p._actions:
            if not action.option_strings or action.dest in ("help", "config"):
                continue
            key = action.dest.replace("_", "-")
            if isinstance(table, dict) and key in table:
                overlay[action.dest] = _from_file(action, table[key])
            elif key in file_values and not isinstance(file_values[key], dict):
                overlay[action.dest] = _from_file(action, file_values[key])
            env = os.environ.get("SWARMD_" + action.dest.upper())
            if env is not None:
                overlay[action.dest] = _convert(action, env)
        if overlay:
            p.set_defaults(**overlay)


def _convert(action: argparse.Action, text: str) -> Any:
    if action.nargs == 0:  # a flag
        return text.strip().lower() in ("1", "true", "yes", "on")
    if action.type is None:
        return text
    convert: Callable[[str], Any] = action.type  # type: ignore[assignment]
    try:
        return convert(text)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise CliError(f"bad value for {action.option_strings[0]}: {exc}", EXIT_USAGE) from None


def _from_file(action: argparse.Action, value: Any) -> Any:
    return _convert(action, value if isinstance(value, str) else str(value))


#: PyTorch backs CPU tensors of 2 MB and more with transparent huge pages when this is set
#: (kernels where THP is "madvise", the common default, give none otherwise). An all-reduce
#: allocates its result and reduced parts afresh every round: a 400 MB tensor's first touch
#: cost 0.18 CPU-s in 4 KiB page faults, 0.025 s in huge pages (measured on the 2-core
#: machine). Read once, at torch's first allocation: set before torch is imported.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(THP_ENV, "1")
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        _apply_overlays(parser, args_list)
        args = parser.parse_args(args_list)
        logging.basicConfig(
            level=getattr(logging, args.log_level.upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        if not hasattr(args, "func"):
            return _usage(parser)
        code: int = args.func(args)
        return code
    except CliError as exc:
        print(f"swarmd: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:  # from a command's trio.run
        from swarmd.node.runtime.errors import innermost
        from swarmd.protocol.errors import ListenError

        leaf = innermost(group)
        if isinstance(leaf, ListenError):
            print(f"swarmd: error: {leaf}", file=sys.stderr)
            return EXIT_USAGE
        raise


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

    from swarmd.node.server.peer import PeerConfig, run_peer

    config = PeerConfig(listen=args.listen, state_dir=args.state_dir, metrics=args.metrics)
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
        listen=args.listen, peers=peers, state_dir=args.state_dir, log_interval_s=args.log_interval
    )
    settle_heap()
    try:
        trio.run(run_dht_node, options)
    except BootstrapError as exc:
        raise CliError(str(exc), EXIT_UNREACHABLE) from None
    except OSError as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK


def _address_list(text: str) -> tuple[str, ...]:
    items = [t for t in (part.strip() for part in text.split(",")) if t]
    for item in items:
        _address(item)
    return tuple(items)


def cmd_join(args: argparse.Namespace) -> int:
    from swarmd.node.training.daemon import JoinOptions, run_join
    from swarmd.node.training.runconfig import RunConfig, RunConfigError

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
            device=args.device,
        )
    except ValueError as exc:  # an option out of range (JoinOptions says which)
        raise CliError(str(exc), EXIT_USAGE) from None
    return run_join(options)


def cmd_status(args: argparse.Namespace) -> int:
    from swarmd.node.cli.status import status

    return status(args.run, args.peers, args.json)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.transport_only:
        from swarmd.node.cli.transport_demo import run_demo as transport_demo

        return transport_demo(peers=args.peers, tensor_mib=args.tensor_mib)
    from swarmd.node.cli.demo import run_demo

    return run_demo(peers=args.peers, duration_s=args.duration, inner_steps=args.inner_steps)


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
            resume_bound_s=args.resume_bound,
            liveness_bound_s=args.liveness_bound,
        )
        return run_chaos(options)
    except (ValueError, ScheduleError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def entry() -> None:
    """The `swarmd` command: `main`, then an exit that skips interpreter finalisation.

    By the time `main` returns, every server, channel and file of ours is closed and the state
    is saved, but grpcio's and torch's C++ threads can still abort the process while Python
    tears itself down ("terminate called without an active exception", SIGABRT): one of four
    daemons of a convergence benchmark run exited with -6 after a clean stop. os._exit leaves
    nothing of value behind: output is flushed and logging shut down first.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
