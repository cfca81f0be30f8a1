"""Tensor framing: a validated header, then raw bytes.

Everything here is torch-free on purpose: a DHT-only bootstrap node imports the protocol
package and must stay small. ``swarmd.protocol.tensors`` converts to and from torch.

Decoding trusts nothing: the header is checked field by field and the declared size is compared
with the caller's limit *before* any buffer for the payload exists, so a lying peer can make us
refuse, never make us allocate.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.errors import FramingError

#: Bytes per element of every dtype we put on the wire, by its torch name.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

MAX_NDIM = 16
MAX_NAME_LEN = 256
MAX_INFO_BYTES = 512
#: Largest serialised TensorHeader accepted (a 16-dim shape plus a name fits in far less).
MAX_HEADER_BYTES = 1024
#: Default bytes of payload per data frame: large enough to amortise per-message cost, small
#: enough to stay far below gRPC's message limit and to bound memory per in-flight frame.
DEFAULT_CHUNK_BYTES = 1 << 20

TAG_HEADER = 0x01
TAG_DATA = 0x02
_BLOB_PREFIX = struct.Struct("<I")


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to know before it accepts a tensor's bytes."""

    dtype: str
    shape: tuple[int, ...]
    name: str = ""
    #: Opaque application context (a serialised message of the layer above), signed with it.
    info: bytes = b""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise FramingError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )
        if len(self.shape) > MAX_NDIM:
            raise FramingError(f"tensor has {len(self.shape)} dims; at most {MAX_NDIM} allowed")
        for dim in self.shape:
            if dim < 0:
                raise FramingError(f"negative dimension {dim} in shape {self.shape}")
        if len(self.name.encode()) > MAX_NAME_LEN:
            raise FramingError(f"tensor name longer than {MAX_NAME_LEN} bytes")
        if len(self.info) > MAX_INFO_BYTES:
            raise FramingError(f"tensor info longer than {MAX_INFO_BYTES} bytes")

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def to_proto(self) -> pb.TensorHeader:
        return pb.TensorHeader(
            dtype=self.dtype,
            shape=list(self.shape),
            nbytes=self.nbytes,
            name=self.name,
            info=self.info,
        )


def check_header(header: pb.TensorHeader, max_bytes: int) -> TensorMeta:
    """Validates a received header against itself and the receiver's limit."""
    meta = TensorMeta(
        dtype=header.dtype, shape=tuple(header.shape), name=header.name, info=header.info
    )
    # numel can be astronomically large for a hostile shape; Python ints do not overflow, and we
    # compare before anything is allocated.
    if meta.nbytes != header.nbytes:
        raise FramingError(
            f"header says {header.nbytes} bytes but dtype {meta.dtype} and shape {meta.shape} "
            f"need {meta.nbytes}"
        )
    if meta.nbytes > max_bytes:
        raise FramingError(f"declared tensor size {meta.nbytes} B exceeds the limit {max_bytes} B")
    return meta


def _parse_header(raw: bytes | memoryview) -> pb.TensorHeader:
    if len(raw) > MAX_HEADER_BYTES:
        raise FramingError(f"tensor header of {len(raw)} B exceeds {MAX_HEADER_BYTES} B")
    header = pb.TensorHeader()
    try:
        header.ParseFromString(bytes(raw))
    except DecodeError as exc:
        raise FramingError(f"tensor header is not a valid TensorHeader: {exc}") from None
    return header


def header_frame(meta: TensorMeta) -> bytes:
    """The first frame of a tensor stream."""
    return bytes([TAG_HEADER]) + meta.to_proto().SerializeToString()


def parse_header_frame(frame: bytes | bytearray | memoryview, max_bytes: int) -> TensorMeta:
    """The meta of a stream's first frame (see header_frame), checked against ``max_bytes``."""
    view = memoryview(frame)
    if len(view) == 0 or view[0] != TAG_HEADER:
        raise FramingError("a tensor stream must start with its header frame")
    return check_header(_parse_header(view[1:]), max_bytes)


#: A payload in one piece, or in several (a codec header, then views of tensors' memory):
#: sending the pieces saves the copy that joining them into one buffer would cost.
Payload = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def payload_segments(payload: Payload) -> list[memoryview]:
    """The payload as flat byte views, empty ones left out."""
    pieces = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    views = []
    for piece in pieces:
        view = memoryview(piece)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes:
            views.append(view)
    return views


def payload_nbytes(payload: Payload) -> int:
    return sum(v.nbytes for v in payload_segments(payload))


