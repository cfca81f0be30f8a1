"""A frozen copy of the global state, laid out for transfer: one buffer, hashed chunks, a manifest.

State sync moves parameters and outer-optimizer buffers from donors to a joiner. Laying every
tensor into one contiguous buffer cut into fixed-size chunks lets a joiner fetch chunks from
several donors at once and check each chunk alone the moment it arrives (against the manifest's
per-chunk hashes), instead of trusting a donor until the very end. The state hash is a hash over
a canonical encoding of the manifest, so it names the whole state: two donors advertising the
same hash serve interchangeable chunks.

The snapshot copies the tensors it is built from: the trainer keeps mutating its parameters
while donors serve, and a donor must keep serving the bytes its manifest promised.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import torch
from google.protobuf.message import DecodeError

from swarmd.protocol import statesync_pb2 as pb
from swarmd.protocol.errors import FramingError, ProtocolError
from swarmd.protocol.framing import TensorMeta
from swarmd.protocol.tensors import tensor_from_bytes, tensor_meta

FORMAT_VERSION = 1
HASH_BYTES = 32
#: Tensor offsets are aligned so that every dtype can be viewed in place from the buffer.
ALIGN = 64
#: Large enough to amortise a call's fixed cost (a few ms on the internet), small enough that a
#: lost chunk costs little to refetch and several chunks stream from different donors at once.
DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_STATE_BYTES = 1 << 40
MAX_TENSORS = 1 << 20
MAX_META_ITEMS = 256
MAX_META_CHARS = 4096
#: Largest serialised manifest accepted (about 1 TiB of state in 4 MiB chunks plus a big model).
MAX_MANIFEST_BYTES = 64 << 20
_HASH_PERSON = b"swarmd-state-v1"


class ManifestError(ProtocolError):
    """A manifest (usually received from a donor) is malformed or inconsistent; it is refused."""


#: A state's form without its values: (name, dtype, shape) of every tensor, sorted by name.
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


def layout_of(state: Mapping[str, torch.Tensor]) -> Layout:
    """The layout a state of these tensors has: what a joiner expects a donor's manifest to say."""
    return tuple(
        sorted((name, (m := tensor_meta(t, name)).dtype, m.shape) for name, t in state.items())
    )


def layout_mismatch(expected: Layout, got: Layout) -> str | None:
    """Why a manifest's layout is not the expected one (its first difference), or None."""
    if got == expected:
        return None
    want, have = dict((n, (d, s)) for n, d, s in expected), dict((n, (d, s)) for n, d, s in got)
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            return f"it lacks tensor {name!r}"
        if name not in want:
            return f"it has a tensor {name!r} this model does not"
        if want[name] != have[name]:
            return f"tensor {name!r} is {have[name]}, this model's is {want[name]}"
    return "its tensors differ"  # unreachable: equal maps give equal sorted layouts


