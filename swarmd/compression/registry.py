"""Decode any payload by the codec id in its header: receivers need no out-of-band
knowledge of what a peer chose to send."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmd.compression.dct_topk import _decode_components, to_dense
from swarmd.compression.errors import CompressionError
from swarmd.compression.halfcast import decode_half
from swarmd.compression.int8 import decode_int8
from swarmd.compression.lowrank import decode_lowrank
from swarmd.compression.raw import decode_raw
from swarmd.compression.topk import decode_topk
from swarmd.compression.wire import CodecId, DecodeLimits, Header, parse_header
from swarmd.compression.zstd_frame import _decompress

Buffer = bytes | bytearray | memoryview

_DECODERS: dict[CodecId, Callable[[Header, Buffer], torch.Tensor]] = {
    CodecId.RAW: decode_raw,
    CodecId.HALF: decode_half,
    CodecId.INT8: decode_int8,
    CodecId.LOWRANK: decode_lowrank,
    CodecId.DCT_TOPK: lambda header, data: to_dense(_decode_components(header, data)),
    CodecId.TOPK: decode_topk,
}


def decode(data: Buffer, limits: DecodeLimits, *, finite: bool = True) -> torch.Tensor:
    """Decode any swarmd payload, optionally zstd-framed (one level; nesting is refused).

    Every failure (unknown codec, truncation, oversize, NaN, inconsistency) raises
    `CompressionError`; with ``finite=False`` a RAW payload's NaN and infinity do not (the
    caller's norm pass refuses them, and a second pass over the values is spared).
    """
    return _decode_unframed(*unframe(data, limits), finite=finite)


def _decode_unframed(header: Header, data: Buffer, *, finite: bool) -> torch.Tensor:
    if header.codec == CodecId.RAW and not finite:
        return decode_raw(header, data, finite=False)
    return _DECODERS[header.codec](header, data)


def unframe(data: Buffer, limits: DecodeLimits) -> tuple[Header, Buffer]:
    """The payload inside an optional zstd frame (inflated) and its header."""
    header = parse_header(data, limits)
    if header.codec == CodecId.ZSTD:
        data = _decompress(header, data, limits.max_bytes)
        header = parse_header(data, limits)
        if header.codec == CodecId.ZSTD:
            raise CompressionError("nested ZSTD frames are refused")
    return header, data


def peek_header(data: Buffer, limits: DecodeLimits) -> Header:
    """The outer header alone, for routing or logging before decoding."""
    return parse_header(data, limits)


def decode_into(
    data: Buffer, limits: DecodeLimits, out: torch.Tensor, *, finite: bool = True
) -> None:
    """Decodes a payload that must describe a float32 tensor of `out`'s shape into `out`.

    INT8 payloads are dequantised straight into `out`; other codecs decode, then copy. On
    failure `out` may hold part of the payload: the caller overwrites it with its fallback.
    ``finite``: see `decode`.
    """
    # A zstd frame is inflated first, so that framed int8 codes too are dequantised in place
    # (they were decoded into a fresh tensor and copied: its first touch, the kernel zeroing
    # 100 MB of pages per part, was an eighth of a default-codec round's CPU).
    header, data = unframe(data, limits)
    if header.dtype != torch.float32 or header.shape != tuple(out.shape):
        raise CompressionError(
            f"payload is {header.dtype} {header.shape}, expected float32 {tuple(out.shape)}"
        )
    if header.codec == CodecId.INT8 and out.dtype == torch.float32 and out.is_contiguous():
        decode_int8(header, data, out)
        return
    value = _decode_unframed(header, data, finite=finite)  # inflated above already
    if value.dtype != torch.float32 or value.shape != out.shape:
        raise CompressionError(
            f"payload is {value.dtype} {tuple(value.shape)}, expected float32 {tuple(out.shape)}"
        )
    out.copy_(value)
