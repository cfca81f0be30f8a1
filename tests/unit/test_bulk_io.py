"""The bulk plane's reads: a stall bound that moves on with every chunk, and clear errors for a
peer that stops sending or closes early (virtual time: the stall deadlines are trio's)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from swarmd.protocol._bulk_io import recv_into, recv_sealed, send_all
from swarmd.protocol.calls import RpcError, StatusCode
from swarmd.protocol.session import CALLER, StreamMac, seal_payload

Sender = Callable[[trio.socket.SocketType], Awaitable[None]]


def exchange(sender: Sender, receive: Callable[[trio.socket.SocketType], Awaitable[None]]) -> float:
    """Runs ``sender`` on one end of a socket pair and ``receive`` on the other, in virtual
    time; the virtual seconds the receiver took. What the receiver raised is raised."""
    took = 0.0
    failure: RpcError | None = None

    async def main() -> None:
        nonlocal took, failure
        a, b = trio.socket.socketpair()
        with a, b:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender, a)
                start = trio.current_time()
                try:
                    await receive(b)
                except RpcError as exc:
                    failure = exc
                took = trio.current_time() - start
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    if failure is not None:
        raise failure
    return took


def test_a_peer_that_stops_sending_is_unavailable_after_the_stall_bound() -> None:
    async def sender(sock: trio.socket.SocketType) -> None:
        await send_all(sock, [b"x" * 10], None)
        await trio.sleep_forever()

    async def receive(sock: trio.socket.SocketType) -> None:
        await recv_into(sock, memoryview(bytearray(100)), stall_s=5.0)

    with pytest.raises(RpcError, match=r"no data for 5 s after 10 of 100 bytes") as info:
        exchange(sender, receive)
    assert info.value.code is StatusCode.UNAVAILABLE


def test_a_peer_that_closes_early_is_unavailable_at_once() -> None:
    async def sender(sock: trio.socket.SocketType) -> None:
        await send_all(sock, [b"x" * 10], None)
        sock.close()

    async def receive(sock: trio.socket.SocketType) -> None:
        await recv_into(sock, memoryview(bytearray(100)), stall_s=5.0)

    with pytest.raises(RpcError, match="connection closed after 10 of 100 bytes") as info:
        exchange(sender, receive)
    assert info.value.code is StatusCode.UNAVAILABLE


def sealed_pieces(payload: bytes, mac: StreamMac) -> list[bytes]:
    return [bytes(p) for p in seal_payload(mac, CALLER, [memoryview(payload)])]


def test_a_slow_but_steady_sealed_payload_is_read_whole() -> None:
    """The bound is on the time between chunks, not on the whole read: a payload sent in
    pieces 3 s apart takes 12 s against a 5 s bound and is read, every tag checked."""
    mac, payload = StreamMac(os.urandom(32)), os.urandom(3 << 20)
    wire = b"".join(sealed_pieces(payload, mac))
    got = bytearray(len(payload))

    async def sender(sock: trio.socket.SocketType) -> None:
        step = -(-len(wire) // 5)
        for start in range(0, len(wire), step):
            await send_all(sock, [wire[start : start + step]], None)
            await trio.sleep(3.0)

    async def receive(sock: trio.socket.SocketType) -> None:
        await recv_sealed(sock, memoryview(got), mac, CALLER, stall_s=5.0)

    took = exchange(sender, receive)
    assert got == payload
    assert took >= 12.0


def test_a_sealed_payload_that_stalls_midway_is_unavailable() -> None:
    mac, payload = StreamMac(os.urandom(32)), os.urandom(3 << 20)
    wire = b"".join(sealed_pieces(payload, mac))
    sent = (1 << 20) + 16 + 1000  # the first frame and its tag, and part of the second

    async def sender(sock: trio.socket.SocketType) -> None:
        await send_all(sock, [wire[:sent]], None)
        await trio.sleep_forever()

    async def receive(sock: trio.socket.SocketType) -> None:
        await recv_sealed(sock, memoryview(bytearray(len(payload))), mac, CALLER, stall_s=5.0)

    with pytest.raises(RpcError, match=rf"no data for 5 s after {sent} of {len(wire)} bytes"):
        exchange(sender, receive)
