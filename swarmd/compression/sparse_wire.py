"""Wire format of the DeMo exchange: per tensor, the top-k DCT coefficients of every block.

One payload carries a whole model's `SparseUpdate` list (what `swarmd.optim.demo.DeMo.prepare`
returns). Unlike the per-tensor codecs (`wire`), a receiver always knows exactly what it
expects, the layout of its own model (`DeMo.layout()`: per tensor the block grid and the block
size), so `decode_sparse` checks the payload's table against that layout and its size against
`max_bytes` and the actual length *before* allocating anything, then refuses out-of-range
indices, an index repeated within one block, and non-finite values. Every failure is a
`CompressionError`.

Layout (little-endian)::

    magic b"SWSU" | version u8 | value dtype u8 (1 fp16, 2 bf16) | tensor count u32
    | per tensor: grid ndim u8 | index width u8 | k u32 | block size u32 | grid: ndim x u32
    | per tensor, in order: indices (blocks*k x index width, unsigned) | values (blocks*k x 2)

Indices are per-block coefficient numbers in [0, block size), in the narrowest unsigned type
that holds block size - 1 (uint8 up to 256 coefficients, uint16 up to 65536, else uint32): with
the default 64 x 64 blocks, 2 bytes. Values are bf16 by default: DeMo's values are DCT
coefficients of the momentum δ ≈ lr·g/(1-β), which span many decades across models and
learning rates. fp16 saturates at 65504 (a 64 x 64 block's DC coefficient is 64 times its mean,
and gradients spike) and, worse, loses precision below 6e-5 and flushes to zero below 6e-8
(lr 1e-4 and small gradients get there); bf16 has float32's range, and its 8-bit mantissa is
plenty because only the sign of the peers' average is used. fp16 remains an option (values
clamped to ±65504, never inf) for peers that know their scale.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarmd.compression.buffers import require_finite
from swarmd.compression.errors import CompressionError
from swarmd.compression.halfcast import clamp_cast

__all__ = [
    "MAGIC",
    "VERSION",
    "SparseLayout",
    "SparseUpdate",
    "decode_sparse",
    "encode_sparse",
    "encoded_size",
    "index_width",
]

MAGIC = b"SWSU"
VERSION = 1
MAX_GRID_NDIM = 8
_HEADER = struct.Struct("<4sBBI")
_TENSOR = struct.Struct("<BBII")
_DIM = struct.Struct("<I")
_VALUE_CODES = {"fp16": 1, "bf16": 2}
_CODE_DTYPES = {1: torch.float16, 2: torch.bfloat16}
_WIDTH_NP: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
_VALUE_BYTES = 2

#: Per tensor: the grid of blocks (all but the last dim of its SparseUpdate) and the block size.
SparseLayout = list[tuple[tuple[int, ...], int]]


@dataclass(frozen=True, eq=False)
class SparseUpdate:
    """One tensor's top-k in the DCT domain: indices (int64) and values (float32; float64 for
    float64 parameters), shape (*blocks, k). `block_size` (coefficients per block) is set by
    `DeMo.prepare` and `decode_sparse`; `encode_sparse` needs it (or a `layout`) because the
    index width and the receiver's range check depend on it."""

    indices: torch.Tensor
    values: torch.Tensor
    block_size: int | None = None


def index_width(block_size: int) -> int:
    """Bytes per index: the smallest unsigned type holding block_size - 1."""
    if block_size <= 1 << 8:
        return 1
    if block_size <= 1 << 16:
        return 2
    if block_size <= 1 << 32:
        return 4
    raise CompressionError(f"block size {block_size} needs indices wider than 32 bits")


def encoded_size(layout: SparseLayout, topk: int | Sequence[int]) -> int:
    """Exact payload bytes for `layout` with `topk` coefficients per block (clamped to each
    block size, as DeMo does), e.g. a receiver's `max_bytes` (pass the block sizes themselves
    for the largest payload any k could make)."""
    ks = [topk] * len(layout) if isinstance(topk, int) else list(topk)
    if len(ks) != len(layout):
        raise ValueError(f"{len(ks)} k values for a layout of {len(layout)} tensors")
    size = _HEADER.size
    for (grid, block), k in zip(layout, ks, strict=True):
        k = min(max(k, 1), block)
        size += _TENSOR.size + _DIM.size * len(grid)
        size += math.prod(grid) * k * (index_width(block) + _VALUE_BYTES)
    return size


