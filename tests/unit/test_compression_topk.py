"""Sparse top-k with few-bit values: what is kept, the one-scale bound, error feedback's sum,
and a decoder that refuses every malformed payload before allocating."""

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
    DecodeLimits,
    ErrorFeedback,
    TopKCodec,
    TopKConfig,
    decode,
    zstd_compress,
)
from swarmd.compression.int8 import SCALE_MIN
from swarmd.compression.topk import encoded_size, index_width
from swarmd.compression.wire import pack_header, parse_header

LIMITS = DecodeLimits(max_elements=1 << 16, max_bytes=1 << 20)
floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def round_trip(x: torch.Tensor, config: TopKConfig) -> torch.Tensor:
    return decode(TopKCodec(config).encode(x), LIMITS)


def check_kept(x: torch.Tensor, y: torch.Tensor, config: TopKConfig) -> None:
    """At most k nonzeros per chunk, each the position of one of the chunk's k largest
    magnitudes, within one scale (absmax / (2^bits - 1), at least the smallest normal) of
    its input; zeros elsewhere."""
    flat, out = x.reshape(-1).float(), y.reshape(-1).float()
    levels = (1 << config.bits) - 1
    for s in range(0, flat.numel(), config.chunk):
        xs, ys = flat[s : s + config.chunk], out[s : s + config.chunk]
        sent = ys != 0
        assert int(sent.sum()) <= config.k
        if not bool(sent.any()):
            continue
        threshold = xs.abs().topk(min(config.k, xs.numel())).values.min()
        assert bool((xs.abs()[sent] >= threshold).all())
        scale = max(float(xs.abs().max()) / levels, SCALE_MIN)  # scales are clamped up
        err = (ys[sent].double() - xs[sent].double()).abs()
        assert float(err.max()) <= scale * (1 + 1e-5) + 1e-38


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    values=st.lists(floats32, min_size=0, max_size=700),
    chunk=st.sampled_from([64, 100, 256, 300]),
    density=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    bits=st.sampled_from([1, 2, 4, 8]),
)
def test_round_trip_keeps_the_top_k_within_one_scale(
    values: list[float], chunk: int, density: float, bits: int
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    config = TopKConfig(chunk=chunk, density=density, bits=bits)
    y = round_trip(x, config)
    assert y.shape == x.shape and bool(torch.isfinite(y).all())
    check_kept(x, y, config)


def test_density_one_at_eight_bits_keeps_every_nonzero() -> None:
    x = torch.zeros(5000)
    x[::7] = torch.randn(715)
    config = TopKConfig(density=1.0, bits=8)
    blob = TopKCodec(config).encode(x)
    y = decode(blob, LIMITS)
    assert torch.equal(y != 0, x != 0)
    assert len(blob) - parse_header(blob, LIMITS).payload_offset == encoded_size(5000, 715, config)


def test_defaults_send_a_fourteenth_of_int8() -> None:
    config = TopKConfig()
    assert (config.chunk, config.k, config.bits) == (4096, 128, 2)
    blob = TopKCodec(config).encode(torch.randn(1 << 16))
    assert len(blob) < (1 << 16) * 0.072 + 100
    assert config.bytes_per_value() == pytest.approx(294 / 4096)


def test_index_width_is_the_smallest_unsigned_type() -> None:
    assert [index_width(c) for c in (64, 256, 257, 4096, 1 << 15)] == [1, 1, 2, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_and_shapes(dtype: torch.dtype) -> None:
    x = torch.randn(3, 50, 7).to(dtype)
    y = round_trip(x, TopKConfig(chunk=64, density=0.25))
    assert y.dtype == dtype and y.shape == x.shape


def test_zeros_and_empty_are_exact() -> None:
    for x in (torch.zeros(1000), torch.empty(0)):
        assert torch.equal(round_trip(x, TopKConfig()), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(500)
    x[17] = bad
    with pytest.raises(CompressionError, match="NaN or infinity"):
        TopKCodec().encode(x)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk": 32}, "chunk"),
        ({"chunk": 1 << 16}, "chunk"),
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": True}, "density"),
        ({"bits": 3}, "bits"),
        ({"bits": 16}, "bits"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopKConfig(**kwargs)  # type: ignore[arg-type]


def test_error_feedback_sent_plus_residual_is_the_sum_of_the_inputs() -> None:
    """Over many rounds nothing is lost: what the receivers decoded plus what is still
    carried equals everything that was put in (to float rounding)."""
    ef = ErrorFeedback(TopKCodec(TopKConfig(chunk=256, density=1 / 16, bits=2)))
    gen = torch.Generator().manual_seed(0)
    inputs, sent = torch.zeros(3000, dtype=torch.float64), torch.zeros(3000, dtype=torch.float64)
    for _ in range(30):
        x = torch.randn(3000, generator=gen)
        inputs += x.double()
        _, decoded = ef.encode_with_decoded("w", x)
        assert int((decoded != 0).sum()) <= 12 * 16  # 12 chunks, k = 16
        sent += decoded.double()
    residual = ef.residual("w")
    assert residual is not None
    assert torch.allclose(sent + residual.double(), inputs, atol=1e-4)
    # And the residual stays bounded: error feedback sends the large entries eventually.
    assert float(residual.abs().max()) < 30


PAYLOADS = [
    TopKCodec(TopKConfig(chunk=64, density=0.05, bits=2)).encode(torch.randn(300)),
    TopKCodec(TopKConfig(chunk=300, density=0.1, bits=4)).encode(torch.randn(6, 100)),
    TopKCodec(TopKConfig(chunk=64, density=1.0, bits=8)).encode(torch.randn(100)),
    TopKCodec(TopKConfig(chunk=128, density=0.5, bits=1)).encode(torch.randn(129)),
]


def _params(blob: bytes) -> tuple[int, int]:
    header = parse_header(blob, LIMITS)
    return header.payload_offset - 14, header.payload_offset


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (struct.pack("<IBBQ", 32, 2, 1, 12), "chunk"),
        (struct.pack("<IBBQ", 64, 3, 1, 12), "bits"),
        (struct.pack("<IBBQ", 64, 2, 2, 12), "index width"),
        (struct.pack("<IBBQ", 64, 2, 1, 10**6), "keeps"),
        (struct.pack("<IBBQ", 64, 2, 1, 13), "payload is"),
    ],
)
def test_inconsistent_params_are_refused(params: bytes, message: str) -> None:
    blob = PAYLOADS[0]
    start, end = _params(blob)
    with pytest.raises(CompressionError, match=message):
        decode(blob[:start] + params + blob[end:], LIMITS)


def test_bad_scales_counts_and_indices_are_refused() -> None:
    blob = bytearray(PAYLOADS[0])  # 300 values, chunk 64: 5 chunks, k = 3, indices
    _, body = _params(bytes(blob))
    for offset, raw, message in [
        (body, struct.pack("<f", float("nan")), "scale"),
        (body, struct.pack("<f", -1.0), "scale"),
        (body + 20, struct.pack("<H", 14), "counts"),
        (body + 20, struct.pack("<HH", 65, 0), "counts"),
        (body + 30, bytes([64]), "beyond its chunk"),
        (body + 30, bytes([0, 0]), "increasing"),
    ]:
        bad = bytearray(blob)
        bad[offset : offset + len(raw)] = raw
        with pytest.raises(CompressionError, match=message):
            decode(bytes(bad), LIMITS)


def test_the_smaller_support_is_sent_and_a_bad_bitmap_refused() -> None:
    assert _params(PAYLOADS[0]) and PAYLOADS[0][_params(PAYLOADS[0])[0] + 5] == 1  # indices
    blob = PAYLOADS[2]  # 100 values, every one kept: a 13-byte bitmap beats 100 indices
    start, body = _params(blob)
    assert blob[start + 5] == 0
    bitmap = body + 4 * 2 + 2 * 2
    for offset, value, message in [
        (bitmap + 12, 0xFF, "beyond the tensor"),
        (bitmap, 0xFE, "does not match the chunk counts"),
    ]:
        bad = bytearray(blob)
        bad[offset] = value
        with pytest.raises(CompressionError, match=message):
            decode(bytes(bad), LIMITS)
    sparse = torch.zeros(4096)
    sparse[::8] = 1.0  # 512 kept: 1024 bytes of indices, 512 of bitmap
    blob = TopKCodec(TopKConfig(density=1.0, bits=8)).encode(sparse)
    assert blob[_params(blob)[0] + 5] == 0
    assert torch.equal(decode(blob, LIMITS), sparse)


def test_declared_size_over_limit_is_refused_before_decoding() -> None:
    header = pack_header(
        CodecId.TOPK, 1, torch.float32, (1 << 40,), struct.pack("<IBBQ", 64, 2, 1, 1)
    )
    with pytest.raises(CompressionError, match="over the limit"):
        decode(header, LIMITS)
    with pytest.raises(CompressionError, match="over the limit"):
        decode(PAYLOADS[0], DecodeLimits(max_elements=299, max_bytes=1 << 20))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    prefix = pack_header(CodecId.TOPK, 1, torch.float32, (100,), b"")[:9]
    for blob in (data, prefix + data):
        with contextlib.suppress(CompressionError):
            decode(blob, LIMITS)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    which=st.integers(0, len(PAYLOADS)),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 1 << 16),
)
def test_fuzz_mutated_valid_payloads(which: int, edits: list[tuple[int, int]], cut: int) -> None:
    source = PAYLOADS[which] if which < len(PAYLOADS) else zstd_compress(PAYLOADS[0])
    blob = bytearray(source)
    for pos, value in edits:
        blob[pos % len(blob)] = value
    blob = blob[: len(blob) - cut % 3 * (cut % len(blob))] if cut % 5 == 0 else blob
    try:
        out = decode(bytes(blob), LIMITS)
    except CompressionError:
        return
    assert out.numel() <= LIMITS.max_elements
    assert bool(torch.isfinite(out).all())
