"""How one part of an all-reduce travels: the codec by name, an optional zstd frame, and the
receiving side's decoding into recycled buffers.

Kept apart from the round logic so a codec change (or a new one) touches one small module.
"""

from __future__ import annotations

import math
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
    TopKCodec,
    TopKConfig,
    ZstdConfig,
    decode,
    decode_into,
    unframe,
    zstd_compress,
)
from swarmd.compression.codec import Codec
from swarmd.node.averaging.reduction import l2_norm
from swarmd.protocol.framing import RECEIVE_BUFFERS

CodecName = Literal["fp32", "fp16", "int8", "topk"]
#: Wire bytes per value, for deadlines (int8 includes its per-block scales). topk's is its
#: worst case, a reduced part whose every entry is nonzero (a bitmap bit, a byte, and a
#: chunk's scale and count, see `result_codec`): a deadline too long only delays giving up
#: on a dead peer.
BYTES_PER_VALUE: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 1.02, "topk": 1.25}
#: Bits of a reduced top-k part's values (`result_codec`).
TOPK_RESULT_BITS = 8
#: An encoded payload in pieces (codec header, then views of tensors' memory): sent and
#: served without joining the pieces into one buffer first.
Encoded = list[bytes | memoryview]


def part_limit(numel: int) -> int:
    """The most bytes a part of ``numel`` values may take on the wire: fp32 (the widest codec)
    plus room for a codec header. A PutPart declaring more is refused before its buffer is
    allocated, so a member cannot make a reducer hold more than its part could need."""
    return 4 * numel + 4096


def decode_contribution(
    data: bytearray, limits: DecodeLimits
) -> tuple[torch.Tensor, bytearray, float]:
    """A received part's values, the buffer behind them (recycled after the reduction), and
    their L2 norm, which the reducer's outlier check needs (`norm_outliers`).

    INT8 parts are dequantised into a recycled float32 buffer, and the payload goes back to
    the pool at once; raw fp32 values are the payload itself, seen as floats. Non-finite
    values raise CompressionError: for raw values, found by the norm's pass (the decoder's
    own check would be a second pass over the part)."""
    header, inner = unframe(data, limits)  # int8 codes in a zstd frame too
    if header.codec == CodecId.INT8 and len(header.shape) == 1 and header.numel > 0:
        backing = RECEIVE_BUFFERS.take(4 * header.numel)
        try:
            decode_into(inner, limits, torch.frombuffer(backing, dtype=torch.float32))
        except CompressionError:
            RECEIVE_BUFFERS.give(backing)
            raise
        RECEIVE_BUFFERS.give(data)
        values, data = torch.frombuffer(backing, dtype=torch.float32), backing
    else:
        values = decode(inner, limits, finite=False)
    norm = l2_norm(values)
    if not math.isfinite(norm):
        raise CompressionError("the contribution contains NaN or infinity")
    return values, data, norm


def make_codec(
    name: CodecName,
    int8_block_size: int = 256,
    int8_bits: int = 8,
    topk: TopKConfig | None = None,
) -> Codec:
    """The codec a member's contribution travels with."""
    if name == "topk":
        return TopKCodec(topk)
    if name == "fp32":
        return RawCodec()
    if name == "fp16":
        return HalfCodec(HalfConfig("float16"))
    if name == "int8":
        return Int8Codec(Int8Config(int8_block_size, int8_bits))
    raise ValueError(f"unknown codec {name!r}")


def result_codec(name: CodecName, contribution: Codec) -> Codec:
    """The codec a reducer serves its part with: the contributions' own, except for top-k.

    The mean of sparse contributions is sparse too, nonzero on the union of what the members
    sent (at most members x k entries a chunk), so it goes back sparse: every nonzero, at
    `TOPK_RESULT_BITS` bits with a scale per chunk (1 byte a value, and a 2-byte index each
    or a bitmap of the part, whichever is smaller: at the defaults and 4 members, the mean
    is up to 1/8 dense, and a bitmap costs 1/8 byte a value). Served dense through int8 it
    would cost 1.02 bytes for *every* value, 14x what each member sent; top-k
    again at the reducer would drop mass that nobody's error feedback holds (the reducer's
    residual would be lost whenever a fallback reducer takes over). 8 bits, not the
    contributions' 2: the result has no error feedback, so its rounding must be small (one
    255th of the chunk's largest value, int8's step)."""
    if name == "topk" and isinstance(contribution, TopKCodec):
        chunk = contribution.config.chunk
        return TopKCodec(TopKConfig(chunk=chunk, density=1.0, bits=TOPK_RESULT_BITS))
    return contribution


def zstd_framed(segments: Encoded, level: int | None) -> Encoded:
    """The encoded part in one zstd frame (lossless; receivers detect it by its header), or
    as it was when ``level`` is None. Parts are quantised codes: compressed as such
    (`ZstdConfig.literals`; the level is not used)."""
    if level is None:
        return segments
    return [zstd_compress(b"".join(segments), ZstdConfig(level, literals=True))]


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
