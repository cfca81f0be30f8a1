"""fp16/bf16 casts with range clamping, and the RAW pass-through codec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    CompressionError,
    DecodeLimits,
    HalfCodec,
    HalfConfig,
    RawCodec,
    decode,
)

LIMITS = DecodeLimits(max_elements=1 << 20, max_bytes=1 << 24)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=200),
    dtype=st.sampled_from(["float16", "bfloat16"]),
)
def test_round_trip_bound(values: list[float], dtype: str) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = decode(HalfCodec(HalfConfig(dtype)).encode(x), LIMITS)
    assert y.dtype == torch.float32 and y.shape == x.shape and torch.isfinite(y).all()
    info = torch.finfo(HalfConfig(dtype).torch_dtype)
    clamped = x.clamp(-info.max, info.max)
    # Relative half-ulp error inside the normal range; absolute near zero (subnormals).
    bound = clamped.abs() * info.eps / 2 * 1.001 + info.smallest_normal
    assert bool(((y - clamped).abs() <= bound).all())


def test_huge_values_saturate_instead_of_becoming_inf() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 65520.0, 3e38, -3.4e38])
    y16 = decode(HalfCodec(HalfConfig("float16")).encode(x), LIMITS)
    assert torch.isfinite(y16).all() and float(y16.abs().max()) == 65504.0
    ybf = decode(HalfCodec(HalfConfig("bfloat16")).encode(x), LIMITS)
    assert torch.isfinite(ybf).all()
    big = torch.tensor([1e300], dtype=torch.float64)
    assert torch.isfinite(decode(HalfCodec().encode(big), LIMITS)).all()


def test_non_contiguous_and_dtype_preserved() -> None:
    x = torch.randn(20, 30, dtype=torch.float64).T[::2]
    y = decode(HalfCodec().encode(x), LIMITS)
    assert y.dtype == torch.float64 and y.shape == x.shape
    torch.testing.assert_close(y, x, atol=0.02, rtol=0.01)


def test_ratio_is_two() -> None:
    x = torch.randn(10_000)
    assert len(HalfCodec().encode(x)) < x.numel() * 2 + 64


def test_inf_in_payload_is_refused_and_nan_input_refused() -> None:
    data = bytearray(HalfCodec(HalfConfig("float16")).encode(torch.ones(4)))
    data[-2:] = (
        torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    )
    with pytest.raises(CompressionError, match="NaN or infinity"):
        decode(bytes(data), LIMITS)
    with pytest.raises(CompressionError):
        HalfCodec().encode(torch.tensor([float("nan")]))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="dtype"):
        HalfConfig("float8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_raw_is_exact(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5).to(dtype).T
    y = RawCodec().decode(RawCodec().encode(x), LIMITS)
    assert y.dtype == dtype and torch.equal(y, x)
    assert torch.equal(decode(RawCodec().encode(torch.tensor(2.5)), LIMITS), torch.tensor(2.5))
