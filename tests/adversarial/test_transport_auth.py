"""A captured request cannot be replayed to another peer, and no frame of a tensor stream can
be altered, spliced or cut on the way, in either direction.

Before: a signed request captured at server A was accepted by server B within the 30 s
freshness window (the signature named no recipient), and tensor frames after the first were
not authenticated at all, so a hop on the path could rewrite the payload of an all-reduce part
or a state download.

The attacker here sits on the path: a TCP relay in front of a real peer's bulk listener that
records what the honest client sends and can flip one byte going either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import trio

from swarmd.node.peer.service import GET_TENSOR, PUT_TENSOR
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.errors import AuthError
from swarmd.protocol.framing import header_frame
from swarmd.protocol.identity import Identity
from swarmd.protocol.session import MAC_CHUNK_BYTES, sealed_nbytes
from swarmd.protocol.tensors import tensor_from_bytes, tensor_meta, tensor_payload
from tests.harness.processes import Proc, ProcessGroup, swarmd_cmd
from tests.harness.transport import hello_of

Tamper = Callable[[int, bytearray], None]  # (offset of this chunk in its direction, chunk)


class Relay:
    """An on-path attacker: relays one bulk connection at a time to ``target``, keeps what the
    client sent, and lets a test rewrite bytes going either way."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent_by_client = bytearray()
        self.to_server: Tamper | None = None
        self.to_client: Tamper | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sent_by_client.clear()
            up = threading.Thread(target=self._pipe, args=(client, server, True), daemon=True)
            up.start()
            self._pipe(server, client, False)
            up.join()
            client.close()
            server.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        offset = 0
        try:
            while chunk := src.recv(1 << 16):
                data = bytearray(chunk)
                tamper = self.to_server if upstream else self.to_client
                if tamper is not None:
                    tamper(offset, data)
                if upstream:
                    self.sent_by_client += data
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def flip_at(position: int) -> Tamper:
    """Flips the byte at ``position`` of a direction's stream."""

    def tamper(offset: int, data: bytearray) -> None:
        if offset <= position < offset + len(data):
            data[position - offset] ^= 0x01

    return tamper


def raw_call(port: int, request: bytes) -> tuple[int, bytes]:
    """Sends recorded bytes to a bulk listener; (status number, details) of its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        with contextlib.suppress(OSError):  # refused early: the answer is on its way
            conn.sendall(request)
        head = b""
        while len(head) < 5:
            chunk = conn.recv(5 - len(head))
            assert chunk, "closed without an answer"
            head += chunk
        status, length = int(head[0]), int.from_bytes(head[1:5], "little")
        data = b""
        while len(data) < length:
            data += conn.recv(length - len(data))
        return status, data


UNAUTHENTICATED = list(rpc.StatusCode).index(rpc.StatusCode.UNAUTHENTICATED)


@pytest.fixture
def two_peers(processes: ProcessGroup, tmp_path: Path) -> tuple[Proc, Proc]:
    start = [
        processes.start(swarmd_cmd("serve", "--state-dir", str(tmp_path / name)))
        for name in ("a", "b")
    ]
    return start[0], start[1]


def _through(client: rpc.RpcClient, peer: Proc, relay: Relay) -> None:
    """Routes ``client``'s bulk calls to ``peer`` through the relay (where the attacker sits)."""
    hello = client._hellos[peer.address]
    client._remember(peer.address, dataclasses.replace(hello, bulk_port=relay.port))


