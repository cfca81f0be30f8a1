"""A run under each of issue 31's floods, next to the same run without one.

Group floods: P peer processes (tests/harness/allreduce_peer.py: swarmd's Averager and a
training peer's PutTensor, serving over the real transport) time R all-reduce rounds of M
values with no flood, then R rounds under each flood in turn, the stranger in its own process
at nice 19:

- slowloris: IDLE silent TCP connections per peer to its bulk port from 127.0.0.2,
  reopened as they close (item 1);
- memory: 50 calls at a time from fresh identities on 127.0.0.2-5, each declaring a 1.5 GiB
  tensor to PutPart or PutTensor over bulk or gRPC and sending nothing more (item 2);
- rate: pings as fast as answered, 8 in flight per peer, half from one identity and half from
  a fresh identity per call (item 4).

DHT flood (item 3): three `swarmd dht` processes; an honest node's store+get time, calm and
while a stranger on 127.0.0.2 stores with fresh identities until refused and then pings with
300 identities claiming ports where nothing listens.

A row per flood: median round (or store+get) time calm and flooded, and the growth of the
processes' largest resident set (sampled every 50 ms) over the calm one.

Last line: worst_step_ratio=… worst_rss_growth_mb=… and each flood's ratio and growth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._dht_flood import DhtFlood, Target
from benchmarks._memory_flood import MemoryFlood
from benchmarks._rate_flood import PingFlood
from swarmd.node.averaging.exchange import PUT_PART
from swarmd.node.dht import open_dht
from swarmd.node.peer.service import PUT_TENSOR
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "harness" / "allreduce_peer.py"


def bulk_port(address: str) -> int:
    async def ask() -> int:
        client = rpc.RpcClient(Identity.generate())
        try:
            info = await client.unary(
                address, rpc.GET_BULK_INFO, pb.BulkInfoRequest(), pb.BulkInfo, timeout=5
            )
        finally:
            client.close()
        return int(info.port)

    return trio.run(ask)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # peak resident set
            return int(line.split()[1]) / 1024
    return 0.0


class Slowloris(multiprocessing.Process):
    """The stranger, in its own process at the lowest CPU priority: on this 2-core machine it
    shares the peers' cores, where a real one would bring its own (in a thread of this process
    its reconnect loop took CPU from the peers and doubled their round time by itself)."""

    def __init__(self, ports: list[int], per_port: int) -> None:
        super().__init__(daemon=True)
        self.ports, self.per_port = ports, per_port
        self.halt = multiprocessing.Event()
        self.count = multiprocessing.Value("i", 0)

    @property
    def reopened(self) -> int:
        return int(self.count.value)

    @staticmethod
    def _open(port: int) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return sock

    def run(self) -> None:
        os.nice(19)
        conns = [(p, self._open(p)) for p in self.ports for _ in range(self.per_port)]
        while not self.halt.is_set():
            for i, (port, sock) in enumerate(conns):
                try:
                    closed = sock is None or sock.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    if sock is not None:
                        sock.close()
                    conns[i] = (port, self._open(port))
                    with self.count.get_lock():
                        self.count.value += 1
            time.sleep(0.02)
        for _, sock in conns:
            if sock is not None:
                sock.close()


class RssSampler:
    """The largest VmRSS each process reaches while it runs (a thread polling /proc)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak = pids, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            self.peak = max(self.peak, int(line.split()[1]) / 1024)


def rounds(
    peers: list[subprocess.Popen[str]], members: list[list[str]], tag: str, n: int
) -> tuple[list[float], int]:
    times, dropped = [], 0
    for r in range(n):
        for p in peers:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"round": f"{tag}{r}", "members": members}) + "\n")
            p.stdin.flush()
        outs: list[dict[str, Any]] = []
        for p in peers:
            assert p.stdout is not None
            outs.append(json.loads(p.stdout.readline()))
        times.append(max(float(o["seconds"]) for o in outs))
        dropped += sum(len(o["dropped"]) for o in outs)
        print(f"{tag} round {r}: {times[-1]:.3f} s, dropped {[o['dropped'] for o in outs]}")
    return times, dropped


def _attacker(name: str, infos: list[dict[str, Any]], idle: int) -> Any:
    addresses = [str(i["address"]) for i in infos]
    if name == "slowloris":
        return Slowloris([bulk_port(a) for a in addresses], idle)
    if name == "memory":
        return MemoryFlood([(a, p) for a in addresses for p in (PUT_PART, PUT_TENSOR)], 50)
    return PingFlood(addresses)


