"""gRPC's futures awaited from trio: a cancelled trio scope cancels the call, so a trio
timeout on one peer becomes a cancelled handler on the other; gRPC's errors become RpcError."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc
import trio

from swarmd.protocol.calls import RpcError, StatusCode


async def await_future(fut: grpc.Future) -> Any:
    """Awaits a gRPC future from trio; cancelling the awaiting scope cancels the call."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: grpc.Future) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    fut.add_done_callback(wake)
    try:
        await done.wait()
    except trio.Cancelled:
        fut.cancel()
        raise
    try:
        return fut.result()
    except grpc.RpcError as exc:
        raise from_grpc(exc) from None


def from_grpc(exc: grpc.RpcError) -> RpcError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    return RpcError(StatusCode[name], details or "")
