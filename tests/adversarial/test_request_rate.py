"""Request rates (issue 31, item 4), against a real `swarmd serve` process.

Before: one identity had 1,000 pings served in 0.6 s (8 in flight), and nothing bounded a
machine that minted a fresh identity per call.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
import trio

from swarmd.node.peer.service import GET_TENSOR, PING, PUT_TENSOR
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity
from swarmd.protocol.tensors import tensor_meta, tensor_payload
from tests.harness.processes import Proc, ProcessGroup, swarmd_cmd

PINGS = 1000
IN_FLIGHT = 8
#: A flood's clients call again at no refusal's bidding: each refusal is one of theirs.
GREEDY = rpc.TransportConfig(rate_limit_retry=False)


def _limited(peer: Proc, scope: str) -> float:
    url = f"http://127.0.0.1:{peer.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(rf'swarmd_rpc_rate_limited_total{{scope="{scope}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


async def _flood(
    address: str, client_for: Callable[[int], rpc.RpcClient]
) -> tuple[int, int, float]:
    """PINGS pings, IN_FLIGHT at a time: (served, refused RESOURCE_EXHAUSTED, seconds)."""
    served = refused = 0
    start = trio.current_time()

    async def worker(w: int) -> None:
        nonlocal served, refused
        for i in range(w, PINGS, IN_FLIGHT):
            try:
                await client_for(i).unary(address, PING, pb.PingRequest(), pb.PingResponse)
                served += 1
            except rpc.RpcError as exc:
                assert exc.code is rpc.StatusCode.RESOURCE_EXHAUSTED, exc
                refused += 1

    async with trio.open_nursery() as nursery:
        for w in range(IN_FLIGHT):
            nursery.start_soon(worker, w)
    return served, refused, trio.current_time() - start


def _serve(processes: ProcessGroup, tmp_path: Path, *flags: str) -> Proc:
    state = str(tmp_path / "peer")
    return processes.start(
        swarmd_cmd("serve", "--state-dir", state, "--metrics", "127.0.0.1:0", *flags)
    )


def test_one_identity_gets_its_rate_and_others_are_served(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    limits = rpc.RateLimits()  # the defaults a volunteer runs with
    peer = _serve(processes, tmp_path)
    greedy, honest = rpc.RpcClient(Identity.generate(), GREEDY), rpc.RpcClient(Identity.generate())

    async def main() -> tuple[int, int, float]:
        outcome = await _flood(peer.address, lambda _: greedy)
        # The flood's own peer bucket ran dry, nobody else's did.
        await honest.unary(peer.address, PING, pb.PingRequest(), pb.PingResponse)
        return outcome

    try:
        served, refused, seconds = trio.run(main)
    finally:
        greedy.close()
        honest.close()
    assert served + refused == PINGS
    # The hello that learned the server's key counts too: hence the +1.
    assert served <= limits.per_peer_burst + limits.per_peer_rate * seconds + 1
    assert refused > 0
    assert _limited(peer, "peer") == refused


def test_fresh_identities_share_their_address_bucket(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """A machine minting a key per call meets its address's bucket (set low here so that
    this 2-core machine can outrun it; the default is measured against honest runs)."""
    rate, burst = 50, 100
    limit = f"{rate}/{burst}"  # a peer's limit may not exceed its address's
    peer = _serve(processes, tmp_path, "--address-rate-limit", limit, "--peer-rate-limit", limit)
    clients: dict[int, rpc.RpcClient] = {}

    def fresh(i: int) -> rpc.RpcClient:
        clients[i] = rpc.RpcClient(Identity.generate(), GREEDY)
        return clients[i]

    try:
        served, refused, seconds = trio.run(_flood, peer.address, fresh)
    finally:
        for client in clients.values():
            client.close()
    assert refused > 0
    # Each fresh client's hello is a call too: served calls are pings and hellos.
    assert served <= burst + rate * seconds
    assert _limited(peer, "address") >= refused
    assert _limited(peer, "peer") == 0
    time.sleep(burst / rate)  # the bucket refills: the address is served again

    async def again() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            await client.unary(peer.address, PING, pb.PingRequest(), pb.PingResponse)
        finally:
            client.close()

    trio.run(again)


def test_an_honest_client_waits_out_a_refusal_instead_of_failing(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Calls beyond a peer's limit, on both wires, are refused with the wait until the bucket
    holds a token, and the default client makes them again after it: every call is served,
    at the limit's pace. Before, a member of a fast run (rounds of 50 ms) lost a part of an
    all-reduce to its reducer's limit, and the two members' states split (test_run_access)."""
    rate, burst = 20, 5
    peer = _serve(processes, tmp_path, "--peer-rate-limit", f"{rate}/{burst}")
    tensor = torch.arange(1000, dtype=torch.float32)
    client = rpc.RpcClient(Identity.generate())

    async def one(i: int) -> None:
        if i % 3 == 0:
            meta = tensor_meta(tensor, name=f"t{i}")
            payload = tensor_payload(tensor)
            await client.put_tensor(peer.address, PUT_TENSOR, meta, payload, pb.TensorAck)
        elif i % 3 == 1:
            await client.get_tensor(peer.address, GET_TENSOR, pb.TensorRequest(name="t0"))
        else:
            await client.unary(peer.address, PING, pb.PingRequest(), pb.PingResponse)

    async def main() -> float:
        start = trio.current_time()
        await one(0)  # the tensor the gets read
        async with trio.open_nursery() as nursery:
            for worker in range(3):

                async def calls(w: int = worker) -> None:
                    for i in range(1 + w, 31, 3):
                        await one(i)

                nursery.start_soon(calls)
        return trio.current_time() - start

    try:
        seconds = trio.run(main)
    finally:
        client.close()
    refused = _limited(peer, "peer")
    assert refused > 0  # the limit did refuse: the client waited and called again
    # 31 calls and a hello: beyond the burst, one token every 1/rate s.
    assert seconds >= (31 + 1 - burst) / rate * 0.9, seconds