def _check_indices(idx: torch.Tensor, block: int, where: str) -> None:
    """idx is (blocks, k) int64: every index in [0, block) and none twice in one block (a
    duplicate would count one peer twice in the average)."""
    if not idx.numel():
        return
    if int(idx.min()) < 0 or int(idx.max()) >= block:
        raise CompressionError(f"{where}: index outside a {block}-coefficient block")
    if idx.shape[1] > 1:
        ordered = idx.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise CompressionError(f"{where}: an index is repeated within one block")


def _block_of(update: SparseUpdate, layout: SparseLayout | None, i: int) -> int:
    if layout is not None:
        grid, block = layout[i]
        if tuple(update.indices.shape[:-1]) != tuple(grid):
            raise CompressionError(
                f"tensor {i}: grid {tuple(update.indices.shape[:-1])} differs from layout {grid}"
            )
        if update.block_size is not None and update.block_size != block:
            raise CompressionError(f"tensor {i}: block size {update.block_size} != layout {block}")
        return block
    if update.block_size is None:
        raise CompressionError(f"tensor {i}: block size unknown; pass layout= to encode_sparse")
    return update.block_size


def _encode_one(update: SparseUpdate, block: int, dtype: torch.dtype, i: int) -> list[bytes]:
    """[descriptor, indices, values] of one tensor, after checking what a receiver checks."""
    idx, val = update.indices, update.values
    where = f"tensor {i}"
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise CompressionError(f"{where}: indices must be integers, got {idx.dtype}")
    if not val.is_floating_point():
        raise CompressionError(f"{where}: values must be float, got {val.dtype}")
    if idx.shape != val.shape or not 2 <= idx.dim() <= MAX_GRID_NDIM + 1:
        raise CompressionError(
            f"{where}: indices {tuple(idx.shape)} and values {tuple(val.shape)} must share a "
            f"(*grid, k) shape with 1 to {MAX_GRID_NDIM} grid dims"
        )
    grid, k = tuple(idx.shape[:-1]), idx.shape[-1]
    if not 1 <= k <= block or any(d >= 1 << 32 for d in grid) or block >= 1 << 32:
        raise CompressionError(f"{where}: k = {k}, grid {grid}, block {block} not encodable")
    width = index_width(block)
    flat_idx = idx.detach().to(device="cpu", dtype=torch.int64).reshape(-1, k)
    _check_indices(flat_idx, block, where)
    flat_val = val.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    require_finite(flat_val, f"{where} values")
    head = _TENSOR.pack(len(grid), width, k, block) + b"".join(_DIM.pack(d) for d in grid)
    idx_bytes = flat_idx.numpy().astype(_WIDTH_NP[width]).tobytes()
    val_bytes = clamp_cast(flat_val, dtype).view(torch.int16).numpy().astype("<i2").tobytes()
    return [head, idx_bytes, val_bytes]


def encode_sparse(
    updates: Sequence[SparseUpdate],
    value_dtype: str = "bf16",
    *,
    layout: SparseLayout | None = None,
) -> bytes:
    """One payload for a whole model's updates. `value_dtype` is "bf16" (default, see the
    module docstring) or "fp16" (clamped to ±65504). Block sizes come from the updates
    (`DeMo.prepare` sets them) or from `layout`, which is then also checked against."""
    if value_dtype not in _VALUE_CODES:
        raise CompressionError(
            f"value_dtype must be one of {sorted(_VALUE_CODES)}, got {value_dtype!r}"
        )
    if layout is not None and len(layout) != len(updates):
        raise CompressionError(f"{len(updates)} updates for a layout of {len(layout)} tensors")
    code = _VALUE_CODES[value_dtype]
    heads: list[bytes] = []
    bodies: list[bytes] = []
    for i, update in enumerate(updates):
        head, idx_bytes, val_bytes = _encode_one(
            update, _block_of(update, layout, i), _CODE_DTYPES[code], i
        )
        heads.append(head)
        bodies += [idx_bytes, val_bytes]
    return b"".join([_HEADER.pack(MAGIC, VERSION, code, len(updates)), *heads, *bodies])


