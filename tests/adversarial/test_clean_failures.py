"""Bad input and a hostile disk fail cleanly (issue 31, item 5), against real peer processes.

Before: a request whose timestamp had 400 digits came back as gRPC INTERNAL (an OverflowError
inside the server); a `kill -9` mid-save left temp files that nothing removed; a full disk
during a save ended the peer with a raw traceback.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import Message

from swarmd.node.averaging.allreduce import Averager
from swarmd.node.dht import DHTNode
from swarmd.node.peer.service import Scratch, peer_service
from swarmd.node.statesync.donor import StateDonor
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.dht_pb2 import PingRequest
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.identity import Identity
from tests.harness.join import events_until_exit, join_cmd, start_bootstrap
from tests.harness.processes import Proc, ProcessGroup
from tests.harness.runs import TINY_RUN

LONE_RUN = TINY_RUN.replace("min_group_size = 2", "min_group_size = 1")


def _start_peer(processes: ProcessGroup, tmp: Path, steps: int, state_dir: str = "p0") -> Proc:
    (tmp / "run.toml").write_text(LONE_RUN)
    boot = start_bootstrap(processes, tmp)
    cmd = join_cmd(tmp, state_dir, boot, "--create-run", str(tmp / "run.toml"), steps=steps)
    return processes.start(cmd)


# -- numbers at their extremes ---------------------------------------------------------------

_EXTREMES: dict[int, list[Any]] = {
    FieldDescriptor.CPPTYPE_INT32: [-(1 << 31), (1 << 31) - 1],
    FieldDescriptor.CPPTYPE_INT64: [-(1 << 63), (1 << 63) - 1],
    FieldDescriptor.CPPTYPE_UINT32: [(1 << 32) - 1, 0],
    FieldDescriptor.CPPTYPE_UINT64: [(1 << 64) - 1, 0],
    FieldDescriptor.CPPTYPE_DOUBLE: [math.nan, math.inf, -math.inf, 1e308, -1e-320],
    FieldDescriptor.CPPTYPE_FLOAT: [math.nan, math.inf, -math.inf, 3.4e38],
}


def _fill(message: Message, pick: int) -> Message:
    """Every numeric field (nested and repeated too) at its `pick`-th extreme."""
    for field in message.DESCRIPTOR.fields:
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if field.is_repeated:
                _fill(getattr(message, field.name).add(), pick)
            else:
                _fill(getattr(message, field.name), pick)
            continue
        values = _EXTREMES.get(field.cpp_type)
        if values is None:
            continue
        value = values[pick % len(values)]
        if field.is_repeated:
            getattr(message, field.name).append(value)
        else:
            setattr(message, field.name, value)
    return message


def _methods() -> Iterator[tuple[str, rpc.Method]]:
    """Every method a training peer serves (lifecycle.Peer._services), from the real tables."""
    identity = Identity.generate()
    client = rpc.RpcClient(identity)
    services = [
        peer_service(identity, Scratch(1 << 10)),
        DHTNode(identity, client).service(),
        Averager(client, identity.peer_id).service(),
        StateDonor().service(),
    ]
    for service in services:
        for method in service.methods:
            yield rpc.method_path(service.name, method.name), method
    client.close()


async def _fuzz(address: str) -> list[str]:
    """Calls every method with every field at each extreme; the codes that came back wrong."""
    client = rpc.RpcClient(Identity.generate())
    wrong: list[str] = []
    codes: dict[str, set[str]] = {path: set() for path, _ in _methods()}

    async def call(path: str, method: rpc.Method, pick: int) -> None:
        try:
            if method.kind == "tensor_in":
                info = _fill(apb.PartInfo(), pick).SerializeToString()
                meta = TensorMeta("uint8", (16,), info=info)
                await client.put_tensor(address, path, meta, [bytes(16)], Empty, timeout=15)
            else:
                assert method.request_type is not None
                request = _fill(method.request_type(), pick)
                if method.kind == "unary":
                    await client.unary(address, path, request, Empty, timeout=15)
                else:
                    await client.get_tensor(address, path, request, timeout=15, max_bytes=1 << 20)
            codes[path].add("OK")
        except rpc.RpcError as exc:
            codes[path].add(exc.code.name)
            if exc.code in (rpc.StatusCode.INTERNAL, rpc.StatusCode.UNKNOWN):
                wrong.append(f"{path} #{pick}: {exc.code.name} {exc.details}")

    async with trio.open_nursery() as nursery:
        for path, method in _methods():
            for pick in range(5):
                nursery.start_soon(call, path, method, pick)
    client.close()
    # Every method was reached and answered (an exception of the test's own would have
    # escaped the nursery above): the fuzz touched the handlers, not just the client.
    assert all(codes.values()), codes
    return wrong


def test_extreme_numbers_and_a_400_digit_timestamp_are_refused_cleanly(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    peer = _start_peer(processes, tmp_path, steps=100_000)
    address = peer.address
    wrong = trio.run(_fuzz, address)
    assert not wrong, wrong
    # A signed header whose timestamp has 400 digits, straight over gRPC.
    identity = Identity.generate()
    body = PingRequest().SerializeToString()
    signed = identity.sign_request("/swarmd.dht.v1.DHT/Ping", body)
    metadata = [(k, "9" * 400 if k == "swarmd-ts" else v) for k, v in signed.to_metadata()]
    with grpc.insecure_channel(address) as channel:
        ping = channel.unary_unary(
            "/swarmd.dht.v1.DHT/Ping",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as caught:
            ping(body, metadata=metadata, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    # And the peer is still serving.
    assert peer.process.poll() is None
    assert trio.run(_ping, address)


async def _ping(address: str) -> bool:
    client = rpc.RpcClient(Identity.generate())
    try:
        await client.unary(address, "/swarmd.dht.v1.DHT/Ping", PingRequest(), Empty, timeout=10)
    except rpc.RpcError as exc:
        return exc.code is not rpc.StatusCode.INTERNAL
    finally:
        client.close()
    return True


# -- the disk ----------------------------------------------------------------------------------


def test_stale_temp_files_of_a_killed_save_are_removed_at_start(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    state_dir = tmp_path / "p0"
    state_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = state_dir / f".state.pt.{int(dead.stdout)}.tmp"
    stale.write_bytes(bytes(4 << 20))  # what a `kill -9` mid-save leaves
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        saving = state_dir / f".state.pt.{live.pid}.tmp"  # another process saving right now
        saving.write_bytes(b"x")
        peer = _start_peer(processes, tmp_path, steps=10)
        events = events_until_exit(peer)
        assert peer.process.returncode == 0, "".join(peer.stderr_tail)
        assert any(e["event"] == "outer_step" for e in events)
        assert not stale.exists()
        assert saving.exists()
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 320 KiB filesystem (tmpfs): room for the peer's key, not for its state."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_keeps_the_peer_training(
    processes: ProcessGroup, tmp_path: Path, small_disk: Path
) -> None:
    (tmp_path / "run.toml").write_text(LONE_RUN)
    boot = start_bootstrap(processes, tmp_path)
    cmd = join_cmd(tmp_path, "unused", boot, "--create-run", str(tmp_path / "run.toml"), steps=20)
    cmd[cmd.index("--state-dir") + 1] = str(small_disk)
    peer = processes.start(cmd)
    events = events_until_exit(peer)
    stderr = "".join(peer.stderr_tail)
    assert peer.process.returncode == 0, stderr
    steps = [e for e in events if e["event"] == "outer_step"]
    assert len(steps) >= 4, events  # it trained on through every failed save
    assert "No space left on device" in stderr and "training goes on" in stderr
    assert stderr.count("could not save the state") == 1  # said once, not every round
    assert "Traceback" not in stderr
    assert not list(small_disk.glob(".state.pt.*.tmp"))  # nothing half-written left behind
