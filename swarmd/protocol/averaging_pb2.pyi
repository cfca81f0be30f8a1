from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PartInfo(_message.Message):
    __slots__ = ("round_id", "part", "weight", "attempt")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    part: int
    weight: float
    attempt: int
    def __init__(self, round_id: _Optional[bytes] = ..., part: _Optional[int] = ..., weight: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class PartAck(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class GetPartRequest(_message.Message):
    __slots__ = ("round_id", "part", "attempt", "relay")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    part: int
    attempt: int
    relay: bool
    def __init__(self, round_id: _Optional[bytes] = ..., part: _Optional[int] = ..., attempt: _Optional[int] = ..., relay: _Optional[bool] = ...) -> None: ...
