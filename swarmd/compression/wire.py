"""Self-describing wire header shared by every codec.

A receiver must decode a payload with no out-of-band knowledge and must be able to refuse
it *before* allocating anything, so the header carries the codec, its version, the original
dtype and shape, and codec parameters; everything is checked against caller-given limits.

Layout (little-endian)::

    magic b"SWC" | format u8 | codec u8 | codec version u8 | dtype u8 | ndim u8
    | params length u16 | shape: ndim x u64 | params | payload
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from enum import IntEnum

import torch

from swarmd.compression.errors import CompressionError

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("swarmd.compression assumes a little-endian host")

MAGIC = b"SWC"
FORMAT_VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<3sBBBBBH")
_DIM = struct.Struct("<Q")


class CodecId(IntEnum):
    """Wire ids; never renumber, only append."""

    RAW = 1
    HALF = 2
    INT8 = 3
    LOWRANK = 4
    DCT_TOPK = 5
    ZSTD = 6
    TOPK = 7


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


@dataclass(frozen=True)
class DecodeLimits:
    """What a receiver is willing to allocate for one payload.

    Limits come from the caller (who knows the model and the peer's role), never from the
    bytes themselves, so a hostile header cannot make us allocate more than this.
    """

    max_elements: int
    max_bytes: int

    def __post_init__(self) -> None:
        for name in ("max_elements", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DecodeLimits.{name} must be an int >= 0, got {value!r}")

    @classmethod
    def for_tensor(cls, tensor: torch.Tensor, slack_bytes: int = 1 << 16) -> DecodeLimits:
        """Limits that admit exactly a re-encoding of `tensor` (used for local round trips)."""
        numel = tensor.numel()
        return cls(max_elements=numel, max_bytes=numel * 8 + slack_bytes)


@dataclass(frozen=True)
class Header:
    """Parsed header; `payload_offset` is where the codec's own bytes begin."""

    codec: CodecId
    version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    payload_offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise CompressionError(f"dtype {dtype} cannot be described on the wire") from None


def pack_header(
    codec: CodecId, version: int, dtype: torch.dtype, shape: tuple[int, ...], params: bytes
) -> bytes:
    if len(shape) > MAX_NDIM:
        raise CompressionError(f"tensor has {len(shape)} dims; the wire allows {MAX_NDIM}")
    if len(params) > 0xFFFF:
        raise CompressionError("codec parameters longer than 65535 bytes")
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, int(codec), version, dtype_code(dtype), len(shape), len(params)
    )
    return fixed + b"".join(_DIM.pack(int(d)) for d in shape) + params


def parse_header(data: bytes | bytearray | memoryview, limits: DecodeLimits) -> Header:
    """Parse and check a header; the declared element count is held to `limits` here."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CompressionError(f"truncated header: {len(view)} bytes, need {_FIXED.size}")
    magic, fmt, codec_raw, version, dcode, ndim, plen = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CompressionError(f"bad magic {bytes(magic)!r}: not a swarmd codec payload")
    if fmt != FORMAT_VERSION:
        raise CompressionError(f"unsupported header format version {fmt}")
    try:
        codec = CodecId(codec_raw)
    except ValueError:
        raise CompressionError(f"unknown codec id {codec_raw}") from None
    if dcode not in _CODE_DTYPES:
        raise CompressionError(f"unknown dtype code {dcode}")
    if ndim > MAX_NDIM:
        raise CompressionError(f"header declares {ndim} dims; at most {MAX_NDIM} allowed")
    end = _FIXED.size + ndim * _DIM.size + plen
    if len(view) < end:
        raise CompressionError(f"truncated header: {len(view)} bytes, need {end}")
    shape = tuple(_DIM.unpack_from(view, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    numel = math.prod(shape)
    # A ZSTD frame's "shape" counts the bytes it inflates to; everything else counts elements.
    limit, unit = (
        (limits.max_bytes, "bytes") if codec == CodecId.ZSTD else (limits.max_elements, "elements")
    )
    if numel > limit:
        raise CompressionError(f"header declares {numel} {unit}, over the limit of {limit}")
    params = bytes(view[end - plen : end])
    return Header(codec, version, _CODE_DTYPES[dcode], shape, params, end)


def expect(header: Header, codec: CodecId, version: int, params_len: int) -> None:
    """Refuse a header meant for another codec, version or parameter layout."""
    if header.codec != codec:
        raise CompressionError(f"payload is {header.codec.name}, expected {codec.name}")
    if header.version != version:
        raise CompressionError(
            f"{codec.name} version {header.version} unsupported (this build speaks {version})"
        )
    if len(header.params) != params_len:
        raise CompressionError(
            f"{codec.name} parameters are {len(header.params)} bytes, expected {params_len}"
        )


def expect_float(header: Header) -> None:
    if header.dtype not in FLOAT_DTYPES:
        raise CompressionError(f"{header.codec.name} payload declares non-float {header.dtype}")


def payload(data: bytes | bytearray | memoryview, header: Header, size: int) -> memoryview:
    """The codec's bytes, whose length must be exactly what the header implies."""
    body = memoryview(data)[header.payload_offset :]
    if len(body) != size:
        raise CompressionError(
            f"{header.codec.name} payload is {len(body)} bytes; header implies {size}"
        )
    return body
