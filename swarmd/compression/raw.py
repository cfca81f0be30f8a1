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
        tensor = tensor.detach().cpu()
        require_finite(tensor, "RAW input")
        header = pack_header(CodecId.RAW, VERSION, tensor.dtype, tuple(tensor.shape), b"")
        return [header, byte_view(tensor)]

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return decode_raw(parse_header(data, limits), data)


def decode_raw(header: Header, data: bytes | bytearray | memoryview) -> torch.Tensor:
    expect(header, CodecId.RAW, VERSION, 0)
    expect_float(header)
    itemsize = torch.empty(0, dtype=header.dtype).element_size()
    body = payload(data, header, header.numel * itemsize)
    out = from_bytes(body, header.dtype, header.numel).reshape(header.shape)
    require_finite(out, "RAW payload")
    return out
