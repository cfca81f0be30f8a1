"""A stranger flooding DHT nodes from one address with fresh identities (issue 31, item 3).

Built from swarmd's own modules with throwaway keys, in its own process at the lowest CPU
priority (as flood.py's Slowloris: on a 2-core machine it shares the nodes' cores). Its calls
leave from 127.0.0.2 while the nodes listen on 127.0.0.1: gRPC cannot choose a client's source
address, so each call goes through a relay in this process that reconnects from 127.0.0.2.

Two attacks, one after the other:

- store: each fresh identity stores as much as its owner quota allows, at every node, until
  3 identities in a row got nothing stored anywhere (the node is full to this address) or
  the identities run out;
- ping: every identity pings every node claiming a port on 127.0.0.2 where nothing listens
  (sockets bound and held, never listening), the way a caller joins a node's routing table.

``result()`` says what got through. ``contacts`` asks a node which contacts its table holds
near given ids (its Find answer), to see whether the flood's identities got in.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import queue
import socket
import time
from dataclasses import dataclass
from typing import Any

import trio

from swarmd.node.dht.caller import FIND, PING, STORE
from swarmd.node.dht.ids import id_to_bytes, node_id
from swarmd.node.dht.records import sign_record
from swarmd.protocol import dht_pb2 as pb
from swarmd.protocol import rpc
from swarmd.protocol.address import parse_address
from swarmd.protocol.identity import Identity, PeerId

SOURCE = "127.0.0.2"
#: A record's value: 69 of them fill one owner's 4 MiB quota, 48 fit one 4 MiB message.
VALUE_BYTES = 60_000
PER_CALL = 48
#: Ports claimed by the ping flood (held, never listening).
CLAIMED_PORTS = 16


@dataclass(frozen=True)
class Target:
    address: str
    peer_id: str


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        async for chunk in src:
            await dst.send_all(chunk)
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await dst.send_eof()


async def _relay(target: str, task_status: trio.TaskStatus[str]) -> None:
    """Listens on 127.0.0.1 and forwards each connection to ``target`` from 127.0.0.2."""
    addr = parse_address(target)

    async def handle(down: trio.SocketStream) -> None:
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        await sock.bind((SOURCE, 0))
        try:
            await sock.connect((addr.host, addr.port))
        except OSError:
            sock.close()
            await down.aclose()
            return
        up = trio.SocketStream(sock)
        async with down, up, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, down, up)
            nursery.start_soon(_pump, up, down)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    task_status.started(f"127.0.0.1:{port}")
    await trio.serve_listeners(handle, listeners)


class DhtFlood(multiprocessing.Process):
    """The stranger; ``result()`` after ``join()``: a dict of what it got through."""

    def __init__(
        self,
        targets: list[Target],
        identities: int = 300,
        store: bool = True,
        ping: bool = True,
        neighbour_records: int = 0,
        store_identities: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.targets, self.identities = targets, identities
        #: How many of them store (default all): each one's stores are accepted within its
        #: address's share, replacing the largest holder's records (dht/storage.py).
        self.store_identities = identities if store_identities is None else store_identities
        self.do_store, self.do_ping = store, ping
        #: After the store flood, one more identity from the flood's address (an honest
        #: volunteer behind the same router) stores this many small records at every node.
        self.neighbour_records = neighbour_records
        self._out: multiprocessing.Queue[dict[str, Any]] = multiprocessing.Queue()

    def result(self, timeout: float = 5.0) -> dict[str, Any]:
        try:
            return self._out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"the flood process reported nothing (exit {self.exitcode})"
            ) from None

    def run(self) -> None:
        os.nice(19)
        self._out.put(trio.run(self._main))

    async def _main(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ids": []}
        async with trio.open_nursery() as nursery:
            relays = [await nursery.start(_relay, t.address) for t in self.targets]
            start = time.monotonic()
            if self.do_store:
                out.update(await self._store_flood(relays))
            if self.neighbour_records:
                records = [(f"neighbour/{j}", b"v%d" % j) for j in range(self.neighbour_records)]
                stored = await self._store_as(Identity.generate(), relays, records)
                out["neighbour_stored"] = [n for n, _ in stored]
            out["store_s"] = time.monotonic() - start
            if self.do_ping:
                out["ids"] = await self._ping_flood(relays)
            nursery.cancel_scope.cancel()
        return out

    async def _store_as(
        self,
        identity: Identity,
        relays: list[str],
        values: list[tuple[str, bytes]] | None = None,
    ) -> list[tuple[int, int]]:
        """`values` (key, value), by default one identity's whole owner quota, at every
        node: (records, bytes) stored at each."""
        expires = time.time() + 600
        tag = identity.peer_id.raw.hex()[:16]
        if values is None:
            values = [
                (f"flood/{tag}/{j}", os.urandom(VALUE_BYTES))
                for j in range(math.ceil((4 << 20) / VALUE_BYTES))
            ]
        records = [sign_record(identity, k.encode(), v, expires) for k, v in values]
        stored = [(0, 0)] * len(relays)
        client = rpc.RpcClient(identity)
        try:
            for i, (relay, target) in enumerate(zip(relays, self.targets, strict=True)):
                for at in range(0, len(records), PER_CALL):
                    batch = records[at : at + PER_CALL]
                    req = pb.StoreRequest(sender_port=0, records=[r.to_pb() for r in batch])
                    try:
                        resp = await client.unary(
                            relay, STORE, req, pb.StoreResponse, timeout=30,
                            recipient=PeerId.from_string(target.peer_id),
                        )  # fmt: skip
                    except rpc.RpcError:
                        continue
                    for r, outcome in zip(batch, resp.outcomes, strict=False):
                        if outcome == pb.StoreResponse.STORED:
                            n, b = stored[i]
                            stored[i] = (n + 1, b + r.size)
        finally:
            client.close()
        return stored

    async def _store_flood(self, relays: list[str]) -> dict[str, Any]:
        records, nbytes, used, refused_in_a_row = [0] * len(relays), [0] * len(relays), 0, 0
        while used < self.store_identities and refused_in_a_row < 3:
            stored = await self._store_as(Identity.generate(), relays)
            used += 1
            for i, (n, b) in enumerate(stored):
                records[i] += n
                nbytes[i] += b
            refused_in_a_row = 0 if any(n for n, _ in stored) else refused_in_a_row + 1
        return {"store_identities": used, "stored_records": records, "stored_bytes": nbytes}

    async def _ping_flood(self, relays: list[str]) -> list[str]:
        held = []
        for _ in range(CLAIMED_PORTS):  # bound, never listening: connections are refused
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((SOURCE, 0))
            held.append(sock)
        ports = [s.getsockname()[1] for s in held]
        ids: list[str] = []
        limit = trio.CapacityLimiter(8)  # the nodes serve 16 calls at once

        async def ping_as(n: int) -> None:
            identity = Identity.generate()
            ids.append(str(identity.peer_id))
            client = rpc.RpcClient(identity)
            try:
                for relay, target in zip(relays, self.targets, strict=True):
                    req = pb.PingRequest(sender_port=ports[n % len(ports)])
                    with contextlib.suppress(rpc.RpcError):
                        await client.unary(
                            relay, PING, req, pb.PingResponse, timeout=10,
                            recipient=PeerId.from_string(target.peer_id),
                        )  # fmt: skip
            finally:
                client.close()

        async def limited(n: int) -> None:
            async with limit:
                await ping_as(n)

        try:
            async with trio.open_nursery() as nursery:
                for n in range(self.identities):
                    nursery.start_soon(limited, n)
            await trio.sleep(1.0)  # the nodes' verification pings find nothing listening
        finally:
            for sock in held:
                sock.close()
        return ids


def contacts(target: Target, near: list[str]) -> set[tuple[str, str]]:
    """(peer id, address) of the contacts ``target``'s routing table holds nearest each id in
    ``near``: any of those ids that is in its table is among them."""

    async def ask() -> set[tuple[str, str]]:
        client = rpc.RpcClient(Identity.generate())
        found: set[tuple[str, str]] = set()
        try:
            for at in range(0, len(near), 256):
                ids = [id_to_bytes(node_id(PeerId.from_string(p))) for p in near[at : at + 256]]
                resp = await client.unary(
                    target.address, FIND, pb.FindRequest(targets=ids), pb.FindResponse,
                    timeout=10, recipient=PeerId.from_string(target.peer_id),
                )  # fmt: skip
                for result in resp.results:
                    found.update((str(PeerId(n.peer_id)), n.address) for n in result.nodes)
        finally:
            client.close()
        return found

    return trio.run(ask)
