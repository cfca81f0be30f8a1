"""The transport between real processes on loopback: swarmd serve and a test server."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch
import trio

import swarmd
from swarmd.node.peer.service import GET_TENSOR, PING, PUT_TENSOR, digest
from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.framing import TAG_DATA, TensorMeta, header_frame, iter_frames
from swarmd.protocol.identity import Identity
from swarmd.protocol.session import CALLER, CallerKey, seal_frames
from swarmd.protocol.tensors import tensor_from_bytes, tensor_meta, tensor_payload
from tests.harness.processes import Proc, ProcessGroup, peak_rss_kib, swarmd_cmd
from tests.harness.transport import Hello, hello_of, rpc_server_cmd

TEST = "/swarmd.test.Test"


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


@pytest.fixture
def peer(processes: ProcessGroup, tmp_path: Any) -> Proc:
    return processes.start(
        swarmd_cmd("serve", "--state-dir", str(tmp_path / "peer"), "--metrics", "127.0.0.1:0")
    )


@pytest.fixture
def test_server(processes: ProcessGroup) -> Proc:
    return processes.start(rpc_server_cmd())


def test_round_trip_between_processes(peer: Proc) -> None:
    tensor = torch.randn(300, 1000)  # 1.2 MB: more than one 1 MiB frame

    async def main() -> None:
        me = Identity.generate()
        client = rpc.RpcClient(me)
        try:
            resp = await client.unary(
                peer.address, PING, pb.PingRequest(payload=b"hello"), pb.PingResponse, timeout=5
            )
            assert resp.payload == b"hello"
            assert resp.peer_id == peer.info["peer_id"]
            meta = tensor_meta(tensor, name="w")
            ack = await client.put_tensor(
                peer.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck, timeout=10
            )
            assert ack.received_bytes == tensor.numel() * 4
            assert ack.digest == digest(tensor_payload(tensor))
            got_meta, data = await client.get_tensor(
                peer.address, GET_TENSOR, pb.TensorRequest(name="w"), timeout=10
            )
            assert got_meta == meta
            assert torch.equal(tensor_from_bytes(got_meta, data), tensor)
            with pytest.raises(rpc.RpcError) as info:
                await client.get_tensor(peer.address, GET_TENSOR, pb.TensorRequest(name="nope"))
            assert info.value.code is rpc.StatusCode.NOT_FOUND
        finally:
            client.close()

    run(main)


def test_health_service_answers(peer: Proc, test_server: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(None)
        try:
            assert await client.check_health(peer.address, timeout=5) == "SERVING"
            assert (
                await client.check_health(peer.address, service="swarmd.v1.Peer", timeout=5)
                == "SERVING"
            )
            assert await client.check_health(test_server.address, timeout=5) == "SERVING"
            with pytest.raises(rpc.RpcError) as info:
                await client.check_health(peer.address, service="no.such.Service", timeout=5)
            assert info.value.code is rpc.StatusCode.NOT_FOUND
        finally:
            client.close()

    run(main)


async def _outcomes(client: rpc.RpcClient, address: str) -> list[str]:
    resp = await client.unary(address, f"{TEST}/Outcomes", pb.PingRequest(), pb.PingResponse)
    result: list[str] = json.loads(resp.payload)
    return result


async def _wait_outcome(client: rpc.RpcClient, address: str, expected: list[str]) -> None:
    with trio.fail_after(5):
        while (got := await _outcomes(client, address)) != expected:
            assert len(got) <= len(expected), got
            await trio.sleep(0.02)


def test_deadline_exceeded_on_slow_handler(test_server: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            start = time.monotonic()
            with pytest.raises(rpc.RpcError) as info:
                await client.unary(
                    test_server.address,
                    f"{TEST}/Sleep",
                    pb.PingRequest(payload=b"30"),
                    pb.PingResponse,
                    timeout=0.3,
                )
            assert info.value.code is rpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 3
            # The deadline reached the server: its handler was cancelled, not left running.
            await _wait_outcome(client, test_server.address, ["cancelled"])
        finally:
            client.close()

    run(main)


def test_trio_cancel_reaches_server_handler(test_server: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            with trio.move_on_after(0.3) as scope:
                await client.unary(
                    test_server.address,
                    f"{TEST}/Sleep",
                    pb.PingRequest(payload=b"30"),
                    pb.PingResponse,
                    timeout=60,
                )
            assert scope.cancelled_caught
            await _wait_outcome(client, test_server.address, ["cancelled"])
            # An enclosing trio deadline also bounds the call's gRPC deadline.
            with trio.move_on_after(0.3):
                await client.unary(
                    test_server.address,
                    f"{TEST}/Sleep",
                    pb.PingRequest(payload=b"0.01"),
                    pb.PingResponse,
                )
            await _wait_outcome(client, test_server.address, ["cancelled", "completed"])
        finally:
            client.close()

    run(main)


def test_server_refuses_past_concurrency_bound(processes: ProcessGroup) -> None:
    server = processes.start(rpc_server_cmd({"max_concurrent_rpcs": 2}))

    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        results: list[str] = []

        async def slow() -> None:
            await client.unary(
                server.address, f"{TEST}/Sleep", pb.PingRequest(payload=b"1.5"), pb.PingResponse
            )
            results.append("slow done")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                nursery.start_soon(slow)
                await trio.sleep(0.5)
                start = time.monotonic()
                with pytest.raises(rpc.RpcError) as info:
                    await client.unary(
                        server.address,
                        f"{TEST}/Sleep",
                        pb.PingRequest(payload=b"0"),
                        pb.PingResponse,
                        timeout=5,
                    )
                assert info.value.code is rpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() - start < 0.5  # refused at once, not queued
            assert results == ["slow done", "slow done"]
        finally:
            client.close()

    run(main)


def test_handler_exception_is_internal_error(test_server: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            with pytest.raises(rpc.RpcError) as info:
                await client.unary(
                    test_server.address, f"{TEST}/Fail", pb.PingRequest(), pb.PingResponse
                )
            assert info.value.code is rpc.StatusCode.INTERNAL
            assert "RuntimeError" in info.value.details
        finally:
            client.close()

    run(main)


_CALLER_KEY = CallerKey()


def _signed(identity: Identity, to: Hello, path: str, body: bytes, **kw: Any) -> list[Any]:
    """Metadata of a request signed by ``identity`` and addressed to ``to``."""
    return identity.sign_request(path, body, recipient=to.peer_id, **kw).to_metadata()


def _signed_stream(
    identity: Identity, to: Hello, path: str, frames: list[bytes]
) -> tuple[list[Any], list[bytes]]:
    """A tensor stream as a client sends it: signed metadata and the frames after the first
    sealed with the call's key."""
    signed = identity.sign_request(path, frames[0], recipient=to.peer_id, kx=_CALLER_KEY.kx_public)
    mac = _CALLER_KEY.stream_mac(signed, to.peer_id, to.kx_public)
    return signed.to_metadata(), [frames[0], *seal_frames(mac, CALLER, frames[1:], 1)]


