"""Routing-table admission: a caller enters only after answering at its claimed address, the
verifications are bounded, and a full bucket keeps a live old contact over a newcomer.

Real nodes on loopback in one process (a ping back needs something to answer or to refuse)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from swarmd.node.dht import open_dht
from swarmd.node.dht.caller import PING
from swarmd.node.dht.ids import bucket_index, node_id
from swarmd.node.dht.node import DHTConfig
from swarmd.node.dht.routing import RoutingConfig
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity


@contextmanager
def dead_port() -> Iterator[int]:
    """A loopback port that is taken but never listens: connections to it are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


def test_a_caller_enters_only_after_answering_at_its_claimed_address() -> None:
    async def main() -> None:
        async with open_dht(Identity.generate()) as (node, server):
            liar = Identity.generate()
            client = rpc.RpcClient(liar)
            with dead_port() as port:
                req = pb.PingRequest(sender_port=port)
                await client.unary(str(server.address), PING, req, pb.PingResponse, timeout=5)
                await until(lambda: node.admission.pending == 0)
            client.close()
            assert liar.peer_id not in node.table
            # Not pinged again at once, but not held against the id in the routing table (a
            # claimed address that does not answer says nothing about the peer itself).
            node.admission.offer(liar.peer_id, f"127.0.0.1:{port}")
            assert node.admission.pending == 0
            assert not node.table.in_backoff(liar.peer_id)
            async with open_dht(Identity.generate(), bootstrap=[str(server.address)]) as (b, _):
                await until(lambda: b.peer_id in node.table)

    trio.run(main)


def test_verifications_are_bounded_and_one_per_id() -> None:
    async def main() -> None:
        async with open_dht(Identity.generate()) as (node, _):
            with dead_port() as port:
                strangers = [Identity.generate().peer_id for _ in range(50)]
                for peer_id in strangers:
                    node.admission.offer(peer_id, f"127.0.0.1:{port}")
                for peer_id in strangers[:10]:  # already being verified: neither run nor dropped
                    node.admission.offer(peer_id, f"127.0.0.1:{port}")
                assert node.admission.pending == node.admission.max_pending == 32
                assert node.admission.dropped == 50 - 32
                await until(lambda: node.admission.pending == 0)
            assert not any(p in node.table for p in strangers)

    trio.run(main)


def full_bucket_config() -> DHTConfig:
    return DHTConfig(k=1, get_quorum=1, routing=RoutingConfig(k=1, recheck_after_s=0.0))


def test_a_full_bucket_gives_a_dead_old_contact_up_for_a_verified_newcomer() -> None:
    async def main() -> None:
        async with open_dht(Identity.generate(), config=full_bucket_config()) as (node, server):
            newcomer = Identity.generate()
            index = bucket_index(node.table.own_id, node_id(newcomer.peer_id))
            old = Identity.generate()
            while bucket_index(node.table.own_id, node_id(old.peer_id)) != index:
                old = Identity.generate()
            with dead_port() as port:
                assert node.table.seen(old.peer_id, f"127.0.0.1:{port}")
                async with open_dht(
                    newcomer, bootstrap=[str(server.address)], config=full_bucket_config()
                ):
                    await until(lambda: newcomer.peer_id in node.table)
                    assert old.peer_id not in node.table

    trio.run(main)


def test_a_full_bucket_keeps_a_live_old_contact() -> None:
    async def main() -> None:
        config = full_bucket_config()
        async with open_dht(Identity.generate(), config=config) as (node, server):
            boot = [str(server.address)]
            async with open_dht(Identity.generate(), bootstrap=boot, config=config) as (old, _):
                await until(lambda: old.peer_id in node.table)
                index = bucket_index(node.table.own_id, node_id(old.peer_id))
                newcomer = Identity.generate()
                while bucket_index(node.table.own_id, node_id(newcomer.peer_id)) != index:
                    newcomer = Identity.generate()
                async with open_dht(newcomer, bootstrap=boot, config=config):
                    await trio.sleep(0.5)  # verified, then the old contact answered its ping
                    await until(lambda: node.admission.pending == 0)
                    assert old.peer_id in node.table
                    assert newcomer.peer_id not in node.table

    trio.run(main)


def test_a_caller_of_a_full_fresh_bucket_is_not_dialled_back() -> None:
    """Proven, it could only wait in the replacement cache: the dial-back is not spent."""

    async def main() -> None:
        config = DHTConfig(k=1, get_quorum=1, routing=RoutingConfig(k=1, recheck_after_s=60.0))
        async with open_dht(Identity.generate(), config=config) as (node, _):
            dialled: list[object] = []
            ping = node.caller.ping

            async def counted(address: str, *args: object, **kwargs: object) -> object:
                dialled.append(address)
                return await ping(address, *args, **kwargs)  # type: ignore[arg-type]

            node.caller.ping = counted  # type: ignore[method-assign,assignment]
            with dead_port() as port:
                old, newcomer, elsewhere = (Identity.generate().peer_id for _ in range(3))
                index = bucket_index(node.table.own_id, node_id(old))
                while bucket_index(node.table.own_id, node_id(newcomer)) != index:
                    newcomer = Identity.generate().peer_id
                while bucket_index(node.table.own_id, node_id(elsewhere)) == index:
                    elsewhere = Identity.generate().peer_id
                assert node.table.seen(old, f"127.0.0.1:{port}")
                node.admission.offer(newcomer, f"127.0.0.2:{port}")
                await until(lambda: node.admission.pending == 0)
                assert dialled == []
                node.admission.offer(elsewhere, f"127.0.0.3:{port}")  # its bucket has room
                await until(lambda: node.admission.pending == 0)
                assert dialled == [f"127.0.0.3:{port}"]

    trio.run(main)
