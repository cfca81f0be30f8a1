"""`swarmd ping`: health check, then signed round trips, with errors a user can act on."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import trio

from swarmd.node.peer.service import PING
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.address import Address
from swarmd.protocol.identity import Identity

EXIT_OK, EXIT_FAILURE, EXIT_UNREACHABLE = 0, 1, 3


def _explain(address: Address, err: rpc.RpcError) -> str:
    if err.code is rpc.StatusCode.UNAVAILABLE:
        return f"cannot reach {address}: nothing answers there, or it refused the connection"
    if err.code is rpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{address} did not answer in time"
    return f"{address} answered {err}"


async def _ping(address: Address, count: int, timeout: float, identity: Identity) -> int:
    client = rpc.RpcClient(identity)
    target = str(address)
    try:
        try:
            status = await client.check_health(target, timeout=timeout)
        except rpc.RpcError as err:
            print(f"swarmd: error: {_explain(address, err)}", file=sys.stderr)
            return EXIT_UNREACHABLE
        if status != "SERVING":
            print(f"swarmd: error: {address} health status is {status}", file=sys.stderr)
            return EXIT_UNREACHABLE
        print(f"{address}: health SERVING")
        if count == 0:  # health only (a DHT node serves no Ping)
            return EXIT_OK
        rtts = []
        for i in range(count):
            payload = os.urandom(32)
            start = time.perf_counter()
            try:
                resp = await client.unary(
                    target, PING, pb.PingRequest(payload=payload), pb.PingResponse, timeout=timeout
                )
            except rpc.RpcError as err:
                print(f"swarmd: error: {_explain(address, err)}", file=sys.stderr)
                return EXIT_UNREACHABLE
            rtt = (time.perf_counter() - start) * 1000
            if resp.payload != payload:
                print(f"swarmd: error: {address} echoed a different payload", file=sys.stderr)
                return EXIT_FAILURE
            rtts.append(rtt)
            print(
                f"reply from {resp.peer_id[:10]} (swarmd {resp.version}) seq={i} time={rtt:.2f} ms"
            )
        print(
            f"{count} round trips, min/avg/max = {min(rtts):.2f}/{sum(rtts) / len(rtts):.2f}/"
            f"{max(rtts):.2f} ms"
        )
        return EXIT_OK
    finally:
        client.close()


def ping(address: Address, *, count: int, timeout: float, state_dir: Path | None) -> int:
    identity = Identity.load(state_dir) if state_dir is not None else Identity.generate()
    return trio.run(_ping, address, count, timeout, identity)
