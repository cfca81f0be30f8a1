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