def chunk_hash(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE2b-256 of one chunk (hashlib releases the GIL, so threads hash chunks in parallel)."""
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _lp(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class TensorEntry:
    """Where one named tensor lives in the state buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(dtype=self.dtype, shape=self.shape, name=self.name)


@dataclass(frozen=True)
class Manifest:
    """Everything a joiner needs to fetch, check and decode a state; validated on construction.

    Validation is strict (exact layout, exact chunk count) because manifests come from untrusted
    donors and drive how much memory a joiner allocates.
    """

    round: int
    total_bytes: int
    chunk_bytes: int
    chunk_hashes: tuple[bytes, ...]
    tensors: tuple[TensorEntry, ...]
    #: Sorted (key, value) pairs, so that equal metadata always hashes equally.
    meta: tuple[tuple[str, str], ...] = ()
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {self.format_version} is not supported "
                f"(this node speaks {FORMAT_VERSION})"
            )
        if not 0 <= self.round < 1 << 63:
            raise ManifestError(f"manifest round {self.round} is out of range")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ManifestError(
                f"chunk size {self.chunk_bytes} B is outside "
                f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] B"
            )
        if not 0 <= self.total_bytes <= MAX_STATE_BYTES:
            raise ManifestError(f"state size {self.total_bytes} B exceeds {MAX_STATE_BYTES} B")
        want_chunks = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_hashes) != want_chunks:
            raise ManifestError(
                f"manifest lists {len(self.chunk_hashes)} chunk hashes; {self.total_bytes} B in "
                f"chunks of {self.chunk_bytes} B need {want_chunks}"
            )
        for i, digest in enumerate(self.chunk_hashes):
            if len(digest) != HASH_BYTES:
                raise ManifestError(f"chunk {i} hash has {len(digest)} B, expected {HASH_BYTES}")
        if len(self.tensors) > MAX_TENSORS:
            raise ManifestError(f"manifest lists {len(self.tensors)} tensors (max {MAX_TENSORS})")
        self._check_layout()
        self._check_meta()

    def _check_layout(self) -> None:
        names: set[str] = set()
        end = 0
        for entry in self.tensors:
            if not entry.name or entry.name in names:
                raise ManifestError(f"tensor name {entry.name!r} is empty or repeated")
            names.add(entry.name)
            try:
                meta = entry.meta
            except FramingError as exc:
                raise ManifestError(f"tensor {entry.name!r}: {exc}") from None
            if meta.nbytes != entry.nbytes:
                raise ManifestError(
                    f"tensor {entry.name!r} declares {entry.nbytes} B but {entry.dtype} "
                    f"{entry.shape} needs {meta.nbytes} B"
                )
            if entry.offset != _align(end):
                raise ManifestError(
                    f"tensor {entry.name!r} at offset {entry.offset}; the layout puts it at "
                    f"{_align(end)}"
                )
            end = entry.offset + entry.nbytes
            if end > self.total_bytes:
                raise ManifestError(
                    f"tensor {entry.name!r} ends at {end} B, past the state's {self.total_bytes} B"
                )
        if end != self.total_bytes:
            raise ManifestError(
                f"tensors end at {end} B but the state declares {self.total_bytes} B"
            )

    def _check_meta(self) -> None:
        if len(self.meta) > MAX_META_ITEMS:
            raise ManifestError(f"manifest has {len(self.meta)} meta items (max {MAX_META_ITEMS})")
        keys = [k for k, _ in self.meta]
        if keys != sorted(set(keys)):
            raise ManifestError("manifest meta keys must be unique and sorted")
        for key, value in self.meta:
            if len(key) + len(value) > MAX_META_CHARS:
                raise ManifestError(f"manifest meta item {key[:40]!r} is too long")

    # -- derived ------------------------------------------------------------------------------

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_hashes)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk ``index`` in the state buffer."""
        if not 0 <= index < self.n_chunks:
            raise IndexError(f"chunk {index} out of range (state has {self.n_chunks} chunks)")
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    @property
    def layout(self) -> Layout:
        return tuple(sorted((e.name, e.dtype, e.shape) for e in self.tensors))

    @cached_property
    def state_hash(self) -> bytes:
        """BLAKE2b-256 over a canonical encoding: protobuf bytes are not canonical (map order)."""
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=_HASH_PERSON)
        h.update(
            struct.pack(
                "<IqQQI",
                self.format_version,
                self.round,
                self.total_bytes,
                self.chunk_bytes,
                self.n_chunks,
            )
        )
        h.update(b"".join(self.chunk_hashes))
        h.update(struct.pack("<I", len(self.tensors)))
        for entry in self.tensors:
            h.update(_lp(entry.name) + _lp(entry.dtype))
            h.update(struct.pack(f"<I{len(entry.shape)}q", len(entry.shape), *entry.shape))
            h.update(struct.pack("<QQ", entry.offset, entry.nbytes))
        h.update(struct.pack("<I", len(self.meta)))
        for key, value in self.meta:
            h.update(_lp(key) + _lp(value))
        return h.digest()

    # -- wire ---------------------------------------------------------------------------------

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            format_version=self.format_version,
            round=self.round,
            total_bytes=self.total_bytes,
            chunk_bytes=self.chunk_bytes,
            chunk_hashes=list(self.chunk_hashes),
            tensors=[
                pb.TensorEntry(
                    name=e.name,
                    dtype=e.dtype,
                    shape=list(e.shape),
                    offset=e.offset,
                    nbytes=e.nbytes,
                )
                for e in self.tensors
            ],
            meta=[pb.MetaItem(key=k, value=v) for k, v in self.meta],
        )

    @classmethod
    def from_proto(cls, msg: pb.Manifest) -> Manifest:
        """Validates a received manifest; raises ManifestError, never anything else."""
        try:
            return cls(
                round=msg.round,
                total_bytes=msg.total_bytes,
                chunk_bytes=msg.chunk_bytes,
                chunk_hashes=tuple(msg.chunk_hashes),
                tensors=tuple(
                    TensorEntry(e.name, e.dtype, tuple(e.shape), e.offset, e.nbytes)
                    for e in msg.tensors
                ),
                meta=tuple((item.key, item.value) for item in msg.meta),
                format_version=msg.format_version,
            )
        except (ValueError, OverflowError, struct.error) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"malformed manifest: {exc}") from None

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(raw)} B exceeds {MAX_MANIFEST_BYTES} B")
        msg = pb.Manifest()
        try:
            msg.ParseFromString(raw)
        except DecodeError as exc:
            raise ManifestError(f"manifest is not a valid Manifest message: {exc}") from None
        return cls.from_proto(msg)


def _hash_chunks(buf: memoryview, chunk_bytes: int, threads: int | None) -> list[bytes]:
    spans = [(s, min(s + chunk_bytes, buf.nbytes)) for s in range(0, buf.nbytes, chunk_bytes)]
    workers = max(1, min(threads or os.cpu_count() or 1, len(spans)))
    if workers == 1:
        return [chunk_hash(buf[s:e]) for s, e in spans]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swarmd-hash") as pool:
        return list(pool.map(lambda span: chunk_hash(buf[span[0] : span[1]]), spans))


class StateSnapshot:
    """An immutable, ordered set of named tensors with a round and metadata, ready to serve.

    Build one with ``StateSnapshot.build`` (copies the tensors: cheap next to a training step,
    one memcpy plus hashing at about 1 GB/s) and rebuild a received one with ``from_buffer``.
    ``tensors`` are views into the snapshot's own buffer: clone before modifying them in place
    (``to_state_dict`` does), or the bytes served stop matching the manifest.
    """

    __slots__ = ("_buf", "_manifest", "_tensors")

    def __init__(
        self, manifest: Manifest, buf: bytearray, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Internal: use ``build`` or ``from_buffer``."""
        self._manifest = manifest
        self._buf = buf
        self._tensors = tensors

    @classmethod
    def build(
        cls,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        round: int,
        meta: Mapping[str, str] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        hash_threads: int | None = None,
    ) -> StateSnapshot:
        """Copies ``tensors`` (any device) into a new snapshot; blocking: call it in a thread."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        entries: list[TensorEntry] = []
        end = 0
        for name, tensor in items:
            try:
                tmeta = tensor_meta(tensor, name)
            except FramingError as exc:
                raise ValueError(f"tensor {name!r} cannot be part of a state: {exc}") from None
            offset = _align(end)
            entries.append(TensorEntry(name, tmeta.dtype, tmeta.shape, offset, tmeta.nbytes))
            end = offset + tmeta.nbytes
        # bytearray zero-fills, so the alignment padding is deterministic (it is hashed).
        buf = bytearray(end)
        base = (
            torch.frombuffer(buf, dtype=torch.uint8) if end else torch.empty(0, dtype=torch.uint8)
        )
        for (_, tensor), entry in zip(items, entries, strict=True):
            if entry.nbytes:
                dst = base[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype)
                # copy_ handles other devices and non-contiguous sources without a staging copy.
                dst.view(tensor.shape).copy_(tensor.detach())
        view = memoryview(buf)
        manifest = Manifest(
            round=round,
            total_bytes=end,
            chunk_bytes=chunk_bytes,
            chunk_hashes=tuple(_hash_chunks(view, chunk_bytes, hash_threads)),
            tensors=tuple(entries),
            meta=tuple(sorted((meta or {}).items())),
        )
        return cls(manifest, buf, _views(manifest, buf))

    @classmethod
    def from_buffer(
        cls,
        manifest: Manifest,
        buf: bytearray,
        *,
        verify: bool = True,
        hash_threads: int | None = None,
    ) -> StateSnapshot:
        """Wraps a received state buffer (taking ownership, no copy), checking every chunk.

        ``verify=False`` is for callers that already checked each chunk as it arrived.
        """
        if len(buf) != manifest.total_bytes:
            raise ManifestError(
                f"state buffer has {len(buf)} B; the manifest declares {manifest.total_bytes} B"
            )
        if verify:
            got = _hash_chunks(memoryview(buf), manifest.chunk_bytes, hash_threads)
            bad = [
                i for i, (a, b) in enumerate(zip(got, manifest.chunk_hashes, strict=True)) if a != b
            ]
            if bad:
                raise ManifestError(f"chunks {bad[:10]} do not match the manifest's hashes")
        return cls(manifest, buf, _views(manifest, buf))

    # -- accessors ----------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def round(self) -> int:
        return self._manifest.round

    @property
    def meta(self) -> Mapping[str, str]:
        return MappingProxyType(dict(self._manifest.meta))

    @property
    def state_hash(self) -> bytes:
        return self._manifest.state_hash

    @property
    def total_bytes(self) -> int:
        return self._manifest.total_bytes

    @property
    def n_chunks(self) -> int:
        return self._manifest.n_chunks

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Views into the snapshot's buffer, in order; do not modify them in place."""
        return MappingProxyType(self._tensors)

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Independent copies, safe to train on."""
        return {name: t.clone() for name, t in self._tensors.items()}

    def chunk(self, index: int) -> memoryview:
        """A read-only view of chunk ``index``'s bytes (no copy)."""
        start, end = self._manifest.chunk_span(index)
        return memoryview(self._buf)[start:end].toreadonly()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return (
            f"StateSnapshot(round={self.round}, tensors={len(self)}, bytes={self.total_bytes}, "
            f"hash={self.state_hash.hex()[:16]})"
        )


def _views(manifest: Manifest, buf: bytearray) -> dict[str, torch.Tensor]:
    view = memoryview(buf)
    return {
        e.name: tensor_from_bytes(e.meta, view[e.offset : e.offset + e.nbytes])
        for e in manifest.tensors
    }