def iter_frames(
    meta: TensorMeta, payload: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Yields the header frame, then data frames; each data frame costs exactly one copy,
    whether the payload is one buffer or several (a frame may span two pieces)."""
    segments = payload_segments(payload)
    total = sum(v.nbytes for v in segments)
    if total != meta.nbytes:
        raise FramingError(f"payload has {total} B, header declares {meta.nbytes} B")
    yield header_frame(meta)
    tag = bytes([TAG_DATA])
    pending: list[bytes | memoryview] = [tag]
    room = chunk_bytes
    for view in segments:
        pos = 0
        while pos < view.nbytes:
            take = min(room, view.nbytes - pos)
            pending.append(view[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                yield b"".join(pending)
                pending, room = [tag], chunk_bytes
    if len(pending) > 1:
        yield b"".join(pending)


class BufferPool:
    """Large receive buffers, recycled by the consumers that know they are done with them.

    A fresh buffer of hundreds of megabytes costs more than the bytes copied into it: every
    4 KiB page faults, and bytearray() zero-fills it first (measured: 60-70 ms of CPU per
    100 MB, twice that in wall time, against 15 ms to overwrite a warm buffer). An all-reduce
    receives buffers of the same sizes every round, so handing them back makes them warm.

    Only exact sizes are reused, and at most `max_idle_bytes` wait idle. Giving back a buffer
    that anything still reads (a tensor made with torch.frombuffer, a memoryview) would let the
    next stream overwrite it: `give` refuses buffers with live memoryviews, but tensors are the
    caller's to account for.
    """

    def __init__(self, max_idle_bytes: int = 1 << 30, min_bytes: int = 1 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of exactly `nbytes` (stale contents if recycled: callers overwrite it)."""
        if nbytes >= self.min_bytes:
            with self._lock:
                free = self._idle.get(nbytes)
                if free:
                    self._idle_bytes -= nbytes
                    return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        """Hands back a buffer nothing refers to any more."""
        n = len(buf)
        if n < self.min_bytes:
            return
        try:  # a bytearray with a live memoryview cannot grow: someone still reads it
            buf.append(0)
        except BufferError:
            return
        del buf[n:]
        with self._lock:
            if self._idle_bytes + n > self.max_idle_bytes:
                return
            bucket = self._idle.setdefault(n, [])
            if any(b is buf for b in bucket):
                return
            bucket.append(buf)
            self._idle_bytes += n

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


#: Where stream assemblers take their buffers from; see BufferPool.
RECEIVE_BUFFERS = BufferPool()


class StreamAssembler:
    """Rebuilds one tensor from frames, refusing anything the header did not promise."""

    def __init__(self, max_bytes: int, pool: BufferPool = RECEIVE_BUFFERS) -> None:
        self._pool = pool
        self._max_bytes = max_bytes
        self.meta: TensorMeta | None = None
        self._buf: bytearray | None = None
        self._filled = 0

    def feed(self, frame: bytes | memoryview) -> None:
        if len(frame) == 0:
            raise FramingError("empty frame")
        view = memoryview(frame)
        tag = view[0]
        if tag == TAG_HEADER:
            if self.meta is not None:
                raise FramingError("second header frame in one tensor stream")
            self.meta = check_header(_parse_header(view[1:]), self._max_bytes)
            self._buf = self._pool.take(self.meta.nbytes)
        elif tag == TAG_DATA:
            if self._buf is None:
                raise FramingError("data frame before the header frame")
            n = len(view) - 1
            if self._filled + n > len(self._buf):
                raise FramingError(f"stream carries more than the declared {len(self._buf)} B")
            self._buf[self._filled : self._filled + n] = view[1:]
            self._filled += n
        else:
            raise FramingError(f"unknown frame tag 0x{tag:02x}")

    def finish(self) -> tuple[TensorMeta, bytearray]:
        if self.meta is None or self._buf is None:
            raise FramingError("tensor stream ended before its header")
        if self._filled != len(self._buf):
            raise FramingError(f"truncated tensor stream: got {self._filled} of {len(self._buf)} B")
        return self.meta, self._buf


def assemble(frames: Iterable[bytes | memoryview], max_bytes: int) -> tuple[TensorMeta, bytearray]:
    """Reads a whole tensor stream; raises FramingError on any inconsistency."""
    asm = StreamAssembler(max_bytes)
    for frame in frames:
        asm.feed(frame)
    return asm.finish()


def pack(meta: TensorMeta, payload: bytes | bytearray | memoryview) -> bytes:
    """One tensor as a single blob (length-prefixed header, then payload), for small tensors."""
    view = memoryview(payload).cast("B")
    if view.nbytes != meta.nbytes:
        raise FramingError(f"payload has {view.nbytes} B, header declares {meta.nbytes} B")
    header = meta.to_proto().SerializeToString()
    return _BLOB_PREFIX.pack(len(header)) + header + view.tobytes()


def unpack(blob: bytes | bytearray | memoryview, max_bytes: int) -> tuple[TensorMeta, memoryview]:
    """Inverse of pack; the payload is a view into blob (no copy)."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _BLOB_PREFIX.size:
        raise FramingError(f"tensor blob of {view.nbytes} B is shorter than its length prefix")
    (hlen,) = _BLOB_PREFIX.unpack_from(view)
    if hlen > MAX_HEADER_BYTES or _BLOB_PREFIX.size + hlen > view.nbytes:
        raise FramingError(f"tensor blob declares a {hlen} B header that does not fit")
    meta = check_header(
        _parse_header(view[_BLOB_PREFIX.size : _BLOB_PREFIX.size + hlen]), max_bytes
    )
    payload = view[_BLOB_PREFIX.size + hlen :]
    if payload.nbytes != meta.nbytes:
        raise FramingError(
            f"tensor blob carries {payload.nbytes} B of payload, header declares {meta.nbytes} B"
        )
    return meta, payload
