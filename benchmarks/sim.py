"""The swarm in virtual time (issue 45): figures at a scale real processes cannot reach here.

    python benchmarks/sim.py [--diloco-peers 1000] [--rounds 20] [--dht-nodes 10000] [--seed 0]

DiLoCo: N peers (speeds log-normal, sigma 0.5) on the simulator's network (swarmd/node/sim:
per-link RTT log-uniform 10-300 ms, 100 Mbit/s links), each round H=50 inner steps charged as
virtual time, then the real `form_group` (target group 16, gather 5 s) and the real all-reduce
(Averager, int8, proofs on) of each peer's 100,000-value pseudo-gradient on a synthetic
quadratic (swarmd/node/sim/workload.py) and the real outer Nesterov step; 5 % of the peers
replaced as each new round begins; ``--stallers`` identities that heartbeat and never join.
Reported: share of peer-rounds averaged in a group, median group formation time (virtual),
the honest states' spread after the last round (relative RMS; 0: one state line), their loss
against one group of everybody at equal rounds, the share of the peers' time spent on inner
steps that then averaged, bytes sent per peer-round, wall time and peak RSS.

DHT: N real DHTNodes joined over a virtual minute; keys stored, 30 % of the nodes killed,
each key read once by a random live node: success and median hops.

SWARM: S stages, N stage servers (speeds log-normal, sigma 0.5; preempted after an
exponential lifetime, mean an hour, each replaced a minute later by a new server) and T
trainers, in virtual time: the real trainer routing and server rebalancing against modelled
stage servers (swarmd/node/sim/swarm.py says what is modelled). Reported: micro-batches
completed against the ideal (every live server's compute spread perfectly over the stages),
with rebalancing and, on the same seed and trace, without (SWARM's paper: 95.8% and 82.7%).

Last line: diloco_peers= diloco_rounds= diloco_averaged_share= diloco_form_s= diloco_spread=
diloco_loss_ratio= diloco_useful_ratio= diloco_bytes_per_peer_round= diloco_wall_s=
diloco_bans= diloco_rss_gib= dht_nodes= dht_success=
dht_median_hops= dht_wall_s= swarm_efficiency= swarm_moves= swarm_failed= swarm_latency_s=
swarm_wall_s= swarm_static_efficiency= ...
"""

from __future__ import annotations

import argparse
import logging
import resource

from swarmd.node.algorithms.swarm.config import SwarmConfig
from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.sim.dht import DhtScenario, run_dht
from swarmd.node.sim.rounds import RoundsScenario, run_rounds
from swarmd.node.sim.scenario import rounds_figures, rounds_summary, swarm_figures, swarm_summary
from swarmd.node.sim.swarm import run_swarm
from swarmd.node.sim.swarm_spec import SwarmScenario, without_rebalancing


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diloco-peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--target", type=int, default=16, help="target group size")
    parser.add_argument("--churn", type=float, default=0.05)
    parser.add_argument("--stallers", type=int, default=0, help="heartbeat, never join")
    parser.add_argument(
        "--inner-steps", type=int, default=50, help="H (a cap on steps when --inner-s is set)"
    )
    parser.add_argument("--step-s", type=float, default=0.1, help="virtual s a step, speed 1")
    parser.add_argument(
        "--inner-s", type=float, default=0.0, help="virtual s of steps a round (0: H steps)"
    )
    parser.add_argument(
        "--grouping",
        choices=("flat", "grid"),
        default="flat",
        help="flat: the daemon's matchmaking; grid: issue 46's levels (averaging/grid.py)",
    )
    parser.add_argument("--dht-nodes", type=int, default=10_000)
    parser.add_argument("--killed", type=float, default=0.3, help="share of DHT nodes killed")
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--swarm-stages", type=int, default=8)
    parser.add_argument("--swarm-servers", type=int, default=400)
    parser.add_argument("--swarm-trainers", type=int, default=100)
    parser.add_argument("--swarm-inflight", type=int, default=16, help="micro-batches a trainer")
    parser.add_argument("--swarm-duration", type=float, default=1800.0, help="virtual seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=("dht", "diloco", "swarm"), action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    figures: dict[str, str] = {}

    def progress(line: str) -> None:
        print(f"  {line}", flush=True)

    if "diloco" not in args.skip:
        scenario = RoundsScenario(
            peers=args.diloco_peers,
            rounds=args.rounds,
            params=args.params,
            churn=args.churn,
            stallers=args.stallers,
            inner_steps=args.inner_steps,
            step_s=args.step_s,
            inner_s=args.inner_s,
            grouping=args.grouping,
            matchmaking=MatchmakingConfig(target_group_size=args.target),
            seed=args.seed,
        )
        print(
            f"DiLoCo: {scenario.peers} peers, {scenario.rounds} rounds, target {args.target}, "
            f"{args.grouping} groups, H {args.inner_steps}"
            + (f", rounds of {args.inner_s:g} virtual s" if args.inner_s else "")
        )
        r = run_rounds(scenario, progress)
        print(f"  {rounds_summary(r)}")
        figures |= rounds_figures(r) | {"diloco_rss_gib": f"{rss_gib():.2f}"}
    if "dht" not in args.skip:
        dht = DhtScenario(nodes=args.dht_nodes, killed=args.killed, gets=args.gets, seed=args.seed)
        print(f"DHT: {dht.nodes} nodes, {dht.killed:.0%} killed, {dht.gets} gets")
        d = run_dht(dht, progress)
        print(
            f"  {d.found}/{d.gets} found, median hops {d.median_hops:g}, p90 {d.p90_hops:g}, "
            f"{d.calls} calls, {d.virtual_s:.0f}s virtual in {d.wall_s:.0f}s"
        )
        figures |= {
            "dht_nodes": str(d.nodes),
            "dht_success": f"{d.success:.4f}",
            "dht_median_hops": f"{d.median_hops:g}",
            "dht_wall_s": f"{d.wall_s:.1f}",
        }
    if "swarm" not in args.skip:
        swarm = SwarmScenario(
            servers=args.swarm_servers,
            trainers=args.swarm_trainers,
            duration_s=args.swarm_duration,
            warmup_s=args.swarm_duration / 6,
            swarm=SwarmConfig(stages=args.swarm_stages, inflight=args.swarm_inflight),
            seed=args.seed,
        )
        for label, spec, prefix in (
            ("with rebalancing", swarm, "swarm"),
            ("without rebalancing", without_rebalancing(swarm), "swarm_static"),
        ):
            print(f"SWARM {label}: {args.swarm_stages} stages, {args.swarm_servers} servers")
            w = run_swarm(spec, progress)
            print(f"  {swarm_summary(w)}")
            figures |= swarm_figures(w, prefix)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