@dataclass(frozen=True)
class _Entry:
    grid: tuple[int, ...]
    block: int
    width: int
    k: int

    @property
    def count(self) -> int:
        return math.prod(self.grid) * self.k


def _read_table(view: memoryview, layout: SparseLayout) -> tuple[torch.dtype, list[_Entry], int]:
    """Header and per-tensor table, each field checked against `layout`; returns the value
    dtype, the entries and where the bodies start."""
    if len(view) < _HEADER.size:
        raise CompressionError(f"truncated sparse payload: {len(view)} bytes, need {_HEADER.size}")
    magic, version, code, count = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CompressionError(f"bad magic {bytes(magic)!r}: not a sparse (DeMo) payload")
    if version != VERSION:
        raise CompressionError(f"sparse payload version {version} unsupported (this is {VERSION})")
    if code not in _CODE_DTYPES:
        raise CompressionError(f"sparse payload: unknown value dtype code {code}")
    if count != len(layout):
        raise CompressionError(f"sparse payload has {count} tensors, expected {len(layout)}")
    offset, entries = _HEADER.size, []
    for i, (grid, block) in enumerate(layout):
        if len(view) < offset + _TENSOR.size:
            raise CompressionError(f"truncated sparse payload in the entry of tensor {i}")
        ndim, width, k, declared = _TENSOR.unpack_from(view, offset)
        offset += _TENSOR.size
        if ndim != len(grid):
            raise CompressionError(f"tensor {i}: {ndim} grid dims, expected {len(grid)}")
        if len(view) < offset + _DIM.size * ndim:
            raise CompressionError(f"truncated sparse payload in the grid of tensor {i}")
        dims = tuple(_DIM.unpack_from(view, offset + _DIM.size * d)[0] for d in range(ndim))
        offset += _DIM.size * ndim
        if dims != tuple(grid) or declared != block:
            raise CompressionError(
                f"tensor {i}: grid {dims} block {declared}, expected grid {tuple(grid)} "
                f"block {block}"
            )
        if width != index_width(block):
            raise CompressionError(f"tensor {i}: index width {width} for a block of {block}")
        if not 1 <= k <= block:
            raise CompressionError(f"tensor {i}: k = {k} outside [1, {block}]")
        entries.append(_Entry(tuple(grid), block, width, k))
    return _CODE_DTYPES[code], entries, offset


def decode_sparse(
    data: bytes | bytearray | memoryview, layout: SparseLayout, max_bytes: int
) -> list[SparseUpdate]:
    """Parse a payload from an untrusted peer into one `SparseUpdate` per tensor of `layout`
    (indices int64, values float32). The table is checked against `layout`, and the size it
    implies against `max_bytes` and the real length, before any tensor is allocated."""
    view = memoryview(data)
    if view.itemsize != 1 or not view.c_contiguous:
        raise CompressionError("sparse payload must be a contiguous byte buffer")
    if len(view) > max_bytes:
        raise CompressionError(f"sparse payload of {len(view)} bytes over the limit of {max_bytes}")
    dtype, entries, offset = _read_table(view, layout)
    size = offset + sum(e.count * (e.width + _VALUE_BYTES) for e in entries)
    if size > max_bytes:
        raise CompressionError(
            f"sparse payload declares {size} bytes, over the limit of {max_bytes}"
        )
    if size != len(view):
        raise CompressionError(f"sparse payload is {len(view)} bytes; its table implies {size}")
    out = []
    for i, entry in enumerate(entries):
        n = entry.count
        raw_idx = np.frombuffer(view, dtype=_WIDTH_NP[entry.width], count=n, offset=offset)
        offset += n * entry.width
        raw_val = np.frombuffer(view, dtype="<i2", count=n, offset=offset)
        offset += n * _VALUE_BYTES
        idx = torch.from_numpy(raw_idx.astype(np.int64)).view(-1, entry.k)
        _check_indices(idx, entry.block, f"tensor {i}")
        val = torch.from_numpy(raw_val.astype(np.int16)).view(dtype).to(torch.float32)
        require_finite(val, f"tensor {i} values")
        shape = (*entry.grid, entry.k)
        out.append(SparseUpdate(idx.view(shape), val.view(shape), entry.block))
    return out
