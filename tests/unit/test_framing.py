"""Tensor framing: round trips and refusal of every malformed header or stream."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.protocol import swarmd_pb2 as pb
from swarmd.protocol.errors import FramingError
from swarmd.protocol.framing import (
    TAG_DATA,
    TAG_HEADER,
    BufferPool,
    StreamAssembler,
    TensorMeta,
    assemble,
    check_header,
    header_frame,
    iter_frames,
    pack,
    unpack,
)
from swarmd.protocol.tensors import tensor_from_bytes, tensor_meta, tensor_payload

LIMIT = 1 << 20


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 7),
        torch.randn(5, 4).t(),  # non-contiguous
        torch.arange(10, dtype=torch.int64),
        torch.randn(6, dtype=torch.bfloat16),
        torch.randn(2, 3, dtype=torch.float16),
        torch.tensor([True, False]),
        torch.zeros(0, 5),
        torch.tensor(3.5),  # 0-dim
    ],
)
@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_stream_round_trip(tensor: torch.Tensor, chunk: int) -> None:
    meta = tensor_meta(tensor, "t")
    got_meta, data = assemble(iter_frames(meta, tensor_payload(tensor), chunk), LIMIT)
    assert got_meta == meta
    assert torch.equal(tensor_from_bytes(got_meta, data), tensor)
    blob_meta, payload = unpack(pack(meta, tensor_payload(tensor)), LIMIT)
    assert blob_meta == meta
    assert torch.equal(tensor_from_bytes(blob_meta, bytearray(payload)), tensor)


def _header(
    dtype: str = "float32", shape: list[int] | None = None, nbytes: int = 40
) -> pb.TensorHeader:
    return pb.TensorHeader(dtype=dtype, shape=[10] if shape is None else shape, nbytes=nbytes)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (_header(dtype="float128"), "unknown dtype"),
        (_header(shape=[-1, 4], nbytes=0), "negative dimension"),
        (_header(nbytes=41), "need 40"),
        (_header(shape=[1 << 40, 1 << 40], nbytes=(1 << 64) - 1), "need"),
        (_header(shape=[1 << 20, 1 << 20], nbytes=1 << 42), "exceeds the limit"),
        (_header(shape=[1] * 17, nbytes=4), "dims"),
    ],
)
def test_bad_headers_refused(header: pb.TensorHeader, message: str) -> None:
    with pytest.raises(FramingError, match=message):
        check_header(header, LIMIT)


def test_stream_errors() -> None:
    meta = TensorMeta("float32", (4,))
    head = header_frame(meta)
    data = bytes([TAG_DATA])
    with pytest.raises(FramingError, match="truncated"):
        assemble([head, data + bytes(15)], LIMIT)
    with pytest.raises(FramingError, match="more than the declared"):
        assemble([head, data + bytes(17)], LIMIT)
    with pytest.raises(FramingError, match="before the header"):
        assemble([data + bytes(16)], LIMIT)
    with pytest.raises(FramingError, match="second header"):
        assemble([head, head], LIMIT)
    with pytest.raises(FramingError, match="ended before its header"):
        assemble([], LIMIT)
    with pytest.raises(FramingError, match="unknown frame tag"):
        assemble([b"\x07abc"], LIMIT)
    with pytest.raises(FramingError, match="empty frame"):
        assemble([b""], LIMIT)
    with pytest.raises(FramingError, match="not a valid TensorHeader"):
        assemble([bytes([TAG_HEADER]) + b"\xff\xff\xff"], LIMIT)
    with pytest.raises(FramingError, match="payload has"):
        list(iter_frames(meta, memoryview(bytes(3))))


def test_header_checked_before_allocation() -> None:
    asm = StreamAssembler(max_bytes=1000)
    with pytest.raises(FramingError, match="exceeds the limit"):
        asm.feed(header_frame(TensorMeta("float64", (1 << 40,))))
    assert asm.meta is None  # nothing was allocated for it


def test_pack_errors() -> None:
    meta = TensorMeta("int8", (3,))
    blob = pack(meta, bytes(3))
    with pytest.raises(FramingError, match="shorter than its length prefix"):
        unpack(blob[:2], LIMIT)
    with pytest.raises(FramingError, match="does not fit"):
        unpack(b"\xff\xff\x00\x00" + blob[4:], LIMIT)
    with pytest.raises(FramingError, match="payload"):
        unpack(blob[:-1], LIMIT)
    with pytest.raises(FramingError, match="payload"):
        unpack(blob + b"\x00", LIMIT)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_unpack_random_bytes_only_clear_errors(blob: bytes) -> None:
    try:
        meta, payload = unpack(blob, LIMIT)
    except FramingError:
        return
    assert payload.nbytes == meta.nbytes <= LIMIT


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_assemble_random_frames_only_clear_errors(frames: list[bytes]) -> None:
    try:
        meta, data = assemble(frames, LIMIT)
    except FramingError:
        return
    assert len(data) == meta.nbytes <= LIMIT


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["float32", "int8", "bfloat16", "int64"]),
    st.lists(st.integers(min_value=0, max_value=6), max_size=4),
    st.integers(min_value=1, max_value=64),
)
def test_any_valid_tensor_survives_framing(dtype: str, shape: list[int], chunk: int) -> None:
    tdtype = getattr(torch, dtype)
    tensor = (torch.randn(shape) * 50).to(tdtype)
    meta = tensor_meta(tensor)
    got_meta, data = assemble(iter_frames(meta, tensor_payload(tensor), chunk), LIMIT)
    assert torch.equal(tensor_from_bytes(got_meta, data), tensor)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=5),
    chunk=st.integers(min_value=1, max_value=50),
)
def test_payload_in_pieces_frames_like_the_joined_bytes(sizes: list[int], chunk: int) -> None:
    """A payload given as several pieces (codec header + tensor views) travels as the same
    bytes, in frames of at most `chunk` bytes, some of which span two pieces."""
    pieces = [bytes((i * 31 + k) % 256 for k in range(n)) for i, n in enumerate(sizes)]
    joined = b"".join(pieces)
    meta = TensorMeta("uint8", (len(joined),))
    views: list[bytes | memoryview] = [memoryview(p) if i % 2 else p for i, p in enumerate(pieces)]
    frames = list(iter_frames(meta, views, chunk))
    assert frames == list(iter_frames(meta, memoryview(joined), chunk))
    assert all(len(f) - 1 <= chunk for f in frames[1:])
    assert len(frames) - 1 == -(-len(joined) // chunk)
    _, data = assemble(frames, LIMIT)
    assert bytes(data) == joined


def test_payload_pieces_must_add_up_to_the_header() -> None:
    meta = TensorMeta("float32", (4,))
    with pytest.raises(FramingError, match="15 B"):
        list(iter_frames(meta, [bytes(7), memoryview(bytes(8))]))
    tensor = torch.arange(4, dtype=torch.float32)
    frames = iter_frames(meta, [memoryview(b""), tensor_payload(tensor)], 3)
    _, data = assemble(frames, LIMIT)
    assert torch.equal(tensor_from_bytes(meta, data), tensor)


def test_buffer_pool_recycles_exact_sizes_and_refuses_buffers_still_in_use() -> None:
    pool = BufferPool(max_idle_bytes=3 << 20, min_bytes=1 << 20)
    a = pool.take(1 << 20)
    assert len(a) == 1 << 20
    pool.give(a)
    pool.give(a)  # twice: still one idle copy
    assert pool.idle_bytes == 1 << 20
    assert pool.take((1 << 20) + 1) is not a  # only exact sizes are reused
    assert pool.take(1 << 20) is a and pool.idle_bytes == 0
    view = memoryview(a)
    pool.give(a)  # someone still reads it through a view: not recycled
    assert pool.idle_bytes == 0
    view.release()
    pool.give(a)
    assert pool.idle_bytes == 1 << 20 and len(a) == 1 << 20
    for _ in range(4):  # beyond max_idle_bytes, buffers are left to the garbage collector
        pool.give(bytearray(1 << 20))
    assert pool.idle_bytes == 3 << 20
    small = pool.take(10)
    pool.give(small)  # too small to be worth keeping
    assert pool.idle_bytes == 3 << 20


def test_assembler_overwrites_a_recycled_buffer_completely() -> None:
    pool = BufferPool(min_bytes=1)
    stale = bytearray(b"\xff" * 40)
    pool.give(stale)
    tensor = torch.arange(10, dtype=torch.float32)
    meta = tensor_meta(tensor)
    asm = StreamAssembler(LIMIT, pool)
    for frame in iter_frames(meta, tensor_payload(tensor), 7):
        asm.feed(frame)
    _, data = asm.finish()
    assert data is stale and torch.equal(tensor_from_bytes(meta, data), tensor)
    # A truncated stream into a recycled buffer is refused, never padded with stale bytes.
    pool.give(bytearray(b"\xff" * 40))
    asm = StreamAssembler(LIMIT, pool)
    frames = list(iter_frames(meta, tensor_payload(tensor), 7))
    for frame in frames[:-1]:
        asm.feed(frame)
    with pytest.raises(FramingError, match="truncated"):
        asm.finish()
