"""Codecs for what crosses the network: pure functions on tensors and bytes, no I/O.

Every payload starts with a self-describing header (`wire`), so `decode(data, limits)`
needs nothing but the bytes and the caller's size limits. Every malformed input raises
`CompressionError`.
"""

from swarmd.compression.codec import Codec, SegmentedCodec, encode_segments
from swarmd.compression.dct_topk import (
    DctComponents,
    DctTopKCodec,
    DctTopKConfig,
    average_components,
    components_to_bytes,
    decode_components,
    to_dense,
)
from swarmd.compression.error_feedback import ErrorFeedback, ResidualStore
from swarmd.compression.errors import CompressionError
from swarmd.compression.halfcast import HalfCodec, HalfConfig
from swarmd.compression.int8 import Int8Codec, Int8Config, dequantize_int8, quantize_int8
from swarmd.compression.lowrank import LowRankCodec, PowerSGD, PowerSGDConfig, PowerSGDRound
from swarmd.compression.raw import RawCodec, raw_segments
from swarmd.compression.registry import decode, decode_into, peek_header, unframe
from swarmd.compression.topk import TopKCodec, TopKConfig
from swarmd.compression.wire import CodecId, DecodeLimits, Header
from swarmd.compression.zstd_frame import (
    FRAME_OVERHEAD,
    ZstdConfig,
    ZstdFramed,
    zstd_compress,
    zstd_decompress,
)

__all__ = [
    "FRAME_OVERHEAD",
    "Codec",
    "CodecId",
    "CompressionError",
    "DctComponents",
    "DctTopKCodec",
    "DctTopKConfig",
    "DecodeLimits",
    "ErrorFeedback",
    "HalfCodec",
    "HalfConfig",
    "Header",
    "Int8Codec",
    "Int8Config",
    "LowRankCodec",
    "PowerSGD",
    "PowerSGDConfig",
    "PowerSGDRound",
    "RawCodec",
    "ResidualStore",
    "SegmentedCodec",
    "TopKCodec",
    "TopKConfig",
    "ZstdConfig",
    "ZstdFramed",
    "average_components",
    "components_to_bytes",
    "decode",
    "decode_components",
    "decode_into",
    "dequantize_int8",
    "encode_segments",
    "peek_header",
    "quantize_int8",
    "raw_segments",
    "to_dense",
    "unframe",
    "zstd_compress",
    "zstd_decompress",
]
