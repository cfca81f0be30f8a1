from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeInfo(_message.Message):
    __slots__ = ("peer_id", "address")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    address: str
    def __init__(self, peer_id: _Optional[bytes] = ..., address: _Optional[str] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("key", "has_subkey", "subkey", "value", "expires_ms", "owner_key", "signature")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HAS_SUBKEY_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    has_subkey: bool
    subkey: bytes
    value: bytes
    expires_ms: int
    owner_key: bytes
    signature: bytes
    def __init__(self, key: _Optional[bytes] = ..., has_subkey: _Optional[bool] = ..., subkey: _Optional[bytes] = ..., value: _Optional[bytes] = ..., expires_ms: _Optional[int] = ..., owner_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Proof(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("sender_port", "challenge")
    SENDER_PORT_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    sender_port: int
    challenge: bytes
    def __init__(self, sender_port: _Optional[int] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("peer_id", "proof")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    proof: Proof
    def __init__(self, peer_id: _Optional[bytes] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("sender_port", "records")
    SENDER_PORT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    sender_port: int
    records: _containers.RepeatedCompositeFieldContainer[Record]
    def __init__(self, sender_port: _Optional[int] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("outcomes", "reasons")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[StoreResponse.Outcome]
        SUPERSEDED: _ClassVar[StoreResponse.Outcome]
        REFUSED: _ClassVar[StoreResponse.Outcome]
    STORED: StoreResponse.Outcome
    SUPERSEDED: StoreResponse.Outcome
    REFUSED: StoreResponse.Outcome
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[StoreResponse.Outcome]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[StoreResponse.Outcome, str]]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class FindRequest(_message.Message):
    __slots__ = ("sender_port", "targets", "keys", "challenge", "known", "nodes_only_if_empty")
    SENDER_PORT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NODES_ONLY_IF_EMPTY_FIELD_NUMBER: _ClassVar[int]
    sender_port: int
    targets: _containers.RepeatedScalarFieldContainer[bytes]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    challenge: bytes
    known: _containers.RepeatedScalarFieldContainer[bytes]
    nodes_only_if_empty: bool
    def __init__(self, sender_port: _Optional[int] = ..., targets: _Optional[_Iterable[bytes]] = ..., keys: _Optional[_Iterable[bytes]] = ..., challenge: _Optional[bytes] = ..., known: _Optional[_Iterable[bytes]] = ..., nodes_only_if_empty: _Optional[bool] = ...) -> None: ...

class FindResult(_message.Message):
    __slots__ = ("records", "nodes", "omitted")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    omitted: int
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., omitted: _Optional[int] = ...) -> None: ...

class FindResponse(_message.Message):
    __slots__ = ("results", "peer_id", "proof")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[FindResult]
    peer_id: bytes
    proof: Proof
    def __init__(self, results: _Optional[_Iterable[_Union[FindResult, _Mapping]]] = ..., peer_id: _Optional[bytes] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ...) -> None: ...
