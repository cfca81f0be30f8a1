"""zstd framing over any codec's bytes, safe against decompression bombs.

The decompressed size is declared twice (our header's shape and the zstd frame's content
size); both must agree and fit the caller's `max_bytes` before a byte is inflated. When
zstd would not shrink the input (random mantissas rarely compress), the bytes are stored
as-is, so framing never costs more than the header (`FRAME_OVERHEAD` bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import zstandard

from swarmd.compression.codec import Codec
from swarmd.compression.errors import CompressionError
from swarmd.compression.wire import CodecId, DecodeLimits, Header, expect, pack_header, parse_header

VERSION = 1
_PARAMS = struct.Struct("<B")
_STORED, _ZSTD = 0, 1
FRAME_OVERHEAD = len(pack_header(CodecId.ZSTD, VERSION, torch.uint8, (0,), _PARAMS.pack(0)))


@dataclass(frozen=True)
class ZstdConfig:
    level: int = 3

    def __post_init__(self) -> None:
        lo, hi = -7, zstandard.MAX_COMPRESSION_LEVEL
        lvl = self.level
        if isinstance(lvl, bool) or not isinstance(lvl, int) or not lo <= lvl <= hi:
            raise ValueError(f"ZstdConfig.level must be an int in [{lo}, {hi}], got {lvl!r}")


def zstd_compress(data: bytes | bytearray | memoryview, config: ZstdConfig | None = None) -> bytes:
    config = config or ZstdConfig()
    raw = bytes(data)
    packed = zstandard.ZstdCompressor(level=config.level, write_content_size=True).compress(raw)
    mode, body = (_ZSTD, packed) if len(packed) < len(raw) else (_STORED, raw)
    header = pack_header(CodecId.ZSTD, VERSION, torch.uint8, (len(raw),), _PARAMS.pack(mode))
    return header + body


def zstd_decompress(data: bytes | bytearray | memoryview, max_bytes: int) -> bytes:
    """Inner bytes of a frame; the declared size is checked against `max_bytes` first."""
    limits = DecodeLimits(max_elements=0, max_bytes=max_bytes)
    return _decompress(parse_header(data, limits), data, max_bytes)


def _decompress(header: Header, data: bytes | bytearray | memoryview, max_bytes: int) -> bytes:
    expect(header, CodecId.ZSTD, VERSION, _PARAMS.size)
    if header.dtype != torch.uint8 or len(header.shape) != 1:
        raise CompressionError("ZSTD frame must declare a 1-D uint8 shape")
    size = header.shape[0]
    if size > max_bytes:
        raise CompressionError(f"ZSTD frame declares {size} bytes, over the limit of {max_bytes}")
    (mode,) = _PARAMS.unpack(header.params)
    body = memoryview(data)[header.payload_offset :]
    if mode == _STORED:
        if len(body) != size:
            raise CompressionError(f"stored ZSTD frame has {len(body)} bytes, declares {size}")
        return bytes(body)
    if mode != _ZSTD:
        raise CompressionError(f"ZSTD frame has unknown mode {mode}")
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise CompressionError(f"ZSTD frame header unreadable: {exc}") from None
    if declared != size:
        raise CompressionError(f"zstd content size {declared} != declared size {size}")
    try:
        out = zstandard.ZstdDecompressor().decompress(
            body, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise CompressionError(f"corrupt zstd data: {exc}") from None
    if len(out) != size:
        raise CompressionError(f"zstd produced {len(out)} bytes, frame declares {size}")
    return out


class ZstdFramed:
    """Any codec with zstd over its bytes; decodes through the inner codec."""

    codec_id = CodecId.ZSTD

    def __init__(self, inner: Codec, config: ZstdConfig | None = None) -> None:
        self.inner = inner
        self.config = config or ZstdConfig()

    def encode(self, tensor: torch.Tensor) -> bytes:
        return zstd_compress(self.inner.encode(tensor), self.config)

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return self.inner.decode(zstd_decompress(data, limits.max_bytes), limits)
