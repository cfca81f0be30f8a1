"""fp16 / bf16 casts: halve the bytes at the cost of mantissa (fp16) or range-safe precision (bf16).

Plain `.to(float16)` turns anything above 65504 into inf, which would poison every peer's
average; values are clamped to the target's finite range first, so a large-but-finite
input stays finite (and is counted in the error, where error feedback can carry it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from swarmd.compression.buffers import byte_view, check_float_input, from_bytes, require_finite
from swarmd.compression.errors import CompressionError
from swarmd.compression.wire import (
    CodecId,
    DecodeLimits,
    Header,
    dtype_code,
    expect,
    expect_float,
    pack_header,
    parse_header,
    payload,
)

VERSION = 1
_PARAMS = struct.Struct("<B")
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HalfConfig:
    """`dtype` is "float16" or "bfloat16" (names, so configs serialise to TOML/JSON)."""

    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _HALF_DTYPES:
            raise ValueError(
                f"HalfConfig.dtype must be one of {sorted(_HALF_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _HALF_DTYPES[self.dtype]


def clamp_cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to `dtype`, saturating at its largest finite value instead of overflowing."""
    fmax = torch.finfo(dtype).max
    if tensor.dtype == dtype:
        return tensor
    if torch.finfo(tensor.dtype).max > fmax:
        tensor = tensor.clamp(-fmax, fmax)
    return tensor.to(dtype)


class HalfCodec:
    codec_id = CodecId.HALF

    def __init__(self, config: HalfConfig | None = None) -> None:
        self.config = config or HalfConfig()

    def encode(self, tensor: torch.Tensor) -> bytes:
        return b"".join(self.encode_segments(tensor))

    def encode_segments(self, tensor: torch.Tensor) -> list[bytes | memoryview]:
        """Header, then the half-precision values (a view, no copy to join them)."""
        check_float_input(tensor)
        tensor = tensor.detach().cpu()
        require_finite(tensor, "HALF input")
        target = self.config.torch_dtype
        half = clamp_cast(tensor, target)
        params = _PARAMS.pack(dtype_code(target))
        header = pack_header(CodecId.HALF, VERSION, tensor.dtype, tuple(tensor.shape), params)
        return [header, byte_view(half)]

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return decode_half(parse_header(data, limits), data)


def decode_half(header: Header, data: bytes | bytearray | memoryview) -> torch.Tensor:
    expect(header, CodecId.HALF, VERSION, _PARAMS.size)
    expect_float(header)
    (code,) = _PARAMS.unpack(header.params)
    wire = {dtype_code(d): d for d in _HALF_DTYPES.values()}.get(code)
    if wire is None:
        raise CompressionError(f"HALF payload declares unsupported wire dtype code {code}")
    body = payload(data, header, header.numel * 2)
    half = from_bytes(body, wire, header.numel)
    require_finite(half, "HALF payload")
    return half.to(header.dtype).reshape(header.shape)
