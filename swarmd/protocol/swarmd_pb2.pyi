from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("payload", "version", "peer_id", "server_time_ms")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    version: str
    peer_id: str
    server_time_ms: int
    def __init__(self, payload: _Optional[bytes] = ..., version: _Optional[str] = ..., peer_id: _Optional[str] = ..., server_time_ms: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes", "name", "info")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    name: str
    info: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., name: _Optional[str] = ..., info: _Optional[bytes] = ...) -> None: ...

class TensorAck(_message.Message):
    __slots__ = ("received_bytes", "digest", "round", "state")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    digest: bytes
    round: int
    state: bytes
    def __init__(self, received_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., round: _Optional[int] = ..., state: _Optional[bytes] = ...) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TensorFrameDoc(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BulkInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkInfo(_message.Message):
    __slots__ = ("port", "public_key", "kx_public", "kx_signature")
    PORT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KX_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    KX_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    port: int
    public_key: bytes
    kx_public: bytes
    kx_signature: bytes
    def __init__(self, port: _Optional[int] = ..., public_key: _Optional[bytes] = ..., kx_public: _Optional[bytes] = ..., kx_signature: _Optional[bytes] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("port", "bulk_port", "host")
    PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    port: int
    bulk_port: int
    host: str
    def __init__(self, port: _Optional[int] = ..., bulk_port: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class DialBackResponse(_message.Message):
    __slots__ = ("observed", "reachable", "bulk_reachable", "detail")
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    BULK_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    observed: str
    reachable: bool
    bulk_reachable: bool
    detail: str
    def __init__(self, observed: _Optional[str] = ..., reachable: _Optional[bool] = ..., bulk_reachable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
