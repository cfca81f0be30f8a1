"""`swarmd sim`: the simulator's command (swarmd/node/sim): its options and what it prints.

Last line: ``seeds=... failed=... <the kind's figures> log_hash=...`` (for a sweep, the
figures and hash of its last seed); exit code 1 if any seed broke an invariant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from swarmd.node.cli.options import EXIT_OK, EXIT_USAGE, CliError, positive_int

EXIT_BROKEN = 1

EXAMPLE = """\
kind = "dht"
nodes = 1000        # DHT nodes, each a real DHTNode
killed = 0.3        # share killed after the keys are stored
gets = 1000         # keys stored, then each read once by a live node
join_window_s = 60  # virtual seconds over which the nodes join
settle_s = 10       # virtual seconds between the killing and the reads
seed = 0

[network]
rtt_min_ms = 10     # each link's round trip: log-uniform between these
rtt_max_ms = 300
loss = 0.0          # share of messages lost
clock_skew_s = 0    # each host's wall clock off by up to this (signatures: 30 s window)

[invariants]
min_success = 0.99
max_median_hops = 4

or rounds of group formation (DiLoCo's matchmaking) among many peers:

kind = "matchmaking"
peers = 200
rounds = 3
arrival_spread_s = 2  # peers become ready over this many virtual seconds

[matchmaking]
target_group_size = 16
gather_s = 5

[invariants]
max_alone_share = 1.0 # share of peers a round that may get no group

or DiLoCo's rounds (inner steps as virtual time, group formation, the real all-reduce):

kind = "diloco"
peers = 100
rounds = 5
params = 10000        # values averaged a round
codec = "int8"
inner_steps = 50
step_s = 0.1          # virtual seconds an inner step takes on a speed-1 peer
speed_sigma = 0.5     # log-normal spread of peer speeds
churn = 0.05          # share of peers replaced as each new round begins
stallers = 0          # identities that heartbeat (counted in group targets), never join
aggregation = "mean"  # or "trimmed_mean", "centered_clip"

[[faults]]            # scheduled from the seed: kill, partition, slow or liar
at_round = 3
kind = "liar"         # lie: "weight" (1e9 samples), "scale100" or "signflip"
share = 0.05
rounds = 2

[matchmaking]
target_group_size = 16

[invariants]
min_averaged_share = 0.5
max_spread = 0.01     # the honest states' spread after the last round (0: one line)
max_loss_ratio = 1.05 # their loss against one group of everybody

or a SWARM pipeline (the real trainer routing and server rebalancing, modelled servers):

kind = "swarm"
servers = 400         # stage servers, each one device taking calls in order
trainers = 100
duration_s = 1800     # virtual seconds; the first warmup_s are not measured
warmup_s = 300
speed_sigma = 0.5     # log-normal spread of server speeds
stage_s = 1.0         # a stage's forward + backward of a micro-batch at speed 1
activation_bytes = 1048576
stage_bytes = 209715200 # a stage's state, downloaded to take or move to it
lifetime_s = 3600     # mean time to preemption (exponential); a replacement joins
downtime_s = 60       # this many seconds later
liars = 0             # first servers that answer every call x(-20)

[swarm]               # the run's SwarmConfig
stages = 8
inflight = 16
rebalance_s = 30      # 0: servers never move
rebalance_gain = 1.25
audit = 0.125         # share of hops a trainer asks again of another server

[invariants]
min_efficiency = 0.5  # micro-batches against the ideal (the live compute spread evenly)
max_failed = 0        # micro-batches given up
max_poisoned = 1000   # micro-batches a liar answered a call of

or real `swarmd join` peers (the whole lifecycle, the run's real model) with faults:

kind = "peers"
peers = 4             # the first creates the run; all join through one bootstrap node
rounds = 20           # each trains this many rounds (--max-steps = rounds x inner_steps)
step_s = 0.1          # virtual seconds an inner step takes on a speed-1 peer
speed_sigma = 0.0

[run]                 # the run config, as --create-run reads it (default: a tiny model)
inner_steps = 5
min_group_size = 2

[[faults]]            # at a virtual second: kill, stop (SIGTERM), pause (SIGSTOP),
at_s = 0              # resume (SIGCONT), join, cut, heal
cut = [[0, 1], [2, 3]]  # peer indices on each side (joiners are numbered after)
[[faults]]
at_s = 60
heal = true

[churn]               # lifetimes from the seed: killed after an exponential lifetime
lifetime_s = 0        # of this mean (0: no churn) unless done first; a newcomer joins
replace_s = 10        # this long after each death; nobody dies of churn after until_s
until_s = 300

[invariants]
one_state = true      # the living peers hold one state at the last round all reached
min_averaged_share = 0.5
"""


def add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="the swarm on one machine in virtual time: a scenario, a seed, a replayable run",
        description="Runs a scenario on the simulator: real swarmd components (today the DHT, "
        "matchmaking and DiLoCo's all-reduce: real nodes, records, signed requests, lookups, "
        "group formation, parts, commitments and proofs; SWARM's trainer routing and server "
        "rebalancing against modelled stage servers) "
        "on an in-memory network with "
        "per-link latency, loss, dead hosts and partitions, in virtual time (trio's MockClock), "
        "so that thousands of nodes run on one core. One seed replays a run exactly: the last "
        "line's log_hash is equal on every run of a seed. --sweep K runs K seeds and prints "
        "each failing seed with the invariant it broke. Without SCENARIO: a 1,000-node DHT, "
        "30%% killed, 1,000 gets. A scenario file:\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", nargs="?", type=Path, default=None, help="scenario TOML file")
    p.add_argument("--seed", type=int, default=None, help="seed (default: the scenario's)")
    p.add_argument("--sweep", type=positive_int, default=1, help="run K seeds from --seed")
    p.add_argument("--out", type=Path, default=None, help="write OUT/sim.jsonl, one line a seed")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    from swarmd.node.sim.scenario import ScenarioError, load_scenario, sweep

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    first = scenario.spec.seed if args.seed is None else args.seed
    if args.log_level.upper() != "DEBUG":
        # Thousands of nodes each saying it joined is noise, not progress.
        # So is every simulated peer saying what state it serves or downloaded.
        for name in ("dht", "matchmaking", "statesync", "daemon", "allreduce", "join"):
            logging.getLogger(f"swarmd.{name}").setLevel(logging.WARNING)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    out = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        out = (args.out / "sim.jsonl").open("w")
    failed: list[int] = []
    last = None
    try:
        for outcome in sweep(scenario, first, args.sweep, progress):
            last = outcome
            verdict = "ok" if not outcome.broken else "FAILED: " + "; ".join(outcome.broken)
            print(
                f"seed {outcome.seed}: {outcome.summary}, log {outcome.log_hash}: {verdict}",
                flush=True,
            )
            if outcome.broken:
                failed.append(outcome.seed)
            if out is not None:
                row = {"seed": outcome.seed, "broken": outcome.broken, **outcome.row}
                out.write(json.dumps(row) + "\n")
    finally:
        if out is not None:
            out.close()
    assert last is not None
    if failed:
        print(f"failing seeds (replay with --seed N): {' '.join(map(str, failed))}")
    shown = " ".join(f"{k}={v}" for k, v in last.figures.items())
    print(f"seeds={args.sweep} failed={len(failed)} {shown} log_hash={last.log_hash}")
    return EXIT_BROKEN if failed else EXIT_OK
