"""The DeMo exchange payload (swarmd.compression.sparse_wire): round trips, sizes, and a
decoder that refuses anything malformed with CompressionError (and nothing else) before it
allocates what the payload declares."""

from __future__ import annotations

import contextlib
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compression.errors import CompressionError
from swarmd.compression.sparse_wire import (
    MAGIC,
    VERSION,
    SparseLayout,
    SparseUpdate,
    decode_sparse,
    encode_sparse,
    encoded_size,
    index_bits,
    quantize_values,
)
from swarmd.optim.demo import DeMo, DeMoConfig

SHAPES = [(37,), (48, 80), (97, 131), (128, 192), (4, 6, 10)]
BIG = 1 << 24


def prepared(
    shapes: list[tuple[int, ...]] = SHAPES, seed: int = 0
) -> tuple[DeMo, list[SparseUpdate]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    demo = DeMo(params, DeMoConfig(lr=1e-3))
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return demo, demo.prepare()


DEMO, UPDATES = prepared()
LAYOUT = DEMO.layout()
SMALL_LAYOUT: SparseLayout = [((2,), 5), ((1, 2), 300)]


def small_updates() -> list[SparseUpdate]:
    return [
        SparseUpdate(torch.tensor([[0, 4], [3, 1]]), torch.tensor([[1.5, -2.0], [0.25, 3.0]])),
        SparseUpdate(torch.tensor([[[299], [7]]]), torch.tensor([[[-1.0], [0.5]]])),
    ]


SMALL = encode_sparse(small_updates(), layout=SMALL_LAYOUT)


# -- round trip, widths, sizes --------------------------------------------------------------------


@pytest.mark.parametrize(("value_dtype", "rtol"), [("bf16", 2.0**-8), ("fp16", 2.0**-11)])
def test_round_trip(value_dtype: str, rtol: float) -> None:
    data = encode_sparse(UPDATES, value_dtype)
    assert len(data) == encoded_size(LAYOUT, 32)
    out = decode_sparse(data, LAYOUT, max_bytes=len(data))
    assert len(out) == len(UPDATES)
    for got, sent, (grid, block) in zip(out, UPDATES, LAYOUT, strict=True):
        assert got.indices.dtype == torch.int64 and got.values.dtype == torch.float32
        assert tuple(got.indices.shape[:-1]) == grid and got.block_size == block
        assert torch.equal(got.indices, sent.indices)
        big = sent.values.abs() > 1e-4  # fp16 subnormals have less relative precision
        torch.testing.assert_close(got.values[big], sent.values[big], rtol=rtol, atol=0)
    # The decoded lists are what DeMo.apply takes.
    DEMO.apply([UPDATES, out])


def test_indices_take_the_fewest_bits_that_hold_the_block() -> None:
    assert [index_bits(b) for b in (1, 2, 5, 256, 257, 300, 4096, 65536, 65537, 1 << 32)] == [
        1, 1, 3, 8, 9, 9, 12, 16, 17, 32,
    ]  # fmt: skip
    with pytest.raises(CompressionError, match="wider than 32 bits"):
        index_bits((1 << 32) + 1)
    # On the wire: a 5-coefficient block packs 3 bits an index, a 300-coefficient one 9.
    assert SMALL[10 + 1] == 3 and SMALL[24 + 1] == 9
    assert len(SMALL) == encoded_size(SMALL_LAYOUT, [2, 1])
    out = decode_sparse(SMALL, SMALL_LAYOUT, max_bytes=len(SMALL))
    assert out[1].indices.reshape(-1).tolist() == [299, 7]
    assert out[0].indices.tolist() == [[0, 4], [3, 1]]


def test_much_smaller_than_dense_fp32() -> None:
    layout: SparseLayout = [((2, 3), 4096)]  # a 128 x 192 matrix in 64 x 64 blocks
    dense = 128 * 192 * 4
    sparse = encoded_size(layout, 32)
    assert sparse == 10 + 10 + 8 + 6 * 32 * 12 // 8 + 6 * 32 * 2
    assert dense / sparse > 100
    scales = 6 * 4  # one f32 per block of 32 values
    assert encoded_size(layout, 32, "int8") == 10 + 10 + 8 + 6 * 32 * 12 // 8 + scales + 6 * 32
    assert encoded_size(layout, 32, "int4") == 10 + 10 + 8 + 6 * 32 * 12 // 8 + scales + 6 * 16
    assert len(encode_sparse(UPDATES[3:4])) == sparse  # the real (128, 192) update


def test_value_dtypes_range_and_default() -> None:
    """fp16 saturates (never inf) and flushes tiny momenta to zero; bf16, the default, keeps
    both ends of the range: why it is the default."""
    values = torch.tensor([[1e6, -1e6, 3e-9, 1.0]])
    update = [SparseUpdate(torch.tensor([[0, 1, 2, 3]]), values)]
    layout: SparseLayout = [((1,), 4)]
    half = decode_sparse(encode_sparse(update, "fp16", layout=layout), layout, BIG)[0].values
    assert half.tolist()[0][:3] == [65504.0, -65504.0, 0.0]
    default = decode_sparse(encode_sparse(update, layout=layout), layout, BIG)[0].values
    torch.testing.assert_close(default, values, rtol=2.0**-8, atol=0)
    assert encode_sparse(update, layout=layout) == encode_sparse(update, "bf16", layout=layout)


@pytest.mark.parametrize(("value_dtype", "qmax"), [("int8", 127), ("int4", 7)])
def test_integer_codes_round_trip_within_half_a_step(value_dtype: str, qmax: int) -> None:
    data = encode_sparse(UPDATES, value_dtype)
    assert len(data) == encoded_size(LAYOUT, 32, value_dtype) < encoded_size(LAYOUT, 32)
    out = decode_sparse(data, LAYOUT, max_bytes=len(data))
    for got, sent in zip(out, UPDATES, strict=True):
        assert torch.equal(got.indices, sent.indices)
        flat = sent.values.reshape(-1, sent.values.shape[-1])
        per = max(1, -(-32 // flat.shape[1]))  # blocks sharing a scale
        for start in range(0, flat.shape[0], per):
            group = flat[start : start + per]
            err = (got.values.reshape(flat.shape)[start : start + per] - group).abs().max()
            assert float(err) <= float(group.abs().max()) / qmax / 2 * (1 + 1e-5)
    # What a receiver decodes is what quantize_values gives the sender (DeMo removes that).
    codes, scales = quantize_values(flat, 8 if value_dtype == "int8" else 4)
    assert int(codes.abs().max()) == qmax and scales.numel() == -(-flat.shape[0] // per)
    DEMO.apply([UPDATES, out])


def test_integer_codes_are_checked() -> None:
    layout: SparseLayout = [((1,), 4)]
    update = [SparseUpdate(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[1.0, -2.0, 0.5, 0.0]]))]
    int4 = encode_sparse(update, "int4", layout=layout)
    # header 10 | table 10 + 4 (dim) | indices 4 x 2 bits (1 B) at 24 | scale at 25 | codes at 29
    decoded = decode_sparse(int4, layout, 4096)[0].values
    torch.testing.assert_close(decoded, torch.tensor([[3.0, -7.0, 2.0, 0.0]]) * (2.0 / 7))
    cases = [
        (patch(int4, 25, "<f", -1.0), "negative scale"),
        (patch(int4, 25, "<f", math.inf), "scales contains NaN or infinity"),
        (patch(int4, 29, "<B", 0x08), r"outside \[-7, 7\]"),
    ]
    int8 = encode_sparse(update, "int8", layout=layout)
    cases.append((patch(int8, 29, "<B", 0x80), r"outside \[-127, 127\]"))
    odd = encode_sparse(
        [SparseUpdate(torch.tensor([[0, 1, 2]]), torch.tensor([[1.0, -2.0, 0.5]]))],
        "int4",
        layout=layout,
    )
    cases.append((patch(odd, 30, "<B", odd[30] | 0xF0), "stray bits after the last value"))
    for bad, message in cases:
        with pytest.raises(CompressionError, match=message):
            decode_sparse(bad, layout, 4096)


def test_encode_refuses_what_a_receiver_would_refuse() -> None:
    idx, val = torch.tensor([[0, 1]]), torch.tensor([[1.0, 2.0]])
    layout: SparseLayout = [((1,), 4)]
    cases: list[tuple[list[SparseUpdate], SparseLayout | None, str, str]] = [
        ([SparseUpdate(idx, val)], None, "bf16", "block size unknown"),
        ([SparseUpdate(idx, val, 4)], None, "fp32", "value_dtype"),
        ([SparseUpdate(idx, val, 4)], [((1,), 4), ((1,), 4)], "bf16", "layout of 2"),
        ([SparseUpdate(idx, val, 4)], [((2,), 4)], "bf16", "differs from layout"),
        ([SparseUpdate(idx, val, 8)], layout, "bf16", "block size 8"),
        ([SparseUpdate(idx.float(), val, 4)], None, "bf16", "integers"),
        ([SparseUpdate(idx, idx, 4)], None, "bf16", "values must be float"),
        ([SparseUpdate(idx, val[:, :1], 4)], None, "bf16", "share"),
        ([SparseUpdate(idx.reshape(-1), val.reshape(-1), 4)], None, "bf16", "share"),
        ([SparseUpdate(idx, val, 1)], None, "bf16", "k = 2"),
        ([SparseUpdate(idx + 3, val, 4)], None, "bf16", "outside"),
        ([SparseUpdate(idx * 0, val, 4)], None, "bf16", "repeated"),
        ([SparseUpdate(idx, val * math.nan, 4)], None, "bf16", "NaN"),
    ]
    for updates, lay, vd, message in cases:
        with pytest.raises(CompressionError, match=message):
            encode_sparse(updates, vd, layout=lay)


# -- decoder hardening ----------------------------------------------------------------------------


def patch(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    size = struct.calcsize(fmt)
    return data[:offset] + struct.pack(fmt, *values) + data[offset + size :]


# SMALL's table: header 10 | tensor 0 at 10 (ndim, bits, k, block, dim) | tensor 1 at 24
# (ndim, bits, k, block, dim, dim) | bodies at 42: t0 indices 4 x 3 bits (2 B), values 4 x 2 B;
# t1 at 52: indices 2 x 9 bits (3 B), values 2 x 2 B.
BODY = 42
T1 = 52


def set_index(data: bytes, at: int, bits: int, i: int, value: int) -> bytes:
    """The payload with index i of the bit-packed indices starting at byte `at` set."""
    window = data[at : at + 8]
    stream = int.from_bytes(window, "little")
    mask = ((1 << bits) - 1) << (i * bits)
    stream = (stream & ~mask) | (value << (i * bits))
    return data[:at] + stream.to_bytes(len(window), "little") + data[at + len(window) :]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: patch(d, 4, "<B", 3), "version 3 unsupported"),
        (lambda d: patch(d, 5, "<B", 9), "value dtype code 9"),
        (lambda d: patch(d, 6, "<I", 3), "3 tensors, expected 2"),
        (lambda d: patch(d, 6, "<I", 1 << 31), "tensors, expected 2"),
        (lambda d: d[:7], "truncated"),
        (lambda d: d[:15], "truncated"),
        (lambda d: d[:21], "truncated"),
        (lambda d: d[:-1], "table implies"),
        (lambda d: d + b"\x00", "table implies"),
        (lambda d: patch(d, 10, "<B", 2), "2 grid dims, expected 1"),
        (lambda d: patch(d, 11, "<B", 2), "2-bit indices for a block of 5"),
        (lambda d: patch(d, 12, "<I", 0), r"k = 0 outside \[1, 5\]"),
        (lambda d: patch(d, 12, "<I", 6), r"k = 6 outside \[1, 5\]"),
        (lambda d: patch(d, 12, "<I", 3), "table implies"),
        (lambda d: patch(d, 16, "<I", 6), "block 6, expected"),
        (lambda d: patch(d, 20, "<I", 1 << 30), "expected grid"),
        (lambda d: patch(d, 26, "<I", 300), "table implies 1927"),
        (lambda d: set_index(d, BODY, 3, 0, 5), "outside a 5-coefficient block"),
        (lambda d: set_index(d, BODY, 3, 1, 0), "repeated within one block"),
        (lambda d: set_index(d, BODY, 3, 3, 3), "repeated"),
        (lambda d: patch(d, BODY + 1, "<B", d[BODY + 1] | 0x80), "stray bits"),
        (lambda d: patch(d, BODY + 2, "<H", 0x7FC0), "NaN or infinity"),
        (lambda d: patch(d, BODY + 2, "<H", 0x7F80), "NaN or infinity"),
        (lambda d: set_index(d, T1, 9, 0, 300), "outside a 300-coefficient block"),
    ],
)
def test_malformed_payloads_are_refused_with_clear_messages(mutate, message) -> None:  # type: ignore[no-untyped-def]
    bad = mutate(SMALL)
    assert bad != SMALL
    with pytest.raises(CompressionError, match=message):
        decode_sparse(bad, SMALL_LAYOUT, max_bytes=4096)
    decode_sparse(SMALL, SMALL_LAYOUT, max_bytes=4096)  # the unmutated payload is fine


