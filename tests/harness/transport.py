"""A server's transport, seen from outside: what it says about its bulk plane (`hello_of`),
and the command line of rpc_test_server.py, the bare RPC server transport tests start."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import trio

from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.identity import Identity, PeerId
from swarmd.protocol.session import verify_server_key
from tests.harness.processes import HARNESS


def rpc_server_cmd(config: dict[str, object] | None = None) -> list[str]:
    script = HARNESS / "rpc_test_server.py"
    return [sys.executable, str(script), json.dumps(config or {})]


@dataclass(frozen=True)
class Hello:
    """What a server says about itself: where its bulk plane is and whom to address."""

    port: int
    peer_id: PeerId
    kx_public: bytes


def hello_of(address: str) -> Hello:
    async def ask() -> pb.BulkInfo:
        client = rpc.RpcClient(Identity.generate())
        try:
            return await client.unary(
                address, rpc.GET_BULK_INFO, pb.BulkInfoRequest(), pb.BulkInfo, timeout=5
            )
        finally:
            client.close()

    info = trio.run(ask)
    peer_id = verify_server_key(info.public_key, info.kx_public, info.kx_signature)
    return Hello(int(info.port), peer_id, info.kx_public)
