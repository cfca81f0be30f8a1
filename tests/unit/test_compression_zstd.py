"""zstd framing: never grows a payload beyond its header, refuses decompression bombs."""

from __future__ import annotations

import os

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    FRAME_OVERHEAD,
    CompressionError,
    DecodeLimits,
    Int8Codec,
    ZstdConfig,
    ZstdFramed,
    decode,
    zstd_compress,
    zstd_decompress,
)
from swarmd.compression.wire import CodecId, pack_header


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.binary(max_size=3000), level=st.sampled_from([1, 3, 9]))
def test_round_trip_and_never_larger_than_input_plus_header(data: bytes, level: int) -> None:
    frame = zstd_compress(data, ZstdConfig(level=level))
    assert len(frame) <= len(data) + FRAME_OVERHEAD
    assert FRAME_OVERHEAD <= 24
    assert zstd_decompress(frame, max_bytes=len(data)) == data


def test_incompressible_is_stored_and_compressible_shrinks() -> None:
    noise = os.urandom(100_000)
    assert len(zstd_compress(noise)) == len(noise) + FRAME_OVERHEAD
    zeros = bytes(100_000)
    assert len(zstd_compress(zeros)) < 1000


def test_bomb_is_refused_before_decompressing() -> None:
    frame = zstd_compress(bytes(10_000_000))
    with pytest.raises(CompressionError, match="over the limit"):
        zstd_decompress(frame, max_bytes=1_000_000)
    # A lying outer header: claims 100 bytes, zstd frame holds 10 MB.
    inner = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(10_000_000))
    liar = pack_header(CodecId.ZSTD, 1, torch.uint8, (100,), b"\x01") + inner
    with pytest.raises(CompressionError, match="content size"):
        zstd_decompress(liar, max_bytes=1000)
    # No content size in the zstd frame: refused, not streamed.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    body = unsized.compress(bytes(1000)) + unsized.flush()
    with pytest.raises(CompressionError):
        zstd_decompress(pack_header(CodecId.ZSTD, 1, torch.uint8, (1000,), b"\x01") + body, 2000)


def test_corrupt_truncated_and_trailing_data_are_refused() -> None:
    frame = zstd_compress(b"abc" * 1000)
    for bad in (frame[:-3], frame + b"xx", frame[:FRAME_OVERHEAD] + b"\x00" * 20):
        with pytest.raises(CompressionError):
            zstd_decompress(bad, max_bytes=10_000)
    stored = zstd_compress(os.urandom(100))
    with pytest.raises(CompressionError):
        zstd_decompress(stored[:-1], max_bytes=10_000)


def test_framed_codec_and_registry_decode() -> None:
    x = torch.zeros(10_000)
    x[::100] = 1.0
    codec = ZstdFramed(Int8Codec())
    data = codec.encode(x)
    assert len(data) < len(Int8Codec().encode(x)) / 4
    limits = DecodeLimits(max_elements=10_000, max_bytes=100_000)
    assert torch.equal(codec.decode(data, limits), x)
    assert torch.equal(decode(data, limits), x)
    with pytest.raises(CompressionError, match="over the limit"):
        decode(data, DecodeLimits(max_elements=10_000, max_bytes=1000))
    with pytest.raises(CompressionError, match="nested"):
        decode(zstd_compress(data), DecodeLimits(max_elements=10_000, max_bytes=1 << 20))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="level"):
        ZstdConfig(level=99)