def test_declared_sizes_are_held_to_max_bytes_before_allocating() -> None:
    # k = 300 on the 300-coefficient blocks: valid for the layout, but declares more bytes.
    declared = patch(SMALL, 26, "<I", 300)
    with pytest.raises(CompressionError, match="declares 1927 bytes, over the limit of 1000"):
        decode_sparse(declared, SMALL_LAYOUT, max_bytes=1000)
    with pytest.raises(CompressionError, match="table implies 1927"):
        decode_sparse(declared, SMALL_LAYOUT, max_bytes=4096)
    # A layout with a huge grid: the table's claim is refused, nothing is allocated.
    huge: SparseLayout = [((1 << 31, 1 << 31), 1 << 16)]
    head = struct.pack("<4sBBI", MAGIC, VERSION, 2, 1) + struct.pack(
        "<BBII", 2, 16, 1 << 16, 1 << 16
    )
    with pytest.raises(CompressionError, match="over the limit"):
        decode_sparse(head + struct.pack("<II", 1 << 31, 1 << 31), huge, max_bytes=1 << 30)
    with pytest.raises(CompressionError, match="over the limit of 10"):
        decode_sparse(SMALL, SMALL_LAYOUT, max_bytes=10)


def test_wrong_layout_is_refused() -> None:
    layouts: list[tuple[SparseLayout, str]] = [
        ([((2,), 5)], "2 tensors, expected 1"),
        ([((3,), 5), ((1, 2), 300)], "expected grid"),
        ([((2,), 5), ((2, 1), 300)], "expected grid"),
        ([((2,), 5), ((1, 2), 301)], "expected grid"),
        ([((2,), 5), ((2,), 300)], "2 grid dims, expected 1"),
    ]
    for layout, message in layouts:
        with pytest.raises(CompressionError, match=message):
            decode_sparse(SMALL, layout, max_bytes=4096)
    with pytest.raises(CompressionError, match="tensors, expected"):
        decode_sparse(encode_sparse(UPDATES), SMALL_LAYOUT, max_bytes=BIG)


