from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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

class MemberInfo(_message.Message):
    __slots__ = ("address", "bandwidth", "group", "client", "stands_for", "withdrawn")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    STANDS_FOR_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    address: str
    bandwidth: float
    group: bytes
    client: bool
    stands_for: _containers.RepeatedScalarFieldContainer[bytes]
    withdrawn: bool
    def __init__(self, address: _Optional[str] = ..., bandwidth: _Optional[float] = ..., group: _Optional[bytes] = ..., client: _Optional[bool] = ..., stands_for: _Optional[_Iterable[bytes]] = ..., withdrawn: _Optional[bool] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("peer_id", "address", "bandwidth", "client")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    address: str
    bandwidth: float
    client: bool
    def __init__(self, peer_id: _Optional[bytes] = ..., address: _Optional[str] = ..., bandwidth: _Optional[float] = ..., client: _Optional[bool] = ...) -> None: ...

class GroupRecord(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    def __init__(self, members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ...) -> None: ...

class ProofRequest(_message.Message):
    __slots__ = ("round_id", "part", "attempt", "nonce")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    part: int
    attempt: int
    nonce: bytes
    def __init__(self, round_id: _Optional[bytes] = ..., part: _Optional[int] = ..., attempt: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ProofEntry(_message.Message):
    __slots__ = ("member", "weight", "projections")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    member: int
    weight: float
    projections: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, member: _Optional[int] = ..., weight: _Optional[float] = ..., projections: _Optional[_Iterable[float]] = ...) -> None: ...

class ProofNonce(_message.Message):
    __slots__ = ("member", "nonce")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    member: int
    nonce: bytes
    def __init__(self, member: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class PartProof(_message.Message):
    __slots__ = ("entries", "nonces", "digest", "own_commitment", "own_reveal", "own_paths", "signer_key", "signature")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NONCES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OWN_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    OWN_REVEAL_FIELD_NUMBER: _ClassVar[int]
    OWN_PATHS_FIELD_NUMBER: _ClassVar[int]
    SIGNER_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ProofEntry]
    nonces: _containers.RepeatedCompositeFieldContainer[ProofNonce]
    digest: bytes
    own_commitment: bytes
    own_reveal: bytes
    own_paths: _containers.RepeatedScalarFieldContainer[bytes]
    signer_key: bytes
    signature: bytes
    def __init__(self, entries: _Optional[_Iterable[_Union[ProofEntry, _Mapping]]] = ..., nonces: _Optional[_Iterable[_Union[ProofNonce, _Mapping]]] = ..., digest: _Optional[bytes] = ..., own_commitment: _Optional[bytes] = ..., own_reveal: _Optional[bytes] = ..., own_paths: _Optional[_Iterable[bytes]] = ..., signer_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AcceptedProofsRequest(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    def __init__(self, round_id: _Optional[bytes] = ...) -> None: ...

class AcceptedProof(_message.Message):
    __slots__ = ("part", "attempt", "digest", "signer_key", "signature")
    PART_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNER_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    part: int
    attempt: int
    digest: bytes
    signer_key: bytes
    signature: bytes
    def __init__(self, part: _Optional[int] = ..., attempt: _Optional[int] = ..., digest: _Optional[bytes] = ..., signer_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AcceptedProofs(_message.Message):
    __slots__ = ("proofs",)
    PROOFS_FIELD_NUMBER: _ClassVar[int]
    proofs: _containers.RepeatedCompositeFieldContainer[AcceptedProof]
    def __init__(self, proofs: _Optional[_Iterable[_Union[AcceptedProof, _Mapping]]] = ...) -> None: ...

class PartServed(_message.Message):
    __slots__ = ("own_commitment",)
    OWN_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    own_commitment: bytes
    def __init__(self, own_commitment: _Optional[bytes] = ...) -> None: ...

class GatherInfo(_message.Message):
    __slots__ = ("group_id", "step", "state_hash", "sender_key", "signature")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    SENDER_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    step: int
    state_hash: bytes
    sender_key: bytes
    signature: bytes
    def __init__(self, group_id: _Optional[bytes] = ..., step: _Optional[int] = ..., state_hash: _Optional[bytes] = ..., sender_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class GatherAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetGatheredRequest(_message.Message):
    __slots__ = ("group_id", "step", "sender")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    step: int
    sender: bytes
    def __init__(self, group_id: _Optional[bytes] = ..., step: _Optional[int] = ..., sender: _Optional[bytes] = ...) -> None: ...
