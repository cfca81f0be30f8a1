"""Wire header and decoder hardening: unknown/inconsistent headers and random or mutated
bytes must raise CompressionError and nothing else, before any oversized allocation."""

from __future__ import annotations

import contextlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    CodecId,
    CompressionError,
    DctTopKCodec,
    DctTopKConfig,
    DecodeLimits,
    HalfCodec,
    Int8Codec,
    Int8Config,
    PowerSGD,
    PowerSGDConfig,
    RawCodec,
    decode,
    peek_header,
    zstd_compress,
    zstd_decompress,
)
from swarmd.compression.wire import MAGIC, pack_header, parse_header

LIMITS = DecodeLimits(max_elements=4096, max_bytes=1 << 16)
X = torch.randn(6, 40)


def valid_payloads() -> list[bytes]:
    return [
        RawCodec().encode(X),
        HalfCodec().encode(X),
        Int8Codec(Int8Config(block_size=16)).encode(X),
        DctTopKCodec(DctTopKConfig(topk=5, values="float16")).encode(X),
        DctTopKCodec(DctTopKConfig(topk=5, values="sign")).encode(X),
        PowerSGD(PowerSGDConfig(rank=2)).encode("w", X),
        zstd_compress(Int8Codec().encode(torch.zeros(300))),
    ]


PAYLOADS = valid_payloads()


def test_header_round_trip_and_peek() -> None:
    raw = pack_header(CodecId.INT8, 1, torch.bfloat16, (2, 3, 4), b"\x01\x02")
    header = parse_header(raw, LIMITS)
    assert header.codec == CodecId.INT8 and header.version == 1
    assert header.dtype == torch.bfloat16 and header.shape == (2, 3, 4)
    assert header.params == b"\x01\x02" and header.payload_offset == len(raw)
    assert header.numel == 24
    for payload in PAYLOADS:
        assert decode(payload, LIMITS).shape in (X.shape, torch.Size([300]))
    assert peek_header(PAYLOADS[2], LIMITS).codec == CodecId.INT8


def with_byte(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"XYZ" + d[3:], "magic"),
        (lambda d: with_byte(d, 3, 9), "format version"),
        (lambda d: with_byte(d, 4, 200), "unknown codec id"),
        (lambda d: with_byte(d, 5, 7), "version 7 unsupported"),
        (lambda d: with_byte(d, 6, 99), "unknown dtype"),
        (lambda d: with_byte(d, 6, 5), "non-float"),
        (lambda d: with_byte(d, 7, 9), "at most 8"),
        (lambda d: d[:5], "truncated header"),
        (lambda d: d[:-1], "payload is"),
        (lambda d: d + b"\x00", "payload is"),
        (lambda d: with_byte(d, 4, int(CodecId.HALF)), "parameters are"),
        (lambda d: d[:10] + struct.pack("<Q", 7) + d[18:], "payload is"),
        (lambda d: d[:10] + struct.pack("<Q", 1 << 40) + d[18:], "over the limit"),
    ],
)
def test_malformed_headers_are_refused_with_clear_messages(mutate, message) -> None:  # type: ignore[no-untyped-def]
    good = Int8Codec(Int8Config(block_size=16)).encode(X)
    with pytest.raises(CompressionError, match=message):
        decode(mutate(good), LIMITS)


def test_inconsistent_codec_params_are_refused() -> None:
    int8 = Int8Codec(Int8Config(block_size=16)).encode(X)
    offset = len(pack_header(CodecId.INT8, 1, torch.float32, (6, 40), b""))
    with pytest.raises(CompressionError, match="block size"):
        decode(int8[:offset] + struct.pack("<I", 0) + int8[offset + 4 :], LIMITS)
    dct = DctTopKCodec(DctTopKConfig(topk=5)).encode(X)
    offset = len(pack_header(CodecId.DCT_TOPK, 1, torch.float32, (6, 40), b""))
    for params, msg in [
        (struct.pack("<BHHH", 1, 7, 40, 5), "does not tile"),
        (struct.pack("<BHHH", 1, 6, 40, 0), "k = 0"),
        (struct.pack("<BHHH", 9, 6, 40, 5), "value mode"),
        (struct.pack("<BHHH", 1, 6, 40, 6), "payload is"),
    ]:
        with pytest.raises(CompressionError, match=msg):
            decode(dct[:offset] + params + dct[offset + 7 :], LIMITS)
    low = PowerSGD(PowerSGDConfig(rank=2)).encode("w", X)
    offset = len(pack_header(CodecId.LOWRANK, 1, torch.float32, (6, 40), b""))
    with pytest.raises(CompressionError, match="rank"):
        decode(low[:offset] + struct.pack("<I", 7) + low[offset + 4 :], LIMITS)


def test_limits_validate_and_refuse_oversize_for_every_codec() -> None:
    with pytest.raises(ValueError, match="max_elements"):
        DecodeLimits(max_elements=-1, max_bytes=0)
    small = DecodeLimits(max_elements=X.numel() - 1, max_bytes=1 << 16)
    for payload in PAYLOADS[:-1]:
        with pytest.raises(CompressionError, match="over the limit"):
            decode(payload, small)
    with pytest.raises(CompressionError, match="over the limit"):
        zstd_decompress(PAYLOADS[-1], max_bytes=100)


def test_unknown_dtype_and_too_many_dims_on_encode() -> None:
    with pytest.raises(CompressionError):
        RawCodec().encode(torch.zeros([1] * 9))
    with pytest.raises(CompressionError):
        RawCodec().encode(torch.zeros(3, dtype=torch.complex64))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    for blob in (data, MAGIC + b"\x01" + data):
        with contextlib.suppress(CompressionError):
            decode(blob, LIMITS)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    which=st.integers(0, len(PAYLOADS) - 1),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 1 << 16),
)
def test_fuzz_mutated_valid_payloads(which: int, edits: list[tuple[int, int]], cut: int) -> None:
    blob = bytearray(PAYLOADS[which])
    for pos, value in edits:
        blob[pos % len(blob)] = value
    blob = blob[: len(blob) - cut % 3 * (cut % len(blob))] if cut % 5 == 0 else blob
    try:
        out = decode(bytes(blob), LIMITS)
    except CompressionError:
        return
    # Whatever decodes is finite and within the limits.
    assert out.numel() <= LIMITS.max_elements
    assert bool(torch.isfinite(out).all())