def test_buffer_kinds() -> None:
    for data in (SMALL, bytearray(SMALL), memoryview(SMALL), memoryview(bytearray(SMALL))):
        out = decode_sparse(data, SMALL_LAYOUT, max_bytes=4096)
        assert out[0].indices.tolist() == [[0, 4], [3, 1]]
    with pytest.raises(CompressionError, match="contiguous byte buffer"):
        decode_sparse(np.zeros(len(SMALL) // 2, dtype=np.int16).data, SMALL_LAYOUT, 4096)


def _check_decoded(out: list[SparseUpdate], layout: SparseLayout) -> None:
    assert len(out) == len(layout)
    for update, (grid, block) in zip(out, layout, strict=True):
        assert tuple(update.indices.shape[:-1]) == grid
        assert update.indices.shape == update.values.shape
        assert bool(((update.indices >= 0) & (update.indices < block)).all())
        assert bool(torch.isfinite(update.values).all())


PAYLOADS = [
    (SMALL, SMALL_LAYOUT),
    (encode_sparse(UPDATES[:2], "fp16"), LAYOUT[:2]),
    (encode_sparse(UPDATES[:2], "int4"), LAYOUT[:2]),
    (encode_sparse(small_updates(), "int8", layout=SMALL_LAYOUT), SMALL_LAYOUT),
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    for blob in (data, MAGIC + bytes([VERSION, 2]) + data, SMALL[:10] + data):
        with contextlib.suppress(CompressionError):
            _check_decoded(decode_sparse(blob, SMALL_LAYOUT, max_bytes=4096), SMALL_LAYOUT)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    which=st.integers(0, len(PAYLOADS) - 1),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 1 << 16),
)
def test_fuzz_mutated_valid_payloads(which: int, edits: list[tuple[int, int]], cut: int) -> None:
    payload, layout = PAYLOADS[which]
    blob = bytearray(payload)
    for pos, value in edits:
        blob[pos % len(blob)] = value
    blob = blob[: len(blob) - cut % 3 * (cut % len(blob))] if cut % 5 == 0 else blob
    try:
        out = decode_sparse(bytes(blob), layout, max_bytes=len(payload) + 64)
    except CompressionError:
        return
    _check_decoded(out, layout)
