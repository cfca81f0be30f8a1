"""How an application describes what it serves: methods, their kinds, and the paths they answer.

Both sides name a method by its path (``/service/method``); the server registers ``Service``
objects and the client calls paths, so the description sits below both. The transport's own
service (GetBulkInfo, which tells a client the bulk data plane's port) is named here too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf.message import Message

from swarmd.protocol.calls import CallContext
from swarmd.protocol.framing import Payload, TensorMeta

UnaryHandler = Callable[[Any, CallContext], Awaitable[Message]]
TensorInHandler = Callable[[TensorMeta, bytearray, CallContext], Awaitable[Message]]
#: Looks at a tensor_in call's declared tensor (and who sends it) before any of its memory is
#: allocated, and raises RpcError to refuse it: the method knows what size it asked for.
TensorAdmit = Callable[[TensorMeta, CallContext], Awaitable[None]]
#: A tensor_out handler may return its payload in pieces (see framing.Payload).
TensorOutHandler = Callable[[Any, CallContext], Awaitable[tuple[TensorMeta, Payload]]]


@dataclass(frozen=True)
class Method:
    name: str
    kind: Literal["unary", "tensor_in", "tensor_out"]
    handler: Callable[..., Awaitable[Any]]
    request_type: type[Message] | None = None
    admit: TensorAdmit | None = None


def unary(name: str, request_type: type[Message], handler: UnaryHandler) -> Method:
    return Method(name, "unary", handler, request_type)


def tensor_in(name: str, handler: TensorInHandler, admit: TensorAdmit | None = None) -> Method:
    """A method that receives a tensor. Without ``admit``, any tensor up to the transport's
    max_tensor_bytes is received from any authenticated sender: give one for methods that
    strangers can reach."""
    return Method(name, "tensor_in", handler, admit=admit)


def tensor_out(name: str, request_type: type[Message], handler: TensorOutHandler) -> Method:
    return Method(name, "tensor_out", handler, request_type)


#: Decides, once the caller is authenticated and before the method sees anything, whether it
#: may call this service at all; raises RpcError (PERMISSION_DENIED) to refuse. A run's
#: services are gated by its access rules (node/access.py); the DHT and Ping are not.
Gate = Callable[[CallContext], None]


@dataclass(frozen=True)
class Service:
    name: str
    methods: Sequence[Method]
    gate: Gate | None = None


TRANSPORT_SERVICE = "swarmd.v1.Transport"
GET_BULK_INFO = f"/{TRANSPORT_SERVICE}/GetBulkInfo"


def method_path(service: str, method: str) -> str:
    return f"/{service}/{method}"
