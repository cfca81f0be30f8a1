"""What a call is, on either wire (gRPC in rpc.py, the bulk data plane in bulk.py): its
status codes and error, what a handler knows of it, and who hears about its figures.

Kept apart from rpc.py so that bulk.py shares these without importing grpc."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Protocol, TypeVar

import trio
from google.protobuf.message import Message

from swarmd.protocol.errors import AuthError, MalformedHeader, ProtocolError
from swarmd.protocol.framing import Payload, TensorMeta
from swarmd.protocol.identity import Identity, PeerId


class StatusCode(enum.Enum):
    """gRPC status codes, re-exported so that nothing outside this module imports grpc."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class RpcError(Exception):
    """A call failed with a status; raised by clients, and by handlers to choose the status."""

    def __init__(self, code: StatusCode, details: str = "") -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name


#: The end of a rate limit's refusal: when the bucket holds a token again (`rate_limited`).
_RETRY_IN = re.compile(r": retry in (\d{1,6}) ms$")


def rate_limited(scope: str, wait_s: float) -> RpcError:
    """A call refused by the ``scope`` bucket of a server's rate limits, naming its wait.

    The wait travels in the details, the one field both wires carry: an honest client makes
    the call again after it (`retry_after`) instead of failing. Failing, an honest member of
    a fast run (rounds of 50 ms) lost its part of an all-reduce to its reducer's limit and
    the two members' states split for good (CI: test_run_access)."""
    ms = max(1, math.ceil(wait_s * 1000))
    return RpcError(
        StatusCode.RESOURCE_EXHAUSTED, f"too many requests from this {scope}: retry in {ms} ms"
    )


def retry_after(exc: RpcError) -> float | None:
    """The seconds a rate limit's refusal asked the caller to wait; None for any other error
    (a busy stage, a full receive budget: those have their own handling)."""
    if exc.code is not StatusCode.RESOURCE_EXHAUSTED:
        return None
    found = _RETRY_IN.search(exc.details)
    return None if found is None else int(found.group(1)) / 1000


@dataclass(frozen=True)
class CallContext:
    """What a handler knows about the call it serves."""

    method: str
    #: The verified sender; None only on servers that do not require authentication.
    peer_id: PeerId | None
    #: The transport address as gRPC reports it (e.g. "ipv4:127.0.0.1:5555").
    peer: str
    #: The request's signature and the access tag sent with it (SignedHeader.access), for a
    #: service's gate; empty on unsigned calls.
    signature: bytes = b""
    access: bytes = b""


class RpcObserver(Protocol):
    """Receives per-call figures; node/metrics.py implements it (protocol must not import node)."""

    def on_served(self, method: str, code: str, duration_s: float) -> None: ...

    def on_bytes(self, method: str, sent: int, received: int) -> None: ...

    def on_limited(self, scope: str) -> None:
        """A call refused by a rate limit (scope: "address" or "peer"). No method label: on
        the bulk plane the path is the stranger's string until it is checked."""


class NullObserver:
    def on_served(self, method: str, code: str, duration_s: float) -> None:
        pass

    def on_bytes(self, method: str, sent: int, received: int) -> None:
        pass

    def on_limited(self, scope: str) -> None:
        pass


def to_rpc_error(exc: BaseException) -> RpcError:
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, MalformedHeader):
        return RpcError(StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, AuthError):
        return RpcError(StatusCode.UNAUTHENTICATED, str(exc))
    if isinstance(exc, ProtocolError):
        return RpcError(StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, trio.TooSlowError):
        return RpcError(StatusCode.DEADLINE_EXCEEDED, "handler timed out")
    return RpcError(StatusCode.INTERNAL, f"{type(exc).__name__} in handler")


M = TypeVar("M", bound=Message)


class UnaryCaller(Protocol):
    """What a component that only makes unary calls needs of a client: RpcClient over gRPC,
    or the simulator's in-memory network (swarmd/sim), which carries the same signed bytes."""

    async def unary(
        self,
        address: str,
        path: str,
        request: Message,
        response_type: type[M],
        *,
        timeout: float | None = None,
        recipient: PeerId | None = None,
    ) -> M: ...


class TensorCaller(UnaryCaller, Protocol):
    """What the all-reduce needs of a client: unary and tensor calls, and who it speaks as
    (a reducer signs its proofs). RpcClient, or the simulator's in-memory network."""

    identity: Identity | None

    async def put_tensor(
        self,
        address: str,
        path: str,
        meta: TensorMeta,
        payload: Payload,
        response_type: type[M],
        *,
        timeout: float | None = None,
        expect: PeerId | None = None,
    ) -> M: ...

    async def get_tensor(
        self,
        address: str,
        path: str,
        request: Message,
        *,
        timeout: float | None = None,
        max_bytes: int | None = None,
        expect: PeerId | None = None,
    ) -> tuple[TensorMeta, bytearray]: ...
