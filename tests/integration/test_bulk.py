"""The bulk data plane (swarmd/protocol/bulk.py) between real processes: tensors take it when
both ends have it, it checks what gRPC checks, and clients fall back to gRPC without it."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import time
from typing import Any

import pytest
import torch
import trio

from swarmd.node.peer.service import GET_TENSOR, PUT_TENSOR
from swarmd.protocol import bulk, rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.framing import TensorMeta, header_frame, payload_segments
from swarmd.protocol.identity import Identity
from swarmd.protocol.session import CALLER, CallerKey, seal_payload
from swarmd.protocol.tensors import tensor_from_bytes, tensor_meta, tensor_payload
from tests.harness.processes import ProcessGroup, peak_rss_kib, run_command, swarmd_cmd
from tests.harness.transport import Hello, hello_of, rpc_server_cmd

SINK = "/swarmd.test.Test/Sink"


def bulk_port_of(address: str) -> int:
    return hello_of(address).port


def exchange(port: int, request: bytes, payload: bytes = b"") -> tuple[int, bytes]:
    """One raw bulk call: (status number, data) of the server's answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        with contextlib.suppress(OSError):  # refused early: the answer is on its way
            conn.sendall(request + payload)
        head = b""
        while len(head) < 5:
            chunk = conn.recv(5 - len(head))
            assert chunk, "connection closed without an answer"
            head += chunk
        status, length = struct.unpack("<BI", head)
        data = b""
        while len(data) < length:
            chunk = conn.recv(length - len(data))
            assert chunk
            data += chunk
        return status, data


CALLER_KEY = CallerKey()


def put_call(
    me: Identity,
    to: Hello,
    path: str,
    meta: TensorMeta,
    payload: bytes = b"",
    *,
    signed_path: str | None = None,
    **sign: Any,
) -> tuple[bytes, bytes]:
    """A raw put as a client makes it: (signed request, payload sealed with the call's key)."""
    first = header_frame(meta)
    signed = me.sign_request(
        signed_path or path, first, recipient=to.peer_id, kx=CALLER_KEY.kx_public, **sign
    )
    mac = CALLER_KEY.stream_mac(signed, to.peer_id, to.kx_public)
    sealed = b"".join(bytes(p) for p in seal_payload(mac, CALLER, payload_segments(payload)))
    return bulk.encode_request(bulk.KIND_PUT, path, signed, first, 5), sealed


def put_request(me: Identity, to: Hello, path: str, meta: TensorMeta, **sign: Any) -> bytes:
    return put_call(me, to, path, meta, **sign)[0]


UNAUTHENTICATED = list(rpc.StatusCode).index(rpc.StatusCode.UNAUTHENTICATED)
INVALID_ARGUMENT = list(rpc.StatusCode).index(rpc.StatusCode.INVALID_ARGUMENT)
UNIMPLEMENTED = list(rpc.StatusCode).index(rpc.StatusCode.UNIMPLEMENTED)


def test_status_numbers_are_grpcs() -> None:
    assert [list(rpc.StatusCode).index(c) for c in rpc.StatusCode][:3] == [0, 1, 2]
    assert UNAUTHENTICATED == 16 and INVALID_ARGUMENT == 3 and UNIMPLEMENTED == 12


def test_tensors_take_the_bulk_plane_between_processes(
    processes: ProcessGroup, tmp_path: Any
) -> None:
    peer = processes.start(swarmd_cmd("serve", "--state-dir", str(tmp_path / "peer")))
    tensor = torch.randn(5000, 1000)  # 20 MB
    announced = bulk_port_of(peer.address)

    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            meta = tensor_meta(tensor, name="w")
            ack = await client.put_tensor(
                peer.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck, timeout=20
            )
            assert ack.received_bytes == tensor.numel() * 4
            # The put went over the bulk listener the peer announced, not over gRPC.
            assert client.bulk_port(peer.address) == announced > 0
            got, data = await client.get_tensor(
                peer.address, GET_TENSOR, pb.TensorRequest(name="w"), timeout=20
            )
            assert got == meta and torch.equal(tensor_from_bytes(got, data), tensor)
            with pytest.raises(rpc.RpcError) as info:  # a handler's error crosses intact
                await client.get_tensor(peer.address, GET_TENSOR, pb.TensorRequest(name="nope"))
            assert info.value.code is rpc.StatusCode.NOT_FOUND
        finally:
            client.close()

    trio.run(main)


