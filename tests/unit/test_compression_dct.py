"""DCT top-k (DeMo): orthonormal transform, exactness at k = chunk size, narrow indices,
sign mode, and averaging of several peers' sparse components."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression import (
    CompressionError,
    DctTopKCodec,
    DctTopKConfig,
    DecodeLimits,
    average_components,
    components_to_bytes,
    decode,
    decode_components,
    to_dense,
)
from swarmd.compression.dct import chunk_sizes, dct_matrix, largest_divisor_at_most
from swarmd.compression.dct_topk import index_dtype, pack_bits, unpack_bits

LIMITS = DecodeLimits(max_elements=1 << 20, max_bytes=1 << 24)
shapes = st.one_of(
    st.tuples(st.integers(1, 200)),
    st.tuples(st.integers(1, 70), st.integers(1, 70)),
    st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6)),
)


@pytest.mark.parametrize("size", [1, 2, 7, 50, 64])
def test_dct_matrix_is_orthonormal(size: int) -> None:
    d = dct_matrix(size).double()
    torch.testing.assert_close(d @ d.T, torch.eye(size, dtype=torch.float64), atol=1e-6, rtol=0)


def test_chunk_is_largest_divisor_at_most_64() -> None:
    assert largest_divisor_at_most(128, 64) == 64
    assert largest_divisor_at_most(100, 64) == 50
    assert largest_divisor_at_most(67, 64) == 1
    assert largest_divisor_at_most(12, 64) == 12
    assert chunk_sizes((4096,)) == (1, 64)
    assert chunk_sizes((96, 200)) == (48, 50)
    assert index_dtype(64) == torch.uint8 and index_dtype(64 * 64) == torch.int16


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_full_k_round_trip_is_exact(shape: tuple[int, ...], seed: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    codec = DctTopKCodec(DctTopKConfig(topk=64 * 64, values="float32"))
    y = codec.decode(codec.encode(x), LIMITS)
    assert y.shape == x.shape
    torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    shape=shapes,
    k=st.integers(1, 40),
    values=st.sampled_from(["float16", "bfloat16", "float32", "sign"]),
    seed=st.integers(0, 2**16),
)
def test_top_k_bounds(shape: tuple[int, ...], k: int, values: str, seed: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    codec = DctTopKCodec(DctTopKConfig(topk=k, values=values))
    comp = codec.compress(x)
    data = codec.encode(x)
    y = decode(data, LIMITS)
    # Bytes carry exactly the components (values already at wire precision).
    torch.testing.assert_close(y, to_dense(comp), atol=1e-5, rtol=1e-5)
    # Orthonormality: the error is the energy of the dropped coefficients (plus value
    # rounding), so it can never exceed the input's norm for float value modes.
    if values != "sign":
        assert float((y - x).norm()) <= float(x.norm()) * 1.01 + 1e-6
    if values == "float32":
        cn, cm = comp.chunk
        if k >= cn * cm:
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def test_keeps_the_largest_coefficients() -> None:
    d = dct_matrix(64)
    coeffs = torch.zeros(64)
    coeffs[[3, 17, 40]] = torch.tensor([5.0, -4.0, 3.0])
    noise = torch.zeros(64)
    noise[[1, 2]] = 0.1
    x = d.T @ (coeffs + noise)
    comp = DctTopKCodec(DctTopKConfig(topk=3, values="float32")).compress(x)
    assert sorted(comp.indices[0].tolist()) == [3, 17, 40]
    torch.testing.assert_close(to_dense(comp), d.T @ coeffs, atol=1e-5, rtol=1e-5)


def test_averaging_peers_equals_mean_of_their_decodes() -> None:
    codec = DctTopKCodec(DctTopKConfig(topk=16, values="float16"))
    xs = [torch.randn(96, 128) for _ in range(4)]
    comps = [decode_components(codec.encode(x), LIMITS) for x in xs]
    expected = torch.stack([to_dense(c) for c in comps]).mean(0)
    torch.testing.assert_close(average_components(comps), expected, atol=1e-5, rtol=1e-5)
    # With full k the average of components is the average of the inputs.
    full = DctTopKCodec(DctTopKConfig(topk=64 * 64, values="float32"))
    avg = average_components([full.compress(x) for x in xs])
    torch.testing.assert_close(avg, torch.stack(xs).mean(0), atol=1e-5, rtol=1e-5)


def test_averaging_refuses_mismatched_peers() -> None:
    codec = DctTopKCodec()
    with pytest.raises(CompressionError):
        average_components([codec.compress(torch.randn(64)), codec.compress(torch.randn(128))])
    with pytest.raises(CompressionError):
        average_components([])


def test_sign_mode_payload_is_small_and_signs_are_right() -> None:
    x = torch.randn(64, 64)
    sign = DctTopKCodec(DctTopKConfig(topk=32, values="sign"))
    half = DctTopKCodec(DctTopKConfig(topk=32, values="float16"))
    assert len(sign.encode(x)) < len(half.encode(x))
    comp_s, comp_h = sign.compress(x), half.compress(x)
    assert torch.equal(comp_s.indices, comp_h.indices)
    assert torch.equal(comp_s.values < 0, comp_h.values < 0)
    bits = torch.rand(37) < 0.5
    assert torch.equal(unpack_bits(pack_bits(bits), 37), bits)


def test_index_out_of_chunk_is_refused() -> None:
    x = torch.randn(64)
    codec = DctTopKCodec(DctTopKConfig(topk=4, values="float32"))
    data = bytearray(codec.encode(x))
    header_len = len(data) - 4 - 16
    data[header_len] = 200  # uint8 index >= 64
    with pytest.raises(CompressionError, match="index"):
        decode(bytes(data), LIMITS)


def test_components_to_bytes_validates_mode_and_config_validation() -> None:
    comp = DctTopKCodec().compress(torch.randn(64))
    with pytest.raises(ValueError, match="values"):
        components_to_bytes(comp, "int3")
    with pytest.raises(ValueError, match="topk"):
        DctTopKConfig(topk=0)
    with pytest.raises(ValueError, match="max_chunk"):
        DctTopKConfig(max_chunk=1000)
    with pytest.raises(ValueError, match="values"):
        DctTopKConfig(values="int4")
    with pytest.raises(CompressionError, match="NaN"):
        DctTopKCodec().encode(torch.tensor([1.0, float("nan")]))
