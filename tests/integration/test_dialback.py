"""The reachability check between real DHT nodes on loopback (dialback.py): a node dials the
caller back at the IP its call came from, on the ports the caller names; a closed port is
reported unreachable; a caller asking again too soon is refused."""

from __future__ import annotations

import ipaddress
import socket

import trio

from swarmd.node.dht import DHTConfig, open_dht
from swarmd.node.dht.dialback import (
    DIAL_BACK,
    DialBackLimits,
    _local_alias,
    check_reachability,
    reachability_of,
)
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_dial_back_reachable_closed_port_and_rate_limit() -> None:
    async def main() -> None:
        cfg = DHTConfig(lookup_timeout_s=2.0)
        async with (
            open_dht(Identity.generate(), config=cfg) as (boot_node, boot),
            open_dht(Identity.generate(), bootstrap=[str(boot.address)], config=cfg) as (
                node,
                server,
            ),
        ):
            # One check per peer id per 2 s here (10 s by default), to test the retry quickly.
            boot_node.dial_back.limits = DialBackLimits(per_peer_s=2.0)
            with trio.fail_after(30):
                # A plain TCP listener stands in for the bulk port.
                listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
                bulk = listener.socket.getsockname()[1]
                ok = await check_reachability(
                    node.caller.client, [str(boot.address)], server.address.port, bulk
                )
                assert ok.verdict == "reachable", ok
                assert ok.observed == f"127.0.0.1:{server.address.port}"
                # The same peer again at once: refused for rate.
                try:
                    await node.caller.client.unary(
                        str(boot.address),
                        DIAL_BACK,
                        pb.DialBackRequest(port=server.address.port),
                        pb.DialBackResponse,
                        timeout=5,
                    )
                    raise AssertionError("a second check within 2 s was answered")
                except rpc.RpcError as exc:
                    assert exc.code == rpc.StatusCode.RESOURCE_EXHAUSTED, exc
                # A restarted peer asking within the limit is asked again after it, not left
                # "unknown" (which would keep a NATed peer a server).
                again = await check_reachability(
                    node.caller.client,
                    [str(boot.address)],
                    server.address.port,
                    bulk,
                    retry_s=2.5,
                )
                assert again.verdict == "reachable", again
                # Another identity on the same address, naming ports nobody listens on.
                other = rpc.RpcClient(Identity.generate())
                try:
                    closed = await check_reachability(
                        other, [str(boot.address)], _closed_port(), _closed_port()
                    )
                finally:
                    other.close()
                assert closed.verdict == "unreachable", closed
                assert "gRPC port" in closed.detail and "bulk port" in closed.detail
                await listener.aclose()
            # Nobody to ask, or told: no check at all.
            first = await reachability_of("auto", node.caller.client, [], 1)
            assert first.verdict == "unknown" and not first.client_mode
            told = await reachability_of("no", node.caller.client, [str(boot.address)], 1)
            assert told.client_mode

    trio.run(main)


def test_a_peer_on_another_loopback_address_is_dialled_there() -> None:
    """Peers of one machine listen on 127.0.0.x but call out from 127.0.0.1 (`swarmd chaos`,
    split-heal): the callee dials the loopback host the caller names, and only a loopback one."""

    async def main() -> None:
        cfg = DHTConfig(lookup_timeout_s=2.0)
        async with (
            open_dht(Identity.generate(), config=cfg) as (_, boot),
            open_dht(
                Identity.generate(), host="127.0.0.5", bootstrap=[str(boot.address)], config=cfg
            ) as (node, server),
        ):
            with trio.fail_after(30):
                port, nodes = server.address.port, [str(boot.address)]
                named = await check_reachability(node.caller.client, nodes, port, host="127.0.0.5")
                assert named.verdict == "reachable" and named.observed.startswith("127.0.0.5:")
                # Another key (the limit is per key), naming nothing: its source is dialled.
                other = rpc.RpcClient(Identity.generate())
                try:
                    source = await check_reachability(other, nodes, port)
                finally:
                    other.close()
                assert source.verdict == "unreachable" and source.observed.startswith("127.0.0.1:")

    trio.run(main)


def test_only_a_loopback_caller_may_name_another_host() -> None:
    loop, lan = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.0.0.7")
    assert _local_alias(loop, "127.0.0.12") == ipaddress.ip_address("127.0.0.12")
    assert _local_alias(loop, "10.0.0.9") == loop  # not a way to make a node dial elsewhere
    assert _local_alias(loop, "example.org") == loop
    assert _local_alias(lan, "127.0.0.1") == lan  # a remote caller never names a host
    assert _local_alias(lan, "") == lan