def test_replays_to_another_peer_and_altered_frames_are_refused(
    two_peers: tuple[Proc, Proc],
) -> None:
    a, b = two_peers
    a_port, b_port = hello_of(a.address).port, hello_of(b.address).port
    relay = Relay(a_port)
    honest = torch.randn(3 * MAC_CHUNK_BYTES // 4)  # three authenticated frames
    meta = tensor_meta(honest, name="w")

    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            await client._hello(a.address, 10.0)  # who A is, as any first call learns it
            _through(client, a, relay)
            ack = await client.put_tensor(
                a.address, PUT_TENSOR, meta, tensor_payload(honest), pb.TensorAck, timeout=20
            )
            assert ack.received_bytes == honest.numel() * 4
            captured = bytes(relay.sent_by_client)

            # The captured put, replayed within seconds to B and to A itself.
            status, why = await trio.to_thread.run_sync(raw_call, b_port, captured)
            assert status == UNAUTHENTICATED and b"addressed to peer" in why
            status, why = await trio.to_thread.run_sync(raw_call, a_port, captured)
            assert status == UNAUTHENTICATED and b"replayed" in why
            with pytest.raises(rpc.RpcError) as info:  # B holds nothing of it
                await client.get_tensor(b.address, GET_TENSOR, pb.TensorRequest(name="w"))
            assert info.value.code is rpc.StatusCode.NOT_FOUND

            # One byte of the second frame flipped on its way to A: refused, A keeps its tensor.
            header = len(captured) - sealed_nbytes(honest.numel() * 4)
            relay.to_server = flip_at(header + MAC_CHUNK_BYTES + 16 + 100)
            scaled = honest * -20
            with pytest.raises(rpc.RpcError) as info:
                await client.put_tensor(
                    a.address, PUT_TENSOR, meta, tensor_payload(scaled), pb.TensorAck, timeout=20
                )
            assert info.value.code is rpc.StatusCode.UNAUTHENTICATED
            assert "frame 2" in info.value.details
            relay.to_server = None

            # One byte of the third frame flipped on its way back from A: the client refuses
            # the download instead of using it.
            head = 5 + len(header_frame(meta)) + 16  # status, length, header frame, its tag
            relay.to_client = flip_at(head + 2 * (MAC_CHUNK_BYTES + 16) + 7)
            with pytest.raises(AuthError, match="frame 3"):
                await client.get_tensor(a.address, GET_TENSOR, pb.TensorRequest(name="w"))
            relay.to_client = None

            got, data = await client.get_tensor(
                a.address, GET_TENSOR, pb.TensorRequest(name="w"), timeout=20
            )
            assert torch.equal(tensor_from_bytes(got, data), honest)  # what the honest put sent
        finally:
            client.close()
            relay.close()

    trio.run(main)
    time.sleep(0.2)
    assert any(
        "refused bulk call" in line and "addressed to peer" in line for line in b.stderr_tail
    )
    assert any("refused bulk call" in line and "frame 2" in line for line in a.stderr_tail)
    for peer in (a, b):
        assert peer.process.poll() is None, "an honest peer died"
        assert not any("Traceback" in line for line in peer.stderr_tail)


def test_a_peer_that_is_not_the_one_expected_gets_no_tensor(two_peers: tuple[Proc, Proc]) -> None:
    """A caller that knows whom it wants (a group member, from a signed record) refuses a
    server at that address that says it is someone else: a stale address, or a hop on the
    path answering the hello with its own key."""
    a, b = two_peers
    tensor = torch.randn(1000)
    meta = tensor_meta(tensor, name="x")

    b_id = hello_of(b.address).peer_id

    async def attempt() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            with pytest.raises(rpc.RpcError) as info:  # B is expected, A answers
                await client.put_tensor(
                    a.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck, expect=b_id
                )
            assert info.value.code is rpc.StatusCode.UNAUTHENTICATED
            assert "not the expected" in info.value.details
            # The same call to B itself goes through.
            await client.put_tensor(
                b.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck, expect=b_id
            )
            with pytest.raises(rpc.RpcError) as info:  # A never got the tensor
                await client.get_tensor(a.address, GET_TENSOR, pb.TensorRequest(name="x"))
            assert info.value.code is rpc.StatusCode.NOT_FOUND
        finally:
            client.close()

    trio.run(attempt)
