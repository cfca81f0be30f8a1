"""200 connections from one address, on each of a peer's two ports, held open with half a
request each: the peer still answers signed pings within 1 s and its memory stays bounded
(issue 28's resource bound).

The gRPC port gets a partial HTTP/2 preface, the bulk port a partial request header; neither
ever completes. Bulk connections past the per-address cap (16) are refused at once or close
their idle predecessors; gRPC's are held by its completion queue at a few KB each.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import trio

from benchmarks.flood import rss_mb
from swarmd.node.peer.service import PING
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity
from tests.harness.processes import ProcessGroup, swarmd_cmd
from tests.harness.transport import hello_of

CONNECTIONS = 200
#: Pings must come back within this much, each, while the flood holds its connections.
PING_BOUND_S = 1.0
#: What 400 half-open connections may add to the peer's peak RSS.
MAX_GROWTH_MB = 50


def _flood(port: int, first_bytes: bytes) -> list[socket.socket]:
    held = []
    for _ in range(CONNECTIONS):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(first_bytes)
        except OSError:  # refused or reset: the server's cap at work
            sock.close()
            continue
        held.append(sock)
    return held


def _ping_times(address: str, count: int) -> list[float]:
    async def main() -> list[float]:
        client = rpc.RpcClient(Identity.generate())
        times = []
        try:
            for i in range(count):
                start = time.monotonic()
                with trio.fail_after(5 * PING_BOUND_S):
                    answer = await client.unary(
                        address, PING, pb.PingRequest(payload=bytes([i])), pb.PingResponse
                    )
                times.append(time.monotonic() - start)
                assert answer.payload == bytes([i])
                await trio.sleep(0.1)
        finally:
            client.close()
        return times

    return trio.run(main)


def test_two_hundred_connections_per_port_leave_pings_fast_and_memory_bounded(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    peer = processes.start(swarmd_cmd("serve", "--state-dir", str(tmp_path / "p")))
    grpc_port = int(peer.address.rsplit(":", 1)[1])
    bulk_port = hello_of(peer.address).port
    assert bulk_port
    _ping_times(peer.address, 3)  # warm: the first call pays for channels and hellos
    before = rss_mb(peer.pid)
    held = _flood(grpc_port, b"PRI * HTTP/2.0\r\n") + _flood(bulk_port, b"SWB")
    try:
        time.sleep(1.0)
        times = _ping_times(peer.address, 10)
        growth = rss_mb(peer.pid) - before
    finally:
        for sock in held:
            sock.close()
    print(f"held {len(held)} connections; pings {max(times):.3f} s at most; +{growth:.1f} MB")
    assert len(held) >= CONNECTIONS  # the gRPC port took them all: the flood was on
    assert max(times) < PING_BOUND_S, times
    assert growth < MAX_GROWTH_MB, growth
