from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("format_version", "round", "total_bytes", "chunk_bytes", "chunk_hashes", "tensors", "meta")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    round: int
    total_bytes: int
    chunk_bytes: int
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    meta: _containers.RepeatedCompositeFieldContainer[MetaItem]
    def __init__(self, format_version: _Optional[int] = ..., round: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., meta: _Optional[_Iterable[_Union[MetaItem, _Mapping]]] = ...) -> None: ...

class MetaItem(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("state_hash",)
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    state_hash: bytes
    def __init__(self, state_hash: _Optional[bytes] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest", "state_hash")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    state_hash: bytes
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., state_hash: _Optional[bytes] = ...) -> None: ...

class GetChunkRequest(_message.Message):
    __slots__ = ("state_hash", "index")
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    state_hash: bytes
    index: int
    def __init__(self, state_hash: _Optional[bytes] = ..., index: _Optional[int] = ...) -> None: ...

class StateAdvert(_message.Message):
    __slots__ = ("round", "state_hash", "address", "total_bytes", "shared", "client")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    state_hash: bytes
    address: str
    total_bytes: int
    shared: bool
    client: bool
    def __init__(self, round: _Optional[int] = ..., state_hash: _Optional[bytes] = ..., address: _Optional[str] = ..., total_bytes: _Optional[int] = ..., shared: _Optional[bool] = ..., client: _Optional[bool] = ...) -> None: ...

class ChunkFrameDoc(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...
