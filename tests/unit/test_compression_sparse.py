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
    SparseLayout,
    SparseUpdate,
    decode_sparse,
    encode_sparse,
    encoded_size,
    index_width,
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


def test_index_width_is_the_smallest_unsigned_type() -> None:
    assert [index_width(b) for b in (1, 2, 256, 257, 4096, 65536, 65537, 1 << 32)] == [
        1, 1, 1, 2, 2, 2, 4, 4,
    ]  # fmt: skip
    with pytest.raises(CompressionError, match="wider than 32 bits"):
        index_width((1 << 32) + 1)
    # On the wire: a 5-coefficient block uses 1 byte per index, a 300-coefficient one 2.
    assert SMALL[10 + 1] == 1 and SMALL[10 + 10 + 4 + 1] == 2
    assert len(SMALL) == encoded_size(SMALL_LAYOUT, [2, 1])
    out = decode_sparse(SMALL, SMALL_LAYOUT, max_bytes=len(SMALL))
    assert out[1].indices.reshape(-1).tolist() == [299, 7]


def test_much_smaller_than_dense_fp32() -> None:
    layout: SparseLayout = [((2, 3), 4096)]  # a 128 x 192 matrix in 64 x 64 blocks
    dense = 128 * 192 * 4
    sparse = encoded_size(layout, 32)
    assert sparse == 10 + 10 + 8 + 6 * 32 * (2 + 2)
    assert dense / sparse > 100
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


# SMALL's table: header 10 | tensor 0 at 10 (ndim, width, k, block, dim) | tensor 1 at 24
# (ndim, width, k, block, dim, dim) | bodies at 42: t0 idx 4 x u8, vals 4 x 2, t1 idx 2 x u16, ...
BODY = 42


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: patch(d, 4, "<B", 2), "version 2 unsupported"),
        (lambda d: patch(d, 5, "<B", 9), "value dtype code 9"),
        (lambda d: patch(d, 6, "<I", 3), "3 tensors, expected 2"),
        (lambda d: patch(d, 6, "<I", 1 << 31), "tensors, expected 2"),
        (lambda d: d[:7], "truncated"),
        (lambda d: d[:15], "truncated"),
        (lambda d: d[:21], "truncated"),
        (lambda d: d[:-1], "table implies"),
        (lambda d: d + b"\x00", "table implies"),
        (lambda d: patch(d, 10, "<B", 2), "2 grid dims, expected 1"),
        (lambda d: patch(d, 11, "<B", 2), "index width 2"),
        (lambda d: patch(d, 12, "<I", 0), r"k = 0 outside \[1, 5\]"),
        (lambda d: patch(d, 12, "<I", 6), r"k = 6 outside \[1, 5\]"),
        (lambda d: patch(d, 12, "<I", 3), "table implies"),
        (lambda d: patch(d, 16, "<I", 6), "block 6, expected"),
        (lambda d: patch(d, 20, "<I", 1 << 30), "expected grid"),
        (lambda d: patch(d, 26, "<I", 300), "table implies 2454"),
        (lambda d: patch(d, BODY, "<B", 5), "outside a 5-coefficient block"),
        (lambda d: patch(d, BODY + 1, "<B", 0), "repeated within one block"),
        (lambda d: patch(d, BODY + 4, "<H", 0x7FC0), "NaN or infinity"),
        (lambda d: patch(d, BODY + 4, "<H", 0x7F80), "NaN or infinity"),
        (lambda d: patch(d, BODY + 12, "<H", 300), "outside a 300-coefficient block"),
        (lambda d: patch(d, BODY + 3, "<B", 3), "repeated"),
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
    with pytest.raises(CompressionError, match="declares 2454 bytes, over the limit of 1000"):
        decode_sparse(declared, SMALL_LAYOUT, max_bytes=1000)
    with pytest.raises(CompressionError, match="table implies 2454"):
        decode_sparse(declared, SMALL_LAYOUT, max_bytes=4096)
    # A layout with a huge grid: the table's claim is refused, nothing is allocated.
    huge: SparseLayout = [((1 << 31, 1 << 31), 1 << 16)]
    head = struct.pack("<4sBBI", MAGIC, 1, 2, 1) + struct.pack("<BBII", 2, 2, 1 << 16, 1 << 16)
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


PAYLOADS = [(SMALL, SMALL_LAYOUT), (encode_sparse(UPDATES[:2], "fp16"), LAYOUT[:2])]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    for blob in (data, MAGIC + b"\x01\x02" + data, SMALL[:10] + data):
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