def test_bulk_requests_are_checked_like_grpc_ones(processes: ProcessGroup) -> None:
    server = processes.start(rpc_server_cmd())
    to = hello_of(server.address)
    port = to.port
    me = Identity.generate()
    meta = TensorMeta("float32", (1000,))

    good, payload = put_call(me, to, SINK, meta, bytes(4000))
    status, data = exchange(port, good, payload)
    assert status == 0 and pb.TensorAck.FromString(data).received_bytes == 4000
    # The same signed request again: a replay.
    status, data = exchange(port, good, payload)
    assert status == UNAUTHENTICATED and b"replayed" in data
    # Refused with 48 MB still to come: the sender reads why, not a reset connection.
    big = TensorMeta("uint8", (48 << 20,))
    first_big, big_payload = put_call(me, to, SINK, big, bytes(48 << 20))
    assert exchange(port, first_big, big_payload)[0] == 0
    status, data = exchange(port, first_big, big_payload)
    assert status == UNAUTHENTICATED and b"replayed" in data
    # Signed by one key, claiming another.
    forged = bytearray(put_request(me, to, SINK, meta))
    at = bulk._PREFIX.size  # the public key follows the fixed prefix
    forged[at : at + 32] = Identity.generate().public_key
    status, _ = exchange(port, bytes(forged), payload)
    assert status == UNAUTHENTICATED
    # Signed for another method, or with a clock two minutes off.
    other = put_request(me, to, SINK, meta, signed_path="/swarmd.test.Test/Other")
    assert exchange(port, other, payload)[0] == UNAUTHENTICATED
    stale = put_request(me, to, SINK, meta, now=time.time() - 120)
    assert exchange(port, stale, payload)[0] == UNAUTHENTICATED
    # Addressed to another peer: what a request captured at one server and replayed to this
    # one looks like.
    elsewhere = Hello(port, Identity.generate().peer_id, to.kx_public)
    status, data = exchange(port, put_request(me, elsewhere, SINK, meta), payload)
    assert status == UNAUTHENTICATED and b"addressed to peer" in data
    # Not a bulk request at all, and a method that does not exist.
    status, data = exchange(port, b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
    assert status == INVALID_ARGUMENT and b"magic" in data
    assert exchange(port, put_request(me, to, "/swarmd.test.Test/Nope", meta), payload)[0] == (
        UNIMPLEMENTED
    )


def test_an_altered_or_truncated_payload_frame_is_refused(processes: ProcessGroup) -> None:
    server = processes.start(rpc_server_cmd())
    to = hello_of(server.address)
    me = Identity.generate()
    meta = TensorMeta("uint8", (3 << 20,))  # three authenticated frames
    request, sealed = put_call(me, to, SINK, meta, bytes(3 << 20))
    frame = (1 << 20) + 16  # a frame and its tag
    # One byte flipped in the second frame: the first frame passes, the second does not.
    altered = bytearray(sealed)
    altered[frame + 100] ^= 1
    status, data = exchange(to.port, request, bytes(altered))
    assert status == UNAUTHENTICATED and b"frame 2" in data
    # The first two frames swapped (each with its own valid tag).
    request, sealed = put_call(me, to, SINK, meta, bytes(range(256)) * (3 << 12))
    swapped = sealed[frame : 2 * frame] + sealed[:frame] + sealed[2 * frame :]
    status, data = exchange(to.port, request, swapped)
    assert status == UNAUTHENTICATED and b"frame 1" in data
    # An honest put still goes through.
    request, sealed = put_call(me, to, SINK, meta, bytes(3 << 20))
    assert exchange(to.port, request, sealed)[0] == 0


def test_oversized_or_truncated_bulk_puts_cost_the_server_nothing(processes: ProcessGroup) -> None:
    server = processes.start(rpc_server_cmd())
    pid = int(server.info["pid"])
    to = hello_of(server.address)
    port = to.port
    me = Identity.generate()
    before = peak_rss_kib(pid)
    # A terabyte declared: refused from the header alone, before any buffer exists.
    status, data = exchange(port, put_request(me, to, SINK, TensorMeta("float32", (1 << 38,))))
    assert status == INVALID_ARGUMENT and b"exceeds the limit" in data
    assert (peak_rss_kib(pid) - before) / 1024 < 64
    # A sender that dies a third of the way into its payload: the server drops the call.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        request, sealed = put_call(me, to, SINK, TensorMeta("uint8", (3 << 20,)), bytes(3 << 20))
        conn.sendall(request + sealed[: 1 << 20])
    # and still serves the next one.
    ok, sealed = put_call(me, to, SINK, TensorMeta("uint8", (100,)), bytes(100))
    assert exchange(port, ok, sealed)[0] == 0


def test_clients_use_grpc_where_there_is_no_bulk_plane(processes: ProcessGroup) -> None:
    without = processes.start(rpc_server_cmd({"bulk": False}))
    with_bulk = processes.start(rpc_server_cmd())
    meta = TensorMeta("uint8", (3 << 20,))
    payload = bytes(3 << 20)

    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            ack = await client.put_tensor(without.address, SINK, meta, payload, pb.TensorAck)
            assert ack.received_bytes == len(payload)
            assert client.bulk_port(without.address) is None  # it said port 0: gRPC it is
            # A listener that cannot be reached (a firewall, a stale port): gRPC, at once.
            dead = socket.socket()
            dead.bind(("127.0.0.1", 0))
            dead_port = dead.getsockname()[1]
            dead.close()
            small = TensorMeta("uint8", (1,))
            await client.put_tensor(with_bulk.address, SINK, small, b"\0", pb.TensorAck)
            hello = client._hellos[with_bulk.address]  # who listens there, now known
            client._remember(with_bulk.address, dataclasses.replace(hello, bulk_port=dead_port))
            t0 = time.monotonic()
            ack = await client.put_tensor(with_bulk.address, SINK, meta, payload, pb.TensorAck)
            assert ack.received_bytes == len(payload) and time.monotonic() - t0 < 5
            assert client.bulk_port(with_bulk.address) is None  # not tried again for a while
        finally:
            client.close()

    trio.run(main)


def test_a_taken_port_is_a_clear_error_not_a_traceback(tmp_path: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for args in (
            ["join", "--run", "r", "--bulk-port", str(port)],
            ["serve", "--listen", f"127.0.0.1:{port}"],
        ):
            done = run_command(
                swarmd_cmd(*args, "--state-dir", str(tmp_path / args[0])), timeout=120
            )
            assert done.returncode == 2, done.stderr
            assert "cannot listen on" in done.stderr and "Traceback" not in done.stderr
    finally:
        taken.close()


def test_a_client_that_dies_mid_download_costs_the_server_no_traceback(
    processes: ProcessGroup, tmp_path: Any
) -> None:
    peer = processes.start(swarmd_cmd("serve", "--state-dir", str(tmp_path / "peer")))
    to = hello_of(peer.address)
    tensor = torch.randn(16 << 20)  # 64 MB: far more than the socket buffers hold
    me = Identity.generate()

    async def put() -> None:
        client = rpc.RpcClient(me)
        try:
            meta = tensor_meta(tensor, name="w")
            await client.put_tensor(
                peer.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck, timeout=20
            )
        finally:
            client.close()

    trio.run(put)
    body = pb.TensorRequest(name="w").SerializeToString()
    for _ in range(3):  # a reader that takes a little of the stream, then vanishes
        signed = me.sign_request(GET_TENSOR, body, recipient=to.peer_id, kx=CALLER_KEY.kx_public)
        request = bulk.encode_request(bulk.KIND_GET, GET_TENSOR, signed, body, 10)
        conn = socket.create_connection(("127.0.0.1", to.port), timeout=10)
        conn.sendall(request)
        assert len(conn.recv(1 << 16)) > 0
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset, as a SIGKILLed process leaves
    time.sleep(1.0)

    async def get() -> None:
        client = rpc.RpcClient(me)
        try:
            _, data = await client.get_tensor(
                peer.address, GET_TENSOR, pb.TensorRequest(name="w"), timeout=20
            )
            assert len(data) == tensor.numel() * 4
        finally:
            client.close()

    trio.run(get)  # still serving
    assert not any("Traceback" in line for line in peer.stderr_tail), "".join(peer.stderr_tail)
