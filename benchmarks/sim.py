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

SWARM is not simulated yet (stage servers and trainers need the tensor plane's SWARM
services and a stage compute model on the simulator): swarm_efficiency prints nan.

Last line: diloco_peers= diloco_rounds= diloco_averaged_share= diloco_form_s= diloco_spread=
diloco_loss_ratio= diloco_useful_ratio= diloco_bytes_per_peer_round= diloco_wall_s=
diloco_bans= diloco_rss_gib= dht_nodes= dht_success=
dht_median_hops= dht_wall_s= swarm_efficiency=
"""

from __future__ import annotations

import argparse
import logging
import resource

from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.sim.dht import DhtScenario, run_dht
from swarmd.node.sim.rounds import RoundsScenario, run_rounds
from swarmd.node.sim.scenario import rounds_figures, rounds_summary


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
        "--grouping",
        choices=("flat", "grid"),
        default="flat",
        help="flat: the daemon's matchmaking; grid: issue 46's levels (averaging/grid.py)",
    )
    parser.add_argument("--dht-nodes", type=int, default=10_000)
    parser.add_argument("--killed", type=float, default=0.3, help="share of DHT nodes killed")
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=("dht", "diloco"), action="append", default=[])
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
            grouping=args.grouping,
            matchmaking=MatchmakingConfig(target_group_size=args.target),
            seed=args.seed,
        )
        print(
            f"DiLoCo: {scenario.peers} peers, {scenario.rounds} rounds, target {args.target}, "
            f"{args.grouping} groups"
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
    figures["swarm_efficiency"] = "nan"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
