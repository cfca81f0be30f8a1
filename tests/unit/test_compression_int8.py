"""int8 blockwise: per-element error <= scale/2 of its block, on every awkward input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    CompressionError,
    DecodeLimits,
    HalfCodec,
    Int8Codec,
    Int8Config,
    RawCodec,
    decode,
    decode_into,
    dequantize_int8,
    quantize_int8,
)
from swarmd.compression.int8 import SCALE_MAX, SCALE_MIN
from swarmd.compression.zstd_frame import ZstdConfig, zstd_compress

LIMITS = DecodeLimits(max_elements=1 << 20, max_bytes=1 << 24)
FMAX = torch.finfo(torch.float32).max


def assert_within_half_scale(x: torch.Tensor, block: int) -> None:
    flat = x.detach().to(torch.float32).reshape(-1)
    q, scales = quantize_int8(flat, block)
    assert q.dtype == torch.int8
    assert q.numel() == 0 or int(q.abs().max()) <= 127
    y = dequantize_int8(q, scales, block)
    assert torch.isfinite(y).all()
    per_elem = scales.repeat_interleave(block)[: flat.numel()]
    err = (y.double() - flat.double()).abs()
    # scale/2 plus float32 rounding of the division and of q * scale.
    bound = per_elem.double() / 2 * (1 + 1e-6) + flat.double().abs() * 1e-7
    assert bool((err <= bound).all()), float((err - bound).max())
    # Codec bytes decode to exactly the tensor-level result.
    codec = Int8Codec(Int8Config(block_size=block))
    out = codec.decode(codec.encode(x), LIMITS)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out.reshape(-1).to(torch.float32), y.to(x.dtype).to(torch.float32))


floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    values=st.lists(floats32, min_size=0, max_size=300),
    block=st.sampled_from([1, 3, 16, 64, 256]),
)
def test_round_trip_bound_on_arbitrary_floats(values: list[float], block: int) -> None:
    assert_within_half_scale(torch.tensor(values, dtype=torch.float32), block)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(1000),
        torch.full((777,), 3.25),
        torch.full((300,), -1e-3),
        torch.full((130,), 1e-44),  # subnormal: absmax / 127 underflows
        torch.tensor([1e-45, -2e-45, 0.0, 1.4e-45] * 40),
        torch.full((256,), FMAX),  # 127 * (FMAX / 127) overflows
        torch.tensor([FMAX, -FMAX, 1.0, -1e-30] * 64),
        torch.tensor([1e38, 1e-38, 0.0, -1e38]),
        torch.tensor([5.0]),
        torch.empty(0),
    ],
    ids=[
        "zeros",
        "const",
        "neg-const",
        "subnormal",
        "min-subnormal",
        "fmax",
        "mixed-huge",
        "huge-tiny",
        "single",
        "empty",
    ],
)
def test_edge_cases(x: torch.Tensor) -> None:
    for block in (1, 64, 256):
        assert_within_half_scale(x, block)


def test_all_zero_and_constant_blocks_are_exact() -> None:
    codec = Int8Codec(Int8Config(block_size=64))
    x = torch.cat([torch.zeros(64), torch.full((64,), 7.0), torch.full((64,), -0.5)])
    assert torch.equal(codec.decode(codec.encode(x), LIMITS), x)


def test_non_contiguous_inputs() -> None:
    base = torch.randn(64, 48)
    for x in (base.T, base[:, ::3], base[::2, 5:], base.unsqueeze(0).expand(3, 64, 48)):
        assert not x.is_contiguous()
        assert_within_half_scale(x, 64)
        codec = Int8Codec(Int8Config(block_size=32))
        y = codec.decode(codec.encode(x), LIMITS)
        assert y.shape == x.shape
        assert float((y - x).abs().max()) <= float(x.abs().max()) / 127


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    x = (torch.randn(500) * 100).to(dtype)
    codec = Int8Codec()
    y = codec.decode(codec.encode(x), LIMITS)
    assert y.dtype == dtype
    rel = float((y.double() - x.double()).norm() / x.double().norm())
    assert rel < 0.02


def test_ratio_and_scales_are_clamped() -> None:
    x = torch.randn(256 * 100)
    data = Int8Codec(Int8Config(block_size=256)).encode(x)
    assert x.numel() * 4 / len(data) >= 3.9
    _, scales = quantize_int8(torch.full((10,), FMAX), 4)
    assert float(scales.max()) <= SCALE_MAX and math.isfinite(float(scales.max()) * 127)
    _, scales = quantize_int8(torch.zeros(10), 4)
    assert float(scales.min()) >= SCALE_MIN


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(1000)
    x[567] = bad
    with pytest.raises(CompressionError, match="NaN or infinity"):
        Int8Codec().encode(x)


def test_float64_beyond_float32_range_is_refused() -> None:
    with pytest.raises(CompressionError):
        Int8Codec().encode(torch.tensor([1e300], dtype=torch.float64))


def test_non_float_input_is_refused() -> None:
    with pytest.raises(CompressionError, match="float"):
        Int8Codec().encode(torch.arange(10))


def test_nan_or_negative_scale_in_payload_is_refused() -> None:
    x = torch.randn(128)
    data = bytearray(Int8Codec(Int8Config(block_size=64)).encode(x))
    header_len = len(data) - 2 * 4 - 128
    for bad in (float("nan"), -1.0, float("inf"), 1e38):
        data[header_len : header_len + 4] = torch.tensor([bad]).numpy().tobytes()
        with pytest.raises(CompressionError, match="scale"):
            decode(bytes(data), LIMITS)


def test_config_validation() -> None:
    for bad in (0, -1, 1 << 17, 2.0, True):
        with pytest.raises(ValueError, match="block_size"):
            Int8Config(block_size=bad)  # type: ignore[arg-type]
    for bad_bits in (1, 9, 0, 4.0, True):
        with pytest.raises(ValueError, match="bits"):
            Int8Config(bits=bad_bits)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [2, 4, 7])
def test_fewer_bits_narrow_the_codes_and_keep_the_half_step_bound(bits: int) -> None:
    """Codes stay in ±(2**(bits-1) - 1), every value within half its block's (coarser) step,
    the payload decodes with the plain decoder, and the fused residual is still exact."""
    qmax = (1 << (bits - 1)) - 1
    block = 64
    x = torch.randn(10_048) * torch.linspace(1e-3, 50.0, 10_048)  # 157 blocks
    x[:64] = 0.0  # an all-zero block stays exact
    codec = Int8Codec(Int8Config(block_size=block, bits=bits))
    residual = torch.empty_like(x)
    blob = b"".join(codec.encode_segments(x, residual))
    assert len(blob) == len(Int8Codec(Int8Config(block_size=block)).encode(x))
    codes = torch.frombuffer(bytearray(blob[-x.numel() :]), dtype=torch.int8)
    assert int(codes.abs().max()) == qmax
    y = decode(blob, DecodeLimits.for_tensor(x))
    assert torch.equal(residual, x - y)
    assert torch.equal(y[:64], x[:64])
    absmax = x.view(-1, block).abs().amax(dim=1)
    step = (absmax / qmax).repeat_interleave(block)
    assert bool(((y - x).abs() <= step / 2 * (1 + 1e-6) + x.abs() * 1e-7).all())


def test_four_bit_codes_halve_a_zstd_framed_payload() -> None:
    """What `bits` is for: the same byte per code, but zstd squeezes 4-bit codes to about
    half of what 8-bit codes take (Gaussian values, blocks of 4096)."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    sizes = {}
    for bits in (8, 4):
        blob = Int8Codec(Int8Config(block_size=4096, bits=bits)).encode(x)
        sizes[bits] = len(zstd_compress(blob))
    assert sizes[4] < 0.55 * sizes[8], sizes


