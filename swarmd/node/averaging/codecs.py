"""How one part of an all-reduce travels: the codec by name, an optional zstd frame, and the
receiving side's decoding into recycled buffers.

Kept apart from the round logic so a codec change (or a new one) touches one small module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from swarmd.compression import (
    CodecId,
    CompressionError,
    DecodeLimits,
    HalfCodec,
    HalfConfig,
    Int8Codec,
    Int8Config,
    RawCodec,
    ZstdConfig,
    decode,
    decode_into,
    peek_header,
    zstd_compress,
)
from swarmd.compression.codec import Codec
from swarmd.protocol.framing import RECEIVE_BUFFERS

CodecName = Literal["fp32", "fp16", "int8"]
#: Wire bytes per value, for deadlines (int8 includes its per-block scales).
BYTES_PER_VALUE: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 1.02}
#: An encoded payload in pieces (codec header, then views of tensors' memory): sent and
#: served without joining the pieces into one buffer first.
Encoded = list[bytes | memoryview]


def part_limit(numel: int) -> int:
    """The most bytes a part of ``numel`` values may take on the wire: fp32 (the widest codec)
    plus room for a codec header. A PutPart declaring more is refused before its buffer is
    allocated, so a member cannot make a reducer hold more than its part could need."""
    return 4 * numel + 4096


def decode_contribution(data: bytearray, limits: DecodeLimits) -> tuple[torch.Tensor, bytearray]:
    """A received part's values and the buffer behind them (recycled after the reduction).

    INT8 parts are dequantised into a recycled float32 buffer, and the payload goes back to
    the pool at once; raw fp32 values are the payload itself, seen as floats."""
    header = peek_header(data, limits)
    if header.codec == CodecId.INT8 and len(header.shape) == 1 and header.numel > 0:
        backing = RECEIVE_BUFFERS.take(4 * header.numel)
        try:
            decode_into(data, limits, torch.frombuffer(backing, dtype=torch.float32))
        except CompressionError:
            RECEIVE_BUFFERS.give(backing)
            raise
        RECEIVE_BUFFERS.give(data)
        return torch.frombuffer(backing, dtype=torch.float32), backing
    return decode(data, limits), data


def make_codec(name: CodecName, int8_block_size: int = 256, int8_bits: int = 8) -> Codec:
    if name == "fp32":
        return RawCodec()
    if name == "fp16":
        return HalfCodec(HalfConfig("float16"))
    if name == "int8":
        return Int8Codec(Int8Config(int8_block_size, int8_bits))
    raise ValueError(f"unknown codec {name!r}")


def zstd_framed(segments: Encoded, level: int | None) -> Encoded:
    """The encoded part in one zstd frame (lossless; receivers detect it by its header), or
    as it was when ``level`` is None."""
    if level is None:
        return segments
    return [zstd_compress(b"".join(segments), ZstdConfig(level))]


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each tensor travels with: small and 1-D tensors (biases, norms, embeddings'
    positions) are cheap and sensitive, so they stay fp32; large matrices use ``large``."""

    large: CodecName = "int8"
    small: CodecName = "fp32"
    #: Tensors with fewer elements than this, or of one dimension, count as small.
    small_numel: int = 1 << 16

    def __post_init__(self) -> None:
        for name in (self.large, self.small):
            if name not in BYTES_PER_VALUE:
                raise ValueError(f"unknown codec {name!r}")
        if self.small_numel < 0:
            raise ValueError("small_numel must be >= 0")

    def codec_for(self, tensor: torch.Tensor) -> CodecName:
        return self.small if tensor.dim() <= 1 or tensor.numel() < self.small_numel else self.large
