"""DHT store/get latency and success with churn: N nodes, M stores, F of the nodes killed.

    python benchmarks/dht.py --nodes 64 --ops 200 --kill-fraction 0.2 [--mode processes|loop]

processes (default): every node is its own `swarmd`-style process (a DHT-only node, no torch)
on 127.0.0.1; the driver asks random nodes, over a small control RPC, to store or get, and each
node times its own operation (so the figures are the DHT's, not the control hop's). Killed
nodes get SIGKILL. loop: all nodes run in the driver's one trio loop (one core, one GIL), and
killed nodes' servers are shut down.

M random keys are stored, each from a random node; then F·N random nodes are killed; then M
gets of random stored keys are issued from random surviving nodes, one at a time. A get
succeeds if it returns exactly the stored value.

Last line: nodes=… mode=… store_p50_ms=… get_p50_ms=… get_p99_ms=… success=…
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio

from swarmd.node.dht import DHTNode, open_dht
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity

SERVICE = "swarmd.bench.DHT"
STORE = rpc.method_path(SERVICE, "Store")
GET = rpc.method_path(SERVICE, "Get")
TTL_S = 600.0
TRANSPORT = rpc.TransportConfig(max_concurrent_rpcs=16, max_inflight_calls=32)


async def timed_store(node: DHTNode, key: str, value: bytes) -> dict[str, Any]:
    start = time.perf_counter()
    replicas = await node.store(key, value, time.time() + TTL_S)
    return {"ms": (time.perf_counter() - start) * 1000, "replicas": replicas}


async def timed_get(node: DHTNode, key: str) -> dict[str, Any]:
    start = time.perf_counter()
    found = await node.get_value(key)
    ms = (time.perf_counter() - start) * 1000
    return {"ms": ms, "value": found.value.hex() if found else None}


def control_service(node_ref: list[DHTNode]) -> rpc.Service:
    async def store(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        args = json.loads(req.payload)
        out = await timed_store(node_ref[0], args["key"], bytes.fromhex(args["value"]))
        return pb.PingResponse(payload=json.dumps(out).encode())

    async def get(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        args = json.loads(req.payload)
        return pb.PingResponse(
            payload=json.dumps(await timed_get(node_ref[0], args["key"])).encode()
        )

    return rpc.Service(
        SERVICE, [rpc.unary("Store", pb.PingRequest, store), rpc.unary("Get", pb.PingRequest, get)]
    )


async def child(peers: list[str]) -> None:
    node_ref: list[DHTNode] = []
    async with open_dht(
        Identity.generate(),
        bootstrap=peers,
        transport=TRANSPORT,
        extra_services=[control_service(node_ref)],
    ) as (node, server):
        node_ref.append(node)
        print(json.dumps({"address": str(server.address), "pid": os.getpid()}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


@dataclass
class Figures:
    store_ms: list[float]
    get_ms: list[float]
    successes: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_ops(
    n: int,
    ops: int,
    kill_fraction: float,
    store: Callable[[int, str, bytes], Awaitable[dict[str, Any]]],
    get: Callable[[int, str], Awaitable[dict[str, Any]]],
    kill: Callable[[list[int]], Awaitable[None]],
    rng: random.Random,
) -> Figures:
    stored: dict[str, bytes] = {}
    store_ms: list[float] = []
    for i in range(ops):
        key, value = f"bench/{i}/{rng.random()}", rng.randbytes(rng.randint(16, 256))
        out = await store(rng.randrange(n), key, value)
        store_ms.append(out["ms"])
        stored[key] = value
    killed = rng.sample(range(n), round(kill_fraction * n))
    await kill(killed)
    alive = [i for i in range(n) if i not in set(killed)]
    get_ms: list[float] = []
    successes = 0
    keys = list(stored)
    for _ in range(ops):
        key = rng.choice(keys)
        out = await get(rng.choice(alive), key)
        get_ms.append(out["ms"])
        successes += out["value"] == stored[key].hex()
    return Figures(store_ms, get_ms, successes)


def start_child(peers: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", ",".join(peers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"node process {proc.pid} died before listening")
    return proc, json.loads(line)["address"]


async def bench_processes(args: argparse.Namespace, rng: random.Random) -> Figures:
    procs: list[subprocess.Popen[str]] = []
    addresses: list[str] = []
    try:
        proc, address = start_child([])
        procs.append(proc)
        addresses.append(address)
        while len(procs) < args.nodes:
            batch = min(8, args.nodes - len(procs))
            known = list(addresses)

            def start_one(known: list[str] = known) -> tuple[subprocess.Popen[str], str]:
                return start_child(rng.sample(known, min(3, len(known))))

            results: list[tuple[subprocess.Popen[str], str]] = []

            async def one(results: list[tuple[subprocess.Popen[str], str]] = results) -> None:
                results.append(await trio.to_thread.run_sync(start_one))

            async with trio.open_nursery() as nursery:
                for _ in range(batch):
                    nursery.start_soon(one)
            for proc, address in results:
                procs.append(proc)
                addresses.append(address)
        print(f"started {len(procs)} node processes; settling {args.settle}s", file=sys.stderr)
        await trio.sleep(args.settle)
        client = rpc.RpcClient(Identity.generate(), rpc.TransportConfig())

        async def call(i: int, path: str, payload: dict[str, str]) -> dict[str, Any]:
            try:
                resp = await client.unary(
                    addresses[i],
                    path,
                    pb.PingRequest(payload=json.dumps(payload).encode()),
                    pb.PingResponse,
                    timeout=30,
                )
            except rpc.RpcError as exc:
                print(f"control call to node {i} failed: {exc}", file=sys.stderr)
                return {"ms": float("nan"), "value": None}
            out: dict[str, Any] = json.loads(resp.payload)
            return out

        async def store(i: int, key: str, value: bytes) -> dict[str, Any]:
            return await call(i, STORE, {"key": key, "value": value.hex()})

        async def get(i: int, key: str) -> dict[str, Any]:
            return await call(i, GET, {"key": key})

        async def kill(indices: list[int]) -> None:
            for i in indices:
                procs[i].send_signal(signal.SIGKILL)
            for i in indices:
                procs[i].wait()

        try:
            return await run_ops(args.nodes, args.ops, args.kill_fraction, store, get, kill, rng)
        finally:
            client.close()
    finally:
        for proc in procs:
            if proc.poll() is None and proc.stdin:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def bench_loop(args: argparse.Namespace, rng: random.Random) -> Figures:
    nodes: list[DHTNode] = []
    scopes: list[trio.CancelScope] = []
    addresses: list[str] = []
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:

        async def host(
            peers: list[str], task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
        ) -> None:
            with trio.CancelScope() as scope:
                async with open_dht(Identity.generate(), bootstrap=peers, transport=TRANSPORT) as (
                    node,
                    server,
                ):
                    nodes.append(node)
                    scopes.append(scope)
                    addresses.append(str(server.address))
                    task_status.started()
                    await trio.sleep_forever()

        for _ in range(args.nodes):
            await nursery.start(host, rng.sample(addresses, min(3, len(addresses))))
        await trio.sleep(args.settle)

        async def store(i: int, key: str, value: bytes) -> dict[str, Any]:
            return await timed_store(nodes[i], key, value)

        async def get(i: int, key: str) -> dict[str, Any]:
            return await timed_get(nodes[i], key)

        async def kill(indices: list[int]) -> None:
            for i in indices:
                scopes[i].cancel()
            await trio.sleep(0.1)

        figures = await run_ops(args.nodes, args.ops, args.kill_fraction, store, get, kill, rng)
        nursery.cancel_scope.cancel()
        del stack
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--kill-fraction", type=float, default=0.2)
    parser.add_argument("--mode", choices=["processes", "loop"], default="processes")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between join and ops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", metavar="PEERS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        trio.run(child, [p for p in args.child.split(",") if p])
        return
    if args.nodes < 2 or args.ops < 1 or not 0 <= args.kill_fraction < 1:
        parser.error("need --nodes >= 2, --ops >= 1 and 0 <= --kill-fraction < 1")
    rng = random.Random(args.seed)
    bench = bench_processes if args.mode == "processes" else bench_loop
    start = time.perf_counter()
    figures = trio.run(bench, args, rng)
    elapsed = time.perf_counter() - start
    valid_get = [ms for ms in figures.get_ms if ms == ms]
    print(
        f"stores: mean {statistics.fmean(figures.store_ms):.1f} ms; gets: mean "
        f"{statistics.fmean(valid_get):.1f} ms, max {max(valid_get):.1f} ms; total {elapsed:.0f}s",
        file=sys.stderr,
    )
    print(
        f"nodes={args.nodes} mode={args.mode} ops={args.ops} kill_fraction={args.kill_fraction} "
        f"store_p50_ms={percentile(figures.store_ms, 50):.1f} "
        f"get_p50_ms={percentile(valid_get, 50):.1f} get_p99_ms={percentile(valid_get, 99):.1f} "
        f"success={figures.successes / args.ops:.3f}"
    )


if __name__ == "__main__":
    main()