def test_declared_size_over_limit_is_refused_before_decoding() -> None:
    data = Int8Codec().encode(torch.randn(1000))
    with pytest.raises(CompressionError, match="over the limit"):
        decode(data, DecodeLimits(max_elements=999, max_bytes=1 << 20))


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 70_001])
@pytest.mark.parametrize("block", [1, 64, 256])
def test_segments_and_fused_residual_match_a_decode(n: int, block: int) -> None:
    """encode_segments is encode in pieces, and the residual it writes is exactly what error
    feedback would get by decoding the payload: input - decode(encode(input))."""
    codec = Int8Codec(Int8Config(block_size=block))
    x = torch.randn(n) * torch.linspace(1e-3, 50.0, n)
    residual = torch.full((n,), float("nan"))
    segments = codec.encode_segments(x, residual)
    blob = b"".join(segments)
    assert blob == codec.encode(x)
    decoded = codec.decode(blob, DecodeLimits.for_tensor(x))
    assert torch.equal(residual, x - decoded)
    with pytest.raises(CompressionError):
        codec.encode_segments(x, torch.empty(n + 1))


@pytest.mark.parametrize("n", [1, 255, 70_001])
def test_decoded_is_what_a_receiver_decodes_even_in_place(n: int) -> None:
    """`decoded=` gets exactly decode(encode(x)), also when it is the input itself (how a
    reducer turns its reduced part into the shared result without decoding the payload)."""
    codec = Int8Codec(Int8Config(block_size=64, bits=6))
    x = torch.randn(n) * torch.linspace(1e-3, 50.0, n)
    x[::7] = -1e-9  # rounds to code 0: must come out as +0.0, as a receiver decodes it
    expected = codec.decode(codec.encode(x), DecodeLimits.for_tensor(x))

    def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:  # torch.equal has -0.0 == 0.0
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    target, residual = torch.full((n,), math.nan), torch.empty(n)
    assert b"".join(codec.encode_segments(x, residual, decoded=target)) == codec.encode(x)
    assert same_bytes(target, expected) and torch.equal(residual, x - expected)
    in_place = x.clone()
    assert b"".join(codec.encode_segments(in_place, decoded=in_place)) == codec.encode(x)
    assert same_bytes(in_place, expected)
    with pytest.raises(CompressionError, match="decoded must be"):
        codec.encode_segments(x, decoded=torch.empty(n + 1))


