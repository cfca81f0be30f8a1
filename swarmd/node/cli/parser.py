"""The `swarmd` argument parser: one builder per sub-command.

Each sub-command's parser carries its handler (`func`) so `main` needs no table of commands;
the options' order here is the order `--help` lists them in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from swarmd.node.cli import commands
from swarmd.node.cli.options import (
    add_listen,
    add_metrics,
    add_rate_limits,
    add_state_dir,
    address,
    address_list,
    listen_address,
    non_negative_int,
    peer_id,
    positive_float,
    positive_int,
)
from swarmd.node.cli.parser_export import add_export
from swarmd.node.cli.parser_keys import add_identity, add_run
from swarmd.node.cli.parser_net import add_join_network
from swarmd.node.cli.simulate import add_sim
from swarmd.protocol.address import Address

#: runconfig.ALGORITHMS, spelled out so that parsing a command line imports no torch (a DHT
#: node stays small); tests/unit/test_cli.py checks that the two agree.
ALGORITHMS = ("diloco", "streaming-diloco", "demo", "swarm")

#: The object whose `add_parser` makes a sub-command's parser.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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
    p.set_defaults(func=commands.cmd_version)
    for add in _BUILDERS:
        add(sub)
    return parser


def _add_ping(sub: Subparsers) -> None:
    p = sub.add_parser(
        "ping",
        help="check a peer: gRPC health, then signed round trips",
        description="Checks a peer's grpc.health.v1 status, then sends signed Ping requests "
        "and prints each round-trip time. Exit code 3 if the peer cannot be reached.",
    )
    p.add_argument("address", type=address, help="the peer, HOST:PORT")
    p.add_argument(
        "--count",
        type=non_negative_int,
        default=3,
        help="round trips after the health check (default: 3; 0: health check only, which "
        "also suits a DHT node: it serves no Ping)",
    )
    p.add_argument(
        "--timeout", type=positive_float, default=5.0, help="seconds per call (default: 5)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="sign with this identity instead of a throw-away one",
    )
    p.set_defaults(func=commands.cmd_ping)


def _add_serve(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve",
        help="run a bare peer (transport only: ping and tensor put/get)",
        description="Runs a peer that answers Ping, PutTensor and GetTensor and the gRPC "
        "health service, until SIGINT or SIGTERM. Prints one JSON line with its address.",
    )
    add_listen(p)
    add_rate_limits(p)
    add_metrics(p)
    add_state_dir(p)
    p.set_defaults(func=commands.cmd_serve)


def _add_dht(sub: Subparsers) -> None:
    p = sub.add_parser(
        "dht",
        help="run a DHT-only node (e.g. a bootstrap node; no training, no torch)",
        description="Runs a DHT node until SIGINT or SIGTERM: joins through --peers (or starts "
        "a new DHT without them), prints one JSON line with its address and peer id, then logs "
        "its routing table size periodically. Exit code 3 if no bootstrap peer answers.",
    )
    add_listen(p)
    add_rate_limits(p)
    p.add_argument(
        "--peers",
        default="",
        help="bootstrap peers, HOST:PORT[,HOST:PORT...]; omit to start a new DHT",
    )
    p.add_argument(
        "--log-interval",
        type=positive_float,
        default=30.0,
        help="seconds between routing table reports (default: 30)",
    )
    add_state_dir(p)
    p.set_defaults(func=commands.cmd_dht)


def _add_join(sub: Subparsers) -> None:
    p = sub.add_parser(
        "join",
        help="train with a run's peers (DiLoCo, streaming DiLoCo, DeMo or SWARM)",
        description="Joins a training run: bootstraps into the DHT through --peers, reads the "
        "run's configuration from it (or publishes one with --create-run), downloads the "
        "group's newest state or resumes this peer's saved state, then trains with DiLoCo "
        "until SIGINT/SIGTERM, --max-steps or --duration. Exit code 2 if the run cannot be "
        "joined, 3 if no bootstrap peer answers.",
    )
    p.add_argument(
        "--run",
        required=True,
        help="the run's name, or NAME@CREATOR_ID (what --create-run prints: the same as "
        "--run NAME --creator CREATOR_ID)",
    )
    add_join_network(p)
    _add_join_run(p)
    _add_init_weights(p)
    _add_join_limits(p)
    _add_swarm_options(p)
    add_metrics(p)
    add_state_dir(p)
    p.set_defaults(func=commands.cmd_join)


def _add_init_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--init-weights",
        type=Path,
        help="with --create-run: start from these weights (safetensors, the names `swarmd "
        "export` writes), checked against the run's model before anything is published; "
        "joiners receive them by state sync",
    )


def _add_join_run(p: argparse.ArgumentParser) -> None:
    """Which run `join` trains, and on what."""
    p.add_argument(
        "--create-run",
        type=Path,
        default=None,
        metavar="FILE",
        help="publish a new run from this TOML file (keys: see swarmd/node/peer/runconfig.py; "
        "'-' for the built-in defaults)",
    )
    p.add_argument(
        "--algo",
        choices=ALGORITHMS,
        default=None,
        help="with --create-run: the run's algorithm (overrides the file's `algo`); without "
        "it: refuse to join a run that uses another one",
    )
    p.add_argument(
        "--creator",
        type=peer_id,
        default=None,
        metavar="PEER_ID",
        help="accept only the run config this key signed (the creator's peer id, printed when "
        "it created the run); without it, the only config published for --run is taken",
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the run's secret, for runs with access = \"secret\" (the creator's too): "
        "peers prove they hold it with an HMAC on every request and never send it. Make "
        "one with `swarmd run secret > FILE` and hand it to the run's volunteers",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help="allow the run to use this model (module:function or an installed workload): "
        "swarmd never imports code a run config names unless its user allowed it here",
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="PATH",
        help="allow the run to train on this data path of this machine (a run config alone "
        "never makes swarmd open a local file)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the model trains: auto (the first CUDA GPU if torch sees one, else the "
        "CPU), cpu, cuda, cuda:N or mps (default: auto). A peer's own choice: peers on GPUs "
        "and CPUs train the same run, and what they exchange is the same fp32 CPU vector",
    )
    p.add_argument(
        "--local-workers",
        default="1",
        metavar="N|auto",
        help="train on N local ranks as one peer (torch.distributed inside this machine: NCCL "
        "between GPUs, gloo between CPU processes): each rank reads its own batches, "
        "gradients are averaged every step, and the swarm sees one peer with N times the "
        "samples. auto: one rank per visible GPU (default: 1, this process alone)",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="inner-step arithmetic: bf16 autocast (weights, optimizer and what is sent stay "
        "fp32) or fp32; auto is bf16 on a GPU that has it, else fp32 (default: auto)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the training forward (faster steps on a GPU after a compile of "
        "a minute or more at start)",
    )


def _add_swarm_options(p: argparse.ArgumentParser) -> None:
    """What a peer of a SWARM run (algo swarm) does."""
    g = p.add_argument_group("SWARM runs (algo swarm)")
    g.add_argument(
        "--role",
        choices=["auto", "trainer", "server", "both"],
        default="auto",
        help="serve a pipeline stage, drive micro-batches of this peer's data through the "
        "stages, or both (auto: both)",
    )
    g.add_argument(
        "--stage",
        type=int,
        default=None,
        metavar="N",
        help="the stage to serve first (default: the one with the fewest servers); servers "
        "move to the bottleneck stage on their own",
    )
    g.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        metavar="X",
        help="emulate a device X times slower: each compute holds the device X times the "
        "fastest it took on this machine (benchmarks; default 1)",
    )
    g.add_argument(
        "--swarm-audit",
        action="store_true",
        help="servers append the id of each micro-batch whose backward they applied to "
        "<state-dir>/stage-applied.log, trainers write the micro-batches they completed to "
        "<state-dir>/trainer-completed.log (tests check exactly-once with them)",
    )


def _add_join_limits(p: argparse.ArgumentParser) -> None:
    """When `join` stops, what data it reads, and how it reports."""
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop after N steps")
    p.add_argument(
        "--data-shard",
        type=int,
        default=None,
        metavar="N",
        help="read training shard N of 64 instead of the one the peer id picks (for "
        "experiments on fixed data; peers given the same shard draw the same batches)",
    )
    p.add_argument("--duration", type=positive_float, default=None, help="stop after S seconds")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text progress on stderr, or JSON lines on stdout (default: text)",
    )
    p.add_argument(
        "--progress-interval",
        type=positive_float,
        default=5.0,
        help="seconds between progress lines and progress records in the DHT (default: 5)",
    )
    p.add_argument(
        "--public-name",
        default="",
        metavar="NAME",
        help="a name the run's dashboard shows for this peer (at most 64 printable "
        "characters; published to everyone in the run). Default: none, the peer id is shown",
    )
    p.add_argument(
        "--join-timeout",
        type=positive_float,
        default=60.0,
        help="seconds to wait for the run's config in the DHT (default: 60)",
    )


def _add_status(sub: Subparsers) -> None:
    p = sub.add_parser(
        "status",
        help="what the DHT knows of a run: config, live peers, their rounds",
        description="Joins the DHT as a client only, prints the run's configuration, its live "
        "peers (heartbeats) with the outer round and state hash each advertises, and the "
        "current outer round. Exit code 1 if the run is unknown, 3 if no bootstrap answers.",
    )
    p.add_argument("--run", required=True, help="the run's name")
    p.add_argument(
        "--peers", type=address_list, required=True, help="bootstrap peers, HOST:PORT[,...]"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=commands.cmd_status)


def _add_dashboard(sub: Subparsers) -> None:
    p = sub.add_parser(
        "dashboard",
        help="a live web page of a run: peers, loss, throughput, events (no training)",
        description="Joins the DHT as a client only (no training, no torch), reads the run's "
        "config, heartbeats, progress records and state adverts every --poll seconds, and "
        "serves a page that updates live, with a JSON API (/api/run, /api/peers, /api/events, "
        "/api/history) for scripts. Prints the page's URL. Exit code 3 if no bootstrap answers.",
    )
    p.add_argument("--run", required=True, help="the run's name")
    p.add_argument(
        "--peers", type=address_list, required=True, help="bootstrap peers, HOST:PORT[,...]"
    )
    p.add_argument(
        "--listen",
        type=listen_address,
        default=Address("127.0.0.1", 8080),
        help="HOST:PORT the page is served on; port 0 lets the OS choose (default: "
        "127.0.0.1:8080). The page shows what the run's peers publish: serve it beyond "
        "loopback only where those may be seen",
    )
    p.add_argument(
        "--poll", type=positive_float, default=2.0, help="seconds between reads (default: 2)"
    )
    p.set_defaults(func=commands.cmd_dashboard)


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo",
        help="run a real multi-peer training run on this machine",
        description="Starts a `swarmd dht` bootstrap and several `swarmd join` peers on "
        "loopback, trains the built-in GPT on the built-in corpus with DiLoCo for a few "
        "minutes, SIGKILLs one peer and adds a new one midway, then prints a summary (loss "
        "start -> end, whether the survivors hold identical states, bytes sent vs "
        "data-parallel, peers joined/left). --transport-only runs the short transport demo.",
    )
    p.add_argument("--peers", type=positive_int, default=3, help="peer processes (default: 3)")
    p.add_argument("--duration", type=positive_float, default=150.0, help="seconds (default: 150)")
    p.add_argument(
        "--inner-steps",
        type=positive_int,
        default=25,
        help="DiLoCo H; DeMo: steps between group re-formations (default: 25)",
    )
    p.add_argument(
        "--algo",
        choices=ALGORITHMS,
        default="diloco",
        help="the run's algorithm (default: diloco); swarm: a 2-stage pipeline of 4 stage "
        "servers (unbalanced: one moves to the slow stage) and 2 trainers",
    )
    p.add_argument(
        "--transport-only",
        action="store_true",
        help="instead: relay a tensor through peers, ping, forged request (seconds)",
    )
    p.add_argument(
        "--dashboard",
        type=listen_address,
        default=Address("127.0.0.1", 8080),
        metavar="HOST:PORT",
        help="serve `swarmd dashboard` of the demo run here while it runs (default: "
        "127.0.0.1:8080; port 0 lets the OS choose)",
    )
    p.add_argument("--no-dashboard", action="store_true", help="run the demo without it")
    p.add_argument(
        "--tensor-mib",
        type=positive_int,
        default=64,
        help="transport demo: size of the relayed tensor in MiB (default: 64)",
    )
    p.set_defaults(func=commands.cmd_demo)


def _add_chaos(sub: Subparsers) -> None:
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
        "key=value figures. Exit code 1 if an invariant fails. --duration 600 is the soak. "
        "With --algo swarm the peers are stage servers of 3 stages and a trainer, and the "
        "schedule also kills every server of the middle stage, replaced by new peers: the "
        "invariants are then that the pipeline trains on, the stage is rebuilt once "
        "(CheckFree) and the loss recovers, nobody died unkilled, no traceback.",
    )
    p.add_argument("--peers", type=positive_int, default=6, help="peer processes (default: 6)")
    p.add_argument(
        "--duration",
        type=positive_float,
        default=300.0,
        help="seconds of chaos after all peers train (default: 300)",
    )
    p.add_argument("--seed", type=int, default=0, help="schedule seed (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="directory for JSONL, logs, report, PNG")
    p.add_argument(
        "--schedule", type=Path, default=None, help="JSON schedule instead of a seeded one"
    )
    p.add_argument(
        "--inner-steps",
        type=positive_int,
        default=10,
        help="DiLoCo H; DeMo: steps between group re-formations (default: 10)",
    )
    p.add_argument(
        "--algo", choices=ALGORITHMS, default="diloco", help="the run's algorithm (default: diloco)"
    )
    p.add_argument(
        "--byzantine",
        action="store_true",
        help="also swap peers for liars for a while (a declared weight of 1e9, or a flipped or "
        "x100 update: swarmd/node/chaos/byzantine.py); a liar that gave evidence must be "
        "banned by the others (DiLoCo runs)",
    )
    p.add_argument(
        "--resume-bound",
        type=positive_float,
        default=90.0,
        help="seconds a restarted peer may take to train again (default: 90)",
    )
    p.add_argument(
        "--liveness-bound",
        type=positive_float,
        default=90.0,
        help="longest wait for an outer round while a group can form (default: 90)",
    )
    p.set_defaults(func=commands.cmd_chaos)


#: The sub-commands after `version`, in the order `swarmd --help` lists them.
_BUILDERS: tuple[Callable[[Subparsers], None], ...] = (
    add_identity,
    _add_ping,
    _add_serve,
    _add_dht,
    _add_join,
    add_run,
    _add_status,
    add_export,
    _add_dashboard,
    _add_demo,
    _add_chaos,
    add_sim,
)
