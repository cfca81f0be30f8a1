"""The swarm in virtual time (issue 45): figures at a scale real processes cannot reach here.

    python benchmarks/sim.py [--dht-nodes 10000] [--killed 0.3] [--gets 1000] [--seed 0]

DHT: N real `DHTNode`s (real records, real signatures on every request, real lookups) on the
simulator's in-memory network (swarmd/node/sim: per-link RTT log-uniform 10-300 ms), joined
over a virtual minute; keys are stored, a share of the nodes is killed (they stop answering),
and each key is read once by a random live node. Success is the share of reads that returned
the stored value; hops count answers between the reader and the first node holding it.

Only the DHT is simulated so far: the DiLoCo (1,000 peers) and SWARM figures the issue names
need the runtime seam for training peers, and this script will grow them.

Last line: dht_nodes=... dht_killed=... dht_success=... dht_median_hops=... dht_p90_hops=...
dht_calls=... dht_virtual_s=... dht_wall_s=... dht_rss_gib=...
"""

from __future__ import annotations

import argparse
import resource

from swarmd.node.sim.dht import DhtScenario, run_dht


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dht-nodes", type=int, default=10_000)
    parser.add_argument("--killed", type=float, default=0.3, help="share of nodes killed")
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scenario = DhtScenario(nodes=args.dht_nodes, killed=args.killed, gets=args.gets, seed=args.seed)
    print(f"DHT: {scenario.nodes} nodes, {scenario.killed:.0%} killed, {scenario.gets} gets")
    report = run_dht(scenario)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"dht_nodes={report.nodes} dht_killed={report.killed} dht_success={report.success:.4f} "
        f"dht_median_hops={report.median_hops:g} dht_p90_hops={report.p90_hops:g} "
        f"dht_calls={report.calls} dht_virtual_s={report.virtual_s:.1f} "
        f"dht_wall_s={report.wall_s:.1f} dht_rss_gib={rss_gib:.2f}"
    )


if __name__ == "__main__":
    main()