def test_codes_can_go_into_a_reused_buffer() -> None:
    """`codes=` receives the codes and the payload views it: the same bytes as a fresh
    encoding, and changing the buffer afterwards changes the payload (so it must not be
    reused before the bytes are sent)."""
    codec = Int8Codec(Int8Config(block_size=256))
    x = torch.randn(10_000)
    buffer = torch.full((10_000,), 99, dtype=torch.int8)
    segments = codec.encode_segments(x, codes=buffer)
    assert b"".join(segments) == codec.encode(x)
    assert bytes(segments[-1]) == buffer.numpy().tobytes()
    buffer.zero_()
    assert bytes(segments[-1]) == bytes(10_000)
    for bad in (torch.empty(9_999, dtype=torch.int8), torch.empty(10_000, dtype=torch.uint8)):
        with pytest.raises(CompressionError, match="codes must be"):
            codec.encode_segments(x, codes=bad)


def test_decode_into_writes_the_decoded_values_in_place() -> None:
    codec = Int8Codec()
    x = torch.randn(10_000)
    blob = codec.encode(x)
    out = torch.full((10_000,), 7.0)
    decode_into(blob, DecodeLimits.for_tensor(x), out)
    assert torch.equal(out, codec.decode(blob, DecodeLimits.for_tensor(x)))
    raw = RawCodec().encode(x)
    decode_into(raw, DecodeLimits.for_tensor(x), out)
    assert torch.equal(out, x)
    # A payload of another shape or dtype is refused, whatever the codec.
    for wrong in (codec.encode(torch.randn(9_999)), codec.encode(torch.randn(100, 100))):
        with pytest.raises(CompressionError, match="expected float32"):
            decode_into(wrong, DecodeLimits.for_tensor(x), out)
    half = HalfCodec().encode(x.half())
    with pytest.raises(CompressionError, match="expected float32"):
        decode_into(half, DecodeLimits.for_tensor(x), out)
    # In a zstd frame (the run's default), inflated first and then dequantised in place; a
    # framed payload of another shape is refused alike.
    limits = DecodeLimits(max_elements=10_000, max_bytes=1 << 20)
    out.fill_(7.0)
    decode_into(zstd_compress(blob, ZstdConfig(literals=True)), limits, out)
    assert torch.equal(out, codec.decode(blob, limits))
    with pytest.raises(CompressionError, match="expected float32"):
        decode_into(zstd_compress(codec.encode(torch.randn(9_999))), limits, out)
