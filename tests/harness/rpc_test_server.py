"""A real server process for transport tests: test-only handlers on top of rpc.serve.

Usage: python rpc_test_server.py '{"max_concurrent_rpcs": 2, ...}'  (TransportConfig fields)
Prints one JSON line {"address": ..., "pid": ...} once listening; stops on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import trio

from swarmd.protocol import rpc
from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.framing import TensorMeta

SERVICE = "swarmd.test.Test"


async def main(config: rpc.TransportConfig) -> None:
    outcomes: list[str] = []

    async def sleep(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        seconds = float(req.payload.decode())
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            outcomes.append("cancelled")
            raise
        outcomes.append("completed")
        return pb.PingResponse(payload=req.payload)

    async def get_outcomes(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        return pb.PingResponse(payload=json.dumps(outcomes).encode())

    async def whoami(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        return pb.PingResponse(payload=req.payload, peer_id=str(ctx.peer_id))

    async def fail(req: pb.PingRequest, ctx: rpc.CallContext) -> pb.PingResponse:
        raise RuntimeError("boom")

    async def sink(meta: TensorMeta, data: bytearray, ctx: rpc.CallContext) -> pb.TensorAck:
        return pb.TensorAck(received_bytes=len(data))

    async def lying_source(
        req: pb.TensorRequest, ctx: rpc.CallContext
    ) -> tuple[TensorMeta, memoryview]:
        # Declares 1000 float32 but the transport refuses to send a payload of another size.
        return TensorMeta("float32", (1000,)), memoryview(bytes(10))

    service = rpc.Service(
        SERVICE,
        [
            rpc.unary("Sleep", pb.PingRequest, sleep),
            rpc.unary("Outcomes", pb.PingRequest, get_outcomes),
            rpc.unary("WhoAmI", pb.PingRequest, whoami),
            rpc.unary("Fail", pb.PingRequest, fail),
            rpc.tensor_in("Sink", sink),
            rpc.tensor_out("Lying", pb.TensorRequest, lying_source),
        ],
    )
    async with rpc.serve([service], "127.0.0.1", 0, config=config) as server:
        print(json.dumps({"address": str(server.address), "pid": os.getpid()}), flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break


if __name__ == "__main__":
    trio.run(main, rpc.TransportConfig(**json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}")))
