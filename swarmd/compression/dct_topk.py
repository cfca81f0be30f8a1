"""DCT top-k (DeMo): per chunk, send only the k largest DCT coefficients.

Indices travel in the narrowest integer type that can address a chunk (uint8 up to 256
coefficients, int16 beyond), values in fp16/bf16/fp32 or as 1-bit signs with one fp32
magnitude per chunk (the mean |value| of its top-k, so sign mode is not off by orders of
magnitude). Because the DCT is linear, peers' sparse components are averaged in the
coefficient domain and inverse-transformed once (`average_components`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmd.compression.buffers import (
    byte_view,
    check_float_input,
    flat_float32,
    from_bytes,
    require_finite,
)
from swarmd.compression.dct import (
    DEFAULT_MAX_CHUNK,
    as_matrix,
    chunk_sizes,
    dct_blocks,
    from_blocks,
    idct_blocks,
    to_blocks,
)
from swarmd.compression.errors import CompressionError
from swarmd.compression.halfcast import clamp_cast
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
MAX_CHUNK_SIDE = 128  # chunk numel <= 16384 keeps indices within int16
_PARAMS = struct.Struct("<BHHH")  # value mode, chunk rows, chunk cols, k
_VALUE_MODES = {"float32": 0, "float16": 1, "bfloat16": 2, "sign": 3}
_MODE_NAMES = {code: name for name, code in _VALUE_MODES.items()}
_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DctTopKConfig:
    """`topk` coefficients kept per chunk (clipped to the chunk size); chunks are at most
    `max_chunk` per axis; `values` is "float16", "bfloat16", "float32" or "sign"."""

    topk: int = 32
    max_chunk: int = DEFAULT_MAX_CHUNK
    values: str = "float16"

    def __post_init__(self) -> None:
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"DctTopKConfig.topk must be an int >= 1, got {self.topk!r}")
        mc = self.max_chunk
        if isinstance(mc, bool) or not isinstance(mc, int) or not 1 <= mc <= MAX_CHUNK_SIDE:
            raise ValueError(
                f"DctTopKConfig.max_chunk must be an int in [1, {MAX_CHUNK_SIDE}], got {mc!r}"
            )
        if self.values not in _VALUE_MODES:
            raise ValueError(
                f"DctTopKConfig.values must be one of {sorted(_VALUE_MODES)}, got {self.values!r}"
            )


@dataclass(frozen=True)
class DctComponents:
    """One peer's sparse DCT coefficients: `indices`/`values` are (chunks, k)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk: tuple[int, int]
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def num_chunks(self) -> int:
        n, m = as_matrix(self.shape)
        return (n // self.chunk[0]) * (m // self.chunk[1])


def index_dtype(chunk_numel: int) -> torch.dtype:
    """Narrowest integer type addressing every coefficient of a chunk."""
    return torch.uint8 if chunk_numel <= 256 else torch.int16


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool (N,) -> uint8 (ceil(N/8),), little-endian bit order within a byte."""
    flat = bits.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count].bool()


class DctTopKCodec:
    codec_id = CodecId.DCT_TOPK

    def __init__(self, config: DctTopKConfig | None = None) -> None:
        self.config = config or DctTopKConfig()

    def compress(self, tensor: torch.Tensor) -> DctComponents:
        """Top-k components, with values already rounded to their wire precision, so that
        `to_dense(compress(x))` is exactly what receivers of `encode(x)` reconstruct."""
        check_float_input(tensor)
        shape = tuple(tensor.shape)
        flat = flat_float32(tensor)
        require_finite(flat, "DCT_TOPK input")
        n, m = as_matrix(shape)
        cn, cm = chunk_sizes(shape, self.config.max_chunk)
        k = min(self.config.topk, cn * cm)
        if flat.numel() == 0:
            empty = torch.empty(0, k)
            return DctComponents(shape, tensor.dtype, (cn, cm), empty.long(), empty)
        coeffs = dct_blocks(to_blocks(flat.view(n, m), cn, cm)).reshape(-1, cn * cm)
        indices = coeffs.abs().topk(k, dim=1, sorted=False).indices
        values = coeffs.gather(1, indices)
        mode = self.config.values
        if mode == "sign":
            scale = values.abs().mean(dim=1, keepdim=True)
            values = torch.where(values < 0, -scale, scale)
        elif mode != "float32":
            values = clamp_cast(values, _VALUE_DTYPES[mode]).to(torch.float32)
        return DctComponents(shape, tensor.dtype, (cn, cm), indices, values)

    def encode(self, tensor: torch.Tensor) -> bytes:
        return components_to_bytes(self.compress(tensor), self.config.values)

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return to_dense(decode_components(data, limits))


def components_to_bytes(comp: DctComponents, values: str = "float16") -> bytes:
    if values not in _VALUE_MODES:
        raise ValueError(f"values must be one of {sorted(_VALUE_MODES)}, got {values!r}")
    cn, cm = comp.chunk
    k = comp.indices.shape[1] if comp.indices.dim() == 2 else 0
    params = _PARAMS.pack(_VALUE_MODES[values], cn, cm, k)
    header = pack_header(CodecId.DCT_TOPK, VERSION, comp.dtype, comp.shape, params)
    parts: list[bytes | memoryview] = [header, byte_view(comp.indices.to(index_dtype(cn * cm)))]
    if values == "sign":
        parts.append(byte_view(comp.values.abs().mean(dim=1).to(torch.float32)))
        parts.append(byte_view(pack_bits(comp.values < 0)))
    else:
        parts.append(byte_view(clamp_cast(comp.values, _VALUE_DTYPES[values])))
    return b"".join(parts)


def decode_components(data: bytes | bytearray | memoryview, limits: DecodeLimits) -> DctComponents:
    return _decode_components(parse_header(data, limits), data)


def _decode_components(header: Header, data: bytes | bytearray | memoryview) -> DctComponents:
    expect(header, CodecId.DCT_TOPK, VERSION, _PARAMS.size)
    expect_float(header)
    mode_code, cn, cm, k = _PARAMS.unpack(header.params)
    mode = _MODE_NAMES.get(mode_code)
    if mode is None:
        raise CompressionError(f"DCT_TOPK unknown value mode {mode_code}")
    n, m = as_matrix(header.shape)
    if not (1 <= cn <= MAX_CHUNK_SIDE and 1 <= cm <= MAX_CHUNK_SIDE):
        raise CompressionError(f"DCT_TOPK chunk {cn} x {cm} outside [1, {MAX_CHUNK_SIDE}]")
    if n % cn or m % cm:
        raise CompressionError(f"DCT_TOPK chunk {cn} x {cm} does not tile a {n} x {m} matrix")
    if not 1 <= k <= cn * cm:
        raise CompressionError(f"DCT_TOPK k = {k} invalid for {cn * cm}-coefficient chunks")
    chunks = (n // cn) * (m // cm)
    count = chunks * k
    idt = index_dtype(cn * cm)
    isz = 1 if idt == torch.uint8 else 2
    if mode == "sign":
        vsize = 4 * chunks + (count + 7) // 8
    else:
        vsize = count * (4 if mode == "float32" else 2)
    body = payload(data, header, count * isz + vsize)
    indices = from_bytes(body[: count * isz], idt, count).long().view(chunks, k)
    if count and not bool(((indices >= 0) & (indices < cn * cm)).all()):
        raise CompressionError(f"DCT_TOPK index outside a {cn * cm}-coefficient chunk")
    rest = body[count * isz :]
    if mode == "sign":
        scales = from_bytes(rest[: 4 * chunks], torch.float32, chunks)
        if chunks and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise CompressionError("DCT_TOPK sign scale is negative, NaN or infinite")
        packed = from_bytes(rest[4 * chunks :], torch.uint8, (count + 7) // 8)
        neg = unpack_bits(packed, count).view(chunks, k)
        scale = scales.unsqueeze(1).expand(chunks, k)
        values = torch.where(neg, -scale, scale)
    else:
        values = from_bytes(rest, _VALUE_DTYPES[mode], count).to(torch.float32).view(chunks, k)
        require_finite(values, "DCT_TOPK values")
    return DctComponents(header.shape, header.dtype, (cn, cm), indices, values)


def _check_components(comp: DctComponents) -> None:
    chunks, k = comp.num_chunks, comp.indices.shape[-1]
    if tuple(comp.indices.shape) != (chunks, k) or tuple(comp.values.shape) != (chunks, k):
        raise CompressionError(
            f"components for {comp.shape} need ({chunks}, k) indices and values, got "
            f"{tuple(comp.indices.shape)} and {tuple(comp.values.shape)}"
        )


def average_components(components: Sequence[DctComponents]) -> torch.Tensor:
    """Mean of several peers' sparse components, as a dense tensor (one inverse DCT).

    Peers may use different k, but must agree on shape and chunking.
    """
    if not components:
        raise CompressionError("average_components needs at least one peer's components")
    first = components[0]
    for comp in components:
        if comp.shape != first.shape or comp.chunk != first.chunk:
            raise CompressionError(
                f"cannot average components of {comp.shape} chunk {comp.chunk} with "
                f"{first.shape} chunk {first.chunk}"
            )
        _check_components(comp)
    n, m = as_matrix(first.shape)
    cn, cm = first.chunk
    coeffs = torch.zeros(first.num_chunks, cn * cm, dtype=torch.float32)
    for comp in components:
        coeffs.scatter_add_(1, comp.indices.long(), comp.values.to(torch.float32))
    coeffs /= len(components)
    if coeffs.numel() == 0:
        return torch.zeros(first.shape, dtype=first.dtype)
    dense = from_blocks(idct_blocks(coeffs.view(-1, cn, cm)), n, m)
    return dense.reshape(first.shape).to(first.dtype)


def to_dense(comp: DctComponents) -> torch.Tensor:
    """Scatter + inverse DCT: what one peer's components stand for."""
    return average_components([comp])