def test_forged_unsigned_replayed_and_skewed_requests_refused(test_server: Proc) -> None:
    path = f"{TEST}/WhoAmI"
    me = Identity.generate()
    to = hello_of(test_server.address)
    body = pb.PingRequest(payload=b"x").SerializeToString()
    with grpc.insecure_channel(test_server.address) as channel:
        call = channel.unary_unary(path)

        def code_of(metadata: list[tuple[str, Any]], request: bytes = body) -> grpc.StatusCode:
            try:
                call(request, metadata=metadata, timeout=5)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        good = _signed(me, to, path, body)
        reply = pb.PingResponse.FromString(call(body, metadata=good, timeout=5))
        assert reply.peer_id == str(me.peer_id)  # the handler sees the verified sender
        assert code_of(good) == grpc.StatusCode.UNAUTHENTICATED  # replay of the same request
        assert code_of([]) == grpc.StatusCode.UNAUTHENTICATED  # unsigned
        # Signature over another body: a tampered request.
        other = pb.PingRequest(payload=b"y").SerializeToString()
        assert code_of(_signed(me, to, path, other)) == grpc.StatusCode.UNAUTHENTICATED
        # A key that did not make the signature: someone claiming another identity.
        forged = dict(_signed(me, to, path, body))
        forged["swarmd-key-bin"] = Identity.generate().public_key
        assert code_of(list(forged.items())) == grpc.StatusCode.UNAUTHENTICATED
        # Signed for another method.
        assert code_of(_signed(me, to, f"{TEST}/Sleep", body)) == grpc.StatusCode.UNAUTHENTICATED
        # A clock two minutes behind (the bound is 30 s).
        stale = _signed(me, to, path, body, now=time.time() - 120)
        assert code_of(stale) == grpc.StatusCode.UNAUTHENTICATED
        # Addressed to another server (captured there, replayed here), or to nobody.
        elsewhere = Hello(to.port, Identity.generate().peer_id, to.kx_public)
        assert code_of(_signed(me, elsewhere, path, body)) == grpc.StatusCode.UNAUTHENTICATED
        unaddressed = me.sign_request(path, body).to_metadata()
        assert code_of(unaddressed) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(_signed(me, to, path, body)) == grpc.StatusCode.OK