def group_rows(args: argparse.Namespace, floods: list[str]) -> list[dict[str, Any]]:
    numel = int(args.mvalues * 1e6)
    rows: list[dict[str, Any]] = []
    with TemporaryDirectory(prefix="swarmd-flood-") as out:
        cfg = {"numel": numel, "out_dir": out}
        cmd = [[sys.executable, str(PEER), json.dumps({**cfg, "index": i})] for i in range(3)]
        popen = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "cwd": ROOT}
        peers = [subprocess.Popen(c, **popen) for c in cmd[: args.peers]]  # type: ignore[call-overload]
        try:
            infos = [json.loads(p.stdout.readline()) for p in peers]
            members = sorted([str(i["peer_id"]), str(i["address"])] for i in infos)
            rounds(peers, members, "warm", 1)
            pids = [p.pid for p in peers]
            for name in floods:
                # Each flood against calm rounds just before it: buffers and the heap keep
                # growing for a while, so a first calm baseline would charge later floods.
                with RssSampler(pids) as calm_rss:
                    calm, _ = rounds(peers, members, f"calm-{name}-", args.rounds)
                attacker = _attacker(name, infos, args.idle)
                attacker.start()
                time.sleep(1.0)
                with RssSampler(pids) as rss:
                    flood, dropped = rounds(peers, members, name, args.rounds)
                attacker.halt.set()
                attacker.join(timeout=30)
                calm_s, flood_s = statistics.median(calm), statistics.median(flood)
                rows.append(
                    {
                        "flood": name,
                        "calm_s": calm_s,
                        "flood_s": flood_s,
                        "ratio": flood_s / calm_s,
                        "rss_growth_mb": rss.peak - calm_rss.peak,
                        "dropped": dropped,
                    }
                )
                print(rows[-1], flush=True)
        finally:
            for p in peers:
                p.kill()
                p.wait()
    return rows


async def _honest_ops(boot: str, n: int, tag: str) -> list[float]:
    """n store-then-get pairs by a fresh honest node, seconds each."""
    times = []
    async with open_dht(Identity.generate(), bootstrap=[boot]) as (node, _):
        for i in range(n):
            start = time.perf_counter()
            ok = await node.store(f"{tag}/{i}", b"v%d" % i, time.time() + 60)
            value = await node.get_value(f"{tag}/{i}")
            if not ok or value is None or value.value != b"v%d" % i:
                raise SystemExit(f"an honest store/get failed under the flood ({tag} {i})")
            times.append(time.perf_counter() - start)
    return times


def dht_row(args: argparse.Namespace) -> dict[str, Any]:
    with TemporaryDirectory(prefix="swarmd-flood-dht-") as out:
        cmd = [sys.executable, "-m", "swarmd.node.cli", "dht", "--state-dir"]
        popen = {"stdout": subprocess.PIPE, "text": True, "cwd": ROOT}
        daemons = [subprocess.Popen([*cmd, f"{out}/d0"], **popen)]  # type: ignore[call-overload]
        try:
            first = json.loads(daemons[0].stdout.readline())
            more = [[*cmd, f"{out}/d{i}", "--peers", first["address"]] for i in (1, 2)]
            daemons += [subprocess.Popen(c, **popen) for c in more]  # type: ignore[call-overload]
            infos = [first] + [json.loads(d.stdout.readline()) for d in daemons[1:]]
            boot = str(first["address"])
            pids = [d.pid for d in daemons]
            with RssSampler(pids) as calm_rss:
                calm = trio.run(_honest_ops, boot, args.dht_ops, "calm")
            # 24 identities store (6x the address's share: within it they replace each other's
            # records, dht/storage.py), 300 ping.
            targets = [Target(str(i["address"]), str(i["peer_id"])) for i in infos]
            flood = DhtFlood(targets, 300, store_identities=24)
            flood.start()
            with RssSampler(pids) as rss:
                under = trio.run(_honest_ops, boot, args.dht_ops, "flood")
                flood.join(timeout=300)
        finally:
            for d in daemons:
                d.kill()
                d.wait()
    calm_s, flood_s = statistics.median(calm), statistics.median(under)
    row = {"flood": "dht", "calm_s": calm_s, "flood_s": flood_s, "ratio": flood_s / calm_s}
    row.update(rss_growth_mb=rss.peak - calm_rss.peak, dropped=0)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3, choices=(2, 3))
    parser.add_argument("--mvalues", type=float, default=10, help="millions of fp32 values")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=int, default=80, help="silent connections per peer")
    parser.add_argument("--dht-ops", type=int, default=20, help="honest store+get pairs")
    parser.add_argument(
        "--floods", default="slowloris,memory,rate,dht", help="which floods, comma-separated"
    )
    args = parser.parse_args()
    floods = [f for f in args.floods.split(",") if f]
    unknown = set(floods) - {"slowloris", "memory", "rate", "dht"}
    if unknown:
        parser.error(f"unknown floods: {sorted(unknown)}")
    rows = group_rows(args, [f for f in floods if f != "dht"])
    if "dht" in floods:
        rows.append(dht_row(args))
    print(f"{'flood':<10} {'calm_s':>8} {'flood_s':>8} {'ratio':>6} {'rss+MB':>7} dropped")
    for r in rows:
        print(
            f"{r['flood']:<10} {r['calm_s']:8.3f} {r['flood_s']:8.3f} {r['ratio']:6.2f} "
            f"{r['rss_growth_mb']:7.0f} {r['dropped']}"
        )
    each = " ".join(
        f"{r['flood']}_ratio={r['ratio']:.2f} {r['flood']}_rss_mb={r['rss_growth_mb']:.0f}"
        for r in rows
    )
    print(
        f"worst_step_ratio={max(r['ratio'] for r in rows):.2f} "
        f"worst_rss_growth_mb={max(r['rss_growth_mb'] for r in rows):.0f} "
        f"dropped={sum(r['dropped'] for r in rows)} {each}"
    )


if __name__ == "__main__":
    main()
