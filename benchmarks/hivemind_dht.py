"""hivemind's DHT under `benchmarks/dht.py`'s workload: the peer's figure for issue 48's DHT
store and get latencies, on the same machine in the same hour.

Runs in hivemind's own environment (see benchmarks/hivemind_allreduce.py):

    /tmp/hm/bin/python benchmarks/hivemind_dht.py --nodes 64 --ops 200 --kill-fraction 0.2

Each node is a hivemind.DHT (its own process and libp2p daemon) on 127.0.0.1, every one
bootstrapped from the first. M random keys are stored, each from a random node; then F·N
random nodes are shut down; then M gets of random stored keys are issued from random surviving
nodes, one at a time. Each operation is timed inside the node's own process (as dht.py times
its nodes'), so the figures are the DHT's, not the driver's pipe to it. A get succeeds if it
returns exactly the stored value. hivemind's defaults: 5 replicas a key (swarmd's too since
2026-11-30, `DHTConfig.replicas`).

Last line: nodes=… mode=hivemind ops=… kill_fraction=… store_p50_ms=… get_p50_ms=…
get_p99_ms=… success=…
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

TTL_S = 600.0


async def _timed_store(_dht: Any, node: Any, key: str, value: bytes) -> tuple[float, bool]:
    from hivemind.utils import get_dht_time

    start = time.perf_counter()
    ok = await node.store(key, value, get_dht_time() + TTL_S)
    return (time.perf_counter() - start) * 1000, bool(ok)


async def _timed_get(_dht: Any, node: Any, key: str) -> tuple[float, bytes | None]:
    start = time.perf_counter()
    found = await node.get(key, latest=True)
    ms = (time.perf_counter() - start) * 1000
    return ms, (found.value if found is not None else None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--kill-fraction", type=float, default=0.2)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between join and ops")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import functools

    import hivemind

    rng = random.Random(args.seed)
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    first = hivemind.DHT(host_maddrs=loopback, start=True)
    boot = [str(a) for a in first.get_visible_maddrs()]
    nodes = [first]
    for i in range(1, args.nodes):
        nodes.append(hivemind.DHT(initial_peers=boot, host_maddrs=loopback, start=True))
        if (i + 1) % 16 == 0:
            print(f"  {i + 1} nodes up", flush=True)
    time.sleep(args.settle)
    stored: dict[str, bytes] = {}
    store_ms: list[float] = []
    for i in range(args.ops):
        key, value = f"bench/{i}/{rng.random()}", rng.randbytes(rng.randint(16, 256))
        node = nodes[rng.randrange(args.nodes)]
        ms, _ = node.run_coroutine(functools.partial(_timed_store, key=key, value=value))
        store_ms.append(ms)
        stored[key] = value
    killed = set(rng.sample(range(args.nodes), round(args.kill_fraction * args.nodes)))
    for i in killed:
        nodes[i].shutdown()
    alive = [i for i in range(args.nodes) if i not in killed]
    get_ms: list[float] = []
    successes = 0
    keys = list(stored)
    for _ in range(args.ops):
        key = rng.choice(keys)
        node = nodes[rng.choice(alive)]
        ms, value = node.run_coroutine(functools.partial(_timed_get, key=key))
        get_ms.append(ms)
        successes += value == stored[key]
    for i in alive:
        nodes[i].shutdown()
    print(
        f"nodes={args.nodes} mode=hivemind ops={args.ops} kill_fraction={args.kill_fraction} "
        f"store_p50_ms={percentile(store_ms, 50):.1f} "
        f"get_p50_ms={percentile(get_ms, 50):.1f} get_p99_ms={percentile(get_ms, 99):.1f} "
        f"success={successes / args.ops:.3f}"
    )


if __name__ == "__main__":
    main()
