"""A group of all-reduce peers under a flood, next to the same group without one (issue 31).

Starts P peer processes (tests/integration/allreduce_peer.py: swarmd's Averager serving over
the real transport), times R all-reduce rounds of M values with no flood, then R rounds while
a stranger on 127.0.0.2 keeps IDLE silent TCP connections open to every peer's bulk port
(reopening each as soon as it is closed: the slowloris of issue 31, item 1), and reports the
median round time and the peers' peak RSS for each, and the ratios.

Last line: flood=slowloris peers=… mvalues=… calm_round_s=… flood_round_s=… step_ratio=…
calm_rss_mb=… flood_rss_mb=… rss_growth_mb=… dropped=…
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import trio

from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "integration" / "allreduce_peer.py"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--mvalues", type=float, default=10, help="millions of fp32 values")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=int, default=80, help="silent connections per peer")
    args = parser.parse_args()
    numel = int(args.mvalues * 1e6)
    with TemporaryDirectory(prefix="swarmd-flood-") as out:
        peers = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(PEER),
                    json.dumps({"index": i, "numel": numel, "out_dir": out}),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for i in range(args.peers)
        ]
        try:
            infos = [json.loads(p.stdout.readline()) for p in peers]  # type: ignore[union-attr]
            members = sorted([str(i["peer_id"]), str(i["address"])] for i in infos)
            rounds(peers, members, "warm", 1)
            calm, _ = rounds(peers, members, "calm", args.rounds)
            calm_rss = max(rss_mb(p.pid) for p in peers)
            attacker = Slowloris([bulk_port(str(i["address"])) for i in infos], args.idle)
            attacker.start()
            time.sleep(1.0)
            flood, dropped = rounds(peers, members, "flood", args.rounds)
            attacker.halt.set()
            attacker.join(timeout=10)
            flood_rss = max(rss_mb(p.pid) for p in peers)
        finally:
            for p in peers:
                p.kill()
                p.wait()
    calm_s, flood_s = statistics.median(calm), statistics.median(flood)
    print(
        f"flood=slowloris peers={args.peers} mvalues={args.mvalues:g} calm_round_s={calm_s:.3f} "
        f"flood_round_s={flood_s:.3f} step_ratio={flood_s / calm_s:.2f} "
        f"calm_rss_mb={calm_rss:.0f} flood_rss_mb={flood_rss:.0f} "
        f"rss_growth_mb={flood_rss - calm_rss:.0f} dropped={dropped} reopened={attacker.reopened}"
    )


if __name__ == "__main__":
    main()