def test_oversized_message_refused_without_allocating(test_server: Proc) -> None:
    pid = int(test_server.info["pid"])
    to = hello_of(test_server.address)
    before = peak_rss_kib(pid)
    me = Identity.generate()
    big = bytes(256 << 20)  # 64x the server's 4 MiB message limit
    options = [("grpc.max_send_message_length", 512 << 20)]
    with grpc.insecure_channel(test_server.address, options=options) as channel:
        path = f"{TEST}/WhoAmI"
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(path)(big, metadata=_signed(me, to, path, big), timeout=20)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    growth_mib = (peak_rss_kib(pid) - before) / 1024
    assert growth_mib < 64, f"server peak memory grew by {growth_mib:.0f} MiB"


def test_stream_with_lying_header_refused(test_server: Proc) -> None:
    pid = int(test_server.info["pid"])
    before = peak_rss_kib(pid)
    me = Identity.generate()
    to = hello_of(test_server.address)
    path = f"{TEST}/Sink"

    def send(frames: list[bytes]) -> tuple[grpc.StatusCode, str]:
        metadata, sealed = _signed_stream(me, to, path, frames)
        with grpc.insecure_channel(test_server.address) as channel:
            try:
                channel.stream_unary(path)(iter(sealed), metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""

    # Declares a terabyte: refused from the header alone, nothing allocated.
    huge = header_frame(TensorMeta("float32", (1 << 38,)))
    code, details = send([huge, bytes([TAG_DATA]) + bytes(16)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in details
    assert (peak_rss_kib(pid) - before) / 1024 < 64
    # nbytes field disagrees with dtype x shape.
    liar = pb.TensorHeader(dtype="float32", shape=[10], nbytes=8).SerializeToString()
    code, details = send([b"\x01" + liar])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "need 40" in details
    # Declares 10 floats, sends more.
    small = header_frame(TensorMeta("float32", (10,)))
    code, details = send([small, bytes([TAG_DATA]) + bytes(80)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than the declared" in details
    # Declares 10 floats, sends fewer.
    code, details = send([small, bytes([TAG_DATA]) + bytes(12)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in details
    # Unknown dtype and negative shape.
    bad = pb.TensorHeader(dtype="complex512", shape=[1], nbytes=64).SerializeToString()
    code, details = send([b"\x01" + bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown dtype" in details
    neg = pb.TensorHeader(dtype="float32", shape=[-4], nbytes=0).SerializeToString()
    code, details = send([b"\x01" + neg])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "negative" in details
    # A well-formed stream still works afterwards.
    code, _ = send([small, bytes([TAG_DATA]) + bytes(40)])
    assert code == grpc.StatusCode.OK


def test_grpc_tensor_streams_are_sealed_both_ways(peer: Proc) -> None:
    """Without the bulk plane, frames travel as gRPC messages: each still carries its tag."""
    tensor = torch.randn(3 << 18)  # 3 MiB: several frames

    async def main() -> None:
        client = rpc.RpcClient(Identity.generate(), rpc.TransportConfig(bulk=False))
        try:
            meta = tensor_meta(tensor, name="g")
            await client.put_tensor(
                peer.address, PUT_TENSOR, meta, tensor_payload(tensor), pb.TensorAck
            )
            got, data = await client.get_tensor(
                peer.address, GET_TENSOR, pb.TensorRequest(name="g")
            )
            assert got == meta and torch.equal(tensor_from_bytes(got, data), tensor)
            assert client.bulk_port(peer.address) is None  # it was gRPC both ways
        finally:
            client.close()

    run(main)
    # One byte of a sealed data frame flipped on the way: refused, naming the frame.
    me, to = Identity.generate(), hello_of(peer.address)
    meta = tensor_meta(tensor, name="g")
    frames = list(iter_frames(meta, tensor_payload(tensor), 1 << 20))
    metadata, sealed = _signed_stream(me, to, PUT_TENSOR, frames)
    altered = bytearray(sealed[2])
    altered[10] ^= 1
    sealed[2] = bytes(altered)
    with grpc.insecure_channel(peer.address) as channel, pytest.raises(grpc.RpcError) as info:
        channel.stream_unary(PUT_TENSOR)(iter(sealed), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "frame 2" in (info.value.details() or "")


def test_server_cannot_send_a_tensor_that_contradicts_its_header(test_server: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            with pytest.raises(rpc.RpcError) as info:
                await client.get_tensor(test_server.address, f"{TEST}/Lying", pb.TensorRequest())
            assert info.value.code is rpc.StatusCode.INVALID_ARGUMENT
        finally:
            client.close()

    run(main)


def test_metrics_endpoint_counts_rpcs_without_peer_ids(peer: Proc) -> None:
    async def main() -> None:
        client = rpc.RpcClient(Identity.generate())
        try:
            for _ in range(3):
                await client.unary(
                    peer.address, PING, pb.PingRequest(payload=b"abc"), pb.PingResponse
                )
            with pytest.raises(rpc.RpcError):
                await client.get_tensor(peer.address, GET_TENSOR, pb.TensorRequest(name="x"))
        finally:
            client.close()

    run(main)
    url = f"http://127.0.0.1:{peer.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert f'swarmd_build_info{{version="{swarmd.__version__}"}} 1.0' in text
    assert 'swarmd_rpc_requests_total{code="OK",method="/swarmd.v1.Peer/Ping"} 3.0' in text
    assert (
        'swarmd_rpc_requests_total{code="NOT_FOUND",method="/swarmd.v1.Peer/GetTensor"} 1.0' in text
    )
    assert 'swarmd_rpc_duration_seconds_count{method="/swarmd.v1.Peer/Ping"} 3.0' in text
    ping = 'method="/swarmd.v1.Peer/Ping"'
    received = [ln for ln in text.splitlines() if ln.startswith("swarmd_received_bytes_total")]
    assert any(ping in ln and float(ln.rsplit(maxsplit=1)[1]) > 0 for ln in received)
    sent = [ln for ln in text.splitlines() if ln.startswith("swarmd_sent_bytes_total")]
    assert any(ping in ln and float(ln.rsplit(maxsplit=1)[1]) > 0 for ln in sent)
    assert str(peer.info["peer_id"]) not in text
