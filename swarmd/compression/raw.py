"""Uncompressed tensors on the wire: the pass-through path and PowerSGD's P/Q factors.

Tensors that no codec should touch (1-D biases under PowerSGD, small buffers) still need
the same self-describing, size-checked framing as everything else.
"""

from __future__ import annotations

import torch

from swarmd.compression.buffers import byte_view, check_float_input, from_bytes, require_finite
from swarmd.compression.wire import (
    CodecId,
    DecodeLimits,
    Header,
    expect,
    expect_float,
    pack_header,
    parse_header,
    payload,
)

VERSION = 1


class RawCodec:
    """Identity codec: the tensor's own dtype, little-endian, after a header."""

    codec_id = CodecId.RAW

    def encode(self, tensor: torch.Tensor) -> bytes:
        return b"".join(self.encode_segments(tensor))

    def encode_segments(self, tensor: torch.Tensor) -> list[bytes | memoryview]:
        """Header, then a view of the tensor's own memory (no copy for a contiguous CPU
        tensor): it must stay unmodified until the bytes have been sent."""
        check_float_input(tensor)
        require_finite(tensor, "RAW input")
        return raw_segments(tensor)

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return decode_raw(parse_header(data, limits), data)


def raw_segments(tensor: torch.Tensor) -> list[bytes | memoryview]:
    """`RawCodec.encode_segments` without its pass over the values: for a float tensor whose
    values the caller already found finite (a pass over 100 MB is ~0.03 CPU-s, and an fp32
    all-reduce round made a dozen of them per peer)."""
    tensor = tensor.detach().cpu()
    header = pack_header(CodecId.RAW, VERSION, tensor.dtype, tuple(tensor.shape), b"")
    return [header, byte_view(tensor)]


def decode_raw(
    header: Header, data: bytes | bytearray | memoryview, *, finite: bool = True
) -> torch.Tensor:
    """``finite=False`` skips the check for NaN and infinity: for a caller whose next pass
    (a norm) refuses them anyway."""
    expect(header, CodecId.RAW, VERSION, 0)
    expect_float(header)
    itemsize = torch.empty(0, dtype=header.dtype).element_size()
    body = payload(data, header, header.numel * itemsize)
    out = from_bytes(body, header.dtype, header.numel).reshape(header.shape)
    if finite:
        require_finite(out, "RAW payload")
    return out
