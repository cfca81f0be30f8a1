"""Wire format of the DeMo exchange: per tensor, the top-k DCT coefficients of every block.

One payload carries a whole model's `SparseUpdate` list (what `swarmd.optim.demo.DeMo.prepare`
returns). Unlike the per-tensor codecs (`wire`), a receiver always knows exactly what it
expects, the layout of its own model (`DeMo.layout()`: per tensor the block grid and the block
size), so `decode_sparse` checks the payload's table against that layout and its size against
`max_bytes` and the actual length *before* allocating anything, then refuses out-of-range
indices, an index repeated within one block, and non-finite values. Every failure is a
`CompressionError`.

Layout (little-endian)::

    magic b"SWSU" | version u8 (2) | value code u8 | tensor count u32
    | per tensor: grid ndim u8 | index bits u8 | k u32 | block size u32 | grid: ndim x u32
    | per tensor, in order: indices | [scales: blocks x f32] | values

Indices are per-block coefficient numbers in [0, block size), bit-packed at the fewest bits
that hold block size - 1 (index i is bits [i·b, (i+1)·b) of the stream, least significant
first; the last byte's spare bits are zero): 12 bits for the default 64 x 64 blocks, where
version 1's uint16 spent 16. Value codes:

* 1 fp16, 2 bf16: two bytes a value. bf16 is the float default: DeMo's values are DCT
  coefficients of the momentum δ ≈ lr·g/(1-β), which span many decades across models and
  learning rates. fp16 saturates at 65504 (a 64 x 64 block's DC coefficient is 64 times its
  mean, and gradients spike) and flushes to zero below 6e-8; bf16 has float32's range.
  fp16 remains an option (values clamped to ±65504, never inf) for peers that know their scale.
* 3 int8, 4 int4: one f32 scale per block (its largest |value| / qmax, qmax = 127 or 7; per
  ceil(32 / k) blocks when k < 32, so that blocks of one coefficient, a prime dimension's,
  do not pay 4 bytes of scale a value), then codes in [-qmax, qmax] (int4: two's-complement
  nibbles, low nibble first). Scale-relative
  codes keep bf16's range; top-k values of one block are within a few times of each other, and
  only the sign of the peers' average is used, so a few bits suffice (benchmarks/convergence.md
  measures it). DeMo removes from δ what the codes decode to (`quantize_values`), so the
  rounding stays in δ and is sent later: error feedback, as for the unsent coefficients.

Bytes a coefficient at k = 32 of 4096: bf16 3.5, int8 2.63, int4 2.13 (version 1: 4).
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
    "dequantize_values",
    "encode_sparse",
    "encoded_size",
    "index_bits",
    "quantize_values",
]

MAGIC = b"SWSU"
VERSION = 2
MAX_GRID_NDIM = 8
_HEADER = struct.Struct("<4sBBI")
_TENSOR = struct.Struct("<BBII")
_DIM = struct.Struct("<I")
_VALUE_CODES = {"fp16": 1, "bf16": 2, "int8": 3, "int4": 4}
_CODE_DTYPES = {1: torch.float16, 2: torch.bfloat16}
#: Bits of an integer code, by value code.
_CODE_BITS = {3: 8, 4: 4}
_SCALE_BYTES = 4

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


def index_bits(block_size: int) -> int:
    """Bits per index: the fewest that hold block_size - 1 (at least 1)."""
    if block_size > 1 << 32:
        raise CompressionError(f"block size {block_size} needs indices wider than 32 bits")
    return max(1, (block_size - 1).bit_length())


#: Fewest values that share one scale of integer codes.
SCALE_GROUP = 32


def scale_groups(blocks: int, k: int) -> tuple[int, int]:
    """(blocks per scale, scales) for `blocks` blocks of k values."""
    per = max(1, -(-SCALE_GROUP // k))
    return per, -(-blocks // per)


def _body_size(blocks: int, k: int, bits: int, code: int) -> int:
    n = blocks * k
    size = (n * bits + 7) // 8
    if code in _CODE_BITS:
        return size + scale_groups(blocks, k)[1] * _SCALE_BYTES + (n * _CODE_BITS[code] + 7) // 8
    return size + 2 * n


def _grouped(values: torch.Tensor, per: int) -> torch.Tensor:
    """(blocks, k) -> (scales, per * k), zero-padded."""
    blocks, k = values.shape
    pad = -blocks % per
    if pad:
        values = torch.cat([values, values.new_zeros(pad, k)])
    return values.reshape(-1, per * k)


def quantize_values(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of float values shaped (blocks, k): one scale per `scale_groups`
    blocks = their max |value| / qmax (0 when all are zero), codes = round(value / scale) in
    [-qmax, qmax] (int8, shaped like `values`). `dequantize_values(codes, scales)` is what a
    receiver decodes."""
    if bits not in (4, 8):
        raise CompressionError(f"integer values have 4 or 8 bits, not {bits}")
    qmax = (1 << (bits - 1)) - 1
    blocks, k = values.shape
    per, _ = scale_groups(blocks, k)
    v = _grouped(values.to(torch.float32), per)
    scales = v.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(v / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return codes.reshape(-1, k)[:blocks], scales


def dequantize_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (blocks, k) values of `quantize_values`' codes."""
    blocks, k = codes.shape
    per, _ = scale_groups(blocks, k)
    grouped = _grouped(codes.to(torch.float32), per) * scales[:, None]
    return grouped.reshape(-1, k)[:blocks]


def encoded_size(layout: SparseLayout, topk: int | Sequence[int], value_dtype: str = "bf16") -> int:
    """Exact payload bytes for `layout` with `topk` coefficients per block (clamped to each
    block size, as DeMo does), e.g. a receiver's `max_bytes` (pass the block sizes themselves
    for the largest payload any k could make)."""
    code = _value_code(value_dtype)
    ks = [topk] * len(layout) if isinstance(topk, int) else list(topk)
    if len(ks) != len(layout):
        raise ValueError(f"{len(ks)} k values for a layout of {len(layout)} tensors")
    size = _HEADER.size
    for (grid, block), k in zip(layout, ks, strict=True):
        k = min(max(k, 1), block)
        size += _TENSOR.size + _DIM.size * len(grid)
        size += _body_size(math.prod(grid), k, index_bits(block), code)
    return size


def _value_code(value_dtype: str) -> int:
    if value_dtype not in _VALUE_CODES:
        raise CompressionError(
            f"value_dtype must be one of {sorted(_VALUE_CODES)}, got {value_dtype!r}"
        )
    return _VALUE_CODES[value_dtype]


def _pack_bits(values: np.ndarray[Any, np.dtype[np.uint32]], bits: int) -> bytes:
    """Each value's low `bits` bits, concatenated least significant first."""
    if not values.size:
        return b""
    spread = np.unpackbits(values.astype("<u4").view(np.uint8), bitorder="little")
    return np.packbits(spread.reshape(-1, 32)[:, :bits], bitorder="little").tobytes()


def _unpack_bits(raw: memoryview, count: int, bits: int, where: str) -> torch.Tensor:
    """The inverse of `_pack_bits`, as int64; refuses set spare bits in the last byte."""
    if not count:
        return torch.zeros(0, dtype=torch.int64)
    stream = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    if stream[count * bits :].any():
        raise CompressionError(f"{where}: stray bits after the last index")
    wide = np.zeros((count, 32), dtype=np.uint8)
    wide[:, :bits] = stream[: count * bits].reshape(count, bits)
    packed = np.packbits(wide, axis=1, bitorder="little").view("<u4").reshape(count)
    return torch.from_numpy(packed.astype(np.int64))


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


def _encode_one(update: SparseUpdate, block: int, code: int, i: int) -> list[bytes]:
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
    bits = index_bits(block)
    flat_idx = idx.detach().to(device="cpu", dtype=torch.int64).reshape(-1, k)
    _check_indices(flat_idx, block, where)
    flat_val = val.detach().to(device="cpu", dtype=torch.float32).reshape(-1, k)
    require_finite(flat_val, f"{where} values")
    head = _TENSOR.pack(len(grid), bits, k, block) + b"".join(_DIM.pack(d) for d in grid)
    idx_bytes = _pack_bits(flat_idx.reshape(-1).numpy().astype(np.uint32), bits)
    if code in _CODE_BITS:
        codes, scales = quantize_values(flat_val, _CODE_BITS[code])
        raw = codes.reshape(-1).numpy()
        if code == 4:
            nibbles = raw.astype(np.uint8) & 0x0F
            if raw.size % 2:
                nibbles = np.concatenate([nibbles, np.zeros(1, dtype=np.uint8)])
            pairs = nibbles.reshape(-1, 2)
            raw = (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8)
        val_bytes = scales.numpy().astype("<f4").tobytes() + raw.tobytes()
    else:
        half = clamp_cast(flat_val.reshape(-1), _CODE_DTYPES[code])
        val_bytes = half.view(torch.int16).numpy().astype("<i2").tobytes()
    return [head, idx_bytes, val_bytes]


def encode_sparse(
    updates: Sequence[SparseUpdate],
    value_dtype: str = "bf16",
    *,
    layout: SparseLayout | None = None,
) -> bytes:
    """One payload for a whole model's updates. `value_dtype` is "bf16" (default, see the
    module docstring), "fp16" (clamped to ±65504), "int8" or "int4" (a scale per block).
    Block sizes come from the updates (`DeMo.prepare` sets them) or from `layout`, which is
    then also checked against."""
    code = _value_code(value_dtype)
    if layout is not None and len(layout) != len(updates):
        raise CompressionError(f"{len(updates)} updates for a layout of {len(layout)} tensors")
    heads: list[bytes] = []
    bodies: list[bytes] = []
    for i, update in enumerate(updates):
        head, idx_bytes, val_bytes = _encode_one(update, _block_of(update, layout, i), code, i)
        heads.append(head)
        bodies += [idx_bytes, val_bytes]
    return b"".join([_HEADER.pack(MAGIC, VERSION, code, len(updates)), *heads, *bodies])


@dataclass(frozen=True)
class _Entry:
    grid: tuple[int, ...]
    block: int
    bits: int
    k: int

    @property
    def blocks(self) -> int:
        return math.prod(self.grid)

    @property
    def count(self) -> int:
        return self.blocks * self.k


def _read_table(view: memoryview, layout: SparseLayout) -> tuple[int, list[_Entry], int]:
    """Header and per-tensor table, each field checked against `layout`; returns the value
    code, the entries and where the bodies start."""
    if len(view) < _HEADER.size:
        raise CompressionError(f"truncated sparse payload: {len(view)} bytes, need {_HEADER.size}")
    magic, version, code, count = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CompressionError(f"bad magic {bytes(magic)!r}: not a sparse (DeMo) payload")
    if version != VERSION:
        raise CompressionError(f"sparse payload version {version} unsupported (this is {VERSION})")
    if code not in _VALUE_CODES.values():
        raise CompressionError(f"sparse payload: unknown value dtype code {code}")
    if count != len(layout):
        raise CompressionError(f"sparse payload has {count} tensors, expected {len(layout)}")
    offset, entries = _HEADER.size, []
    for i, (grid, block) in enumerate(layout):
        if len(view) < offset + _TENSOR.size:
            raise CompressionError(f"truncated sparse payload in the entry of tensor {i}")
        ndim, bits, k, declared = _TENSOR.unpack_from(view, offset)
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
        if bits != index_bits(block):
            raise CompressionError(f"tensor {i}: {bits}-bit indices for a block of {block}")
        if not 1 <= k <= block:
            raise CompressionError(f"tensor {i}: k = {k} outside [1, {block}]")
        entries.append(_Entry(tuple(grid), block, bits, k))
    return code, entries, offset


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
    code, entries, offset = _read_table(view, layout)
    size = offset + sum(_body_size(e.blocks, e.k, e.bits, code) for e in entries)
    if size > max_bytes:
        raise CompressionError(
            f"sparse payload declares {size} bytes, over the limit of {max_bytes}"
        )
    if size != len(view):
        raise CompressionError(f"sparse payload is {len(view)} bytes; its table implies {size}")
    out = []
    for i, entry in enumerate(entries):
        where, n = f"tensor {i}", entry.count
        nbytes = (n * entry.bits + 7) // 8
        idx = _unpack_bits(view[offset : offset + nbytes], n, entry.bits, where)
        offset += nbytes
        idx = idx.view(-1, entry.k)
        _check_indices(idx, entry.block, where)
        val, offset = _read_values(view, offset, entry, code, where)
        shape = (*entry.grid, entry.k)
        out.append(SparseUpdate(idx.view(shape), val.view(shape), entry.block))
    return out


def _read_values(
    view: memoryview, offset: int, entry: _Entry, code: int, where: str
) -> tuple[torch.Tensor, int]:
    """One tensor's values as float32 (blocks, k), and the offset after them."""
    n = entry.count
    if code not in _CODE_BITS:
        raw = np.frombuffer(view, dtype="<i2", count=n, offset=offset)
        val = torch.from_numpy(raw.astype(np.int16)).view(_CODE_DTYPES[code]).to(torch.float32)
        require_finite(val, f"{where} values")
        return val.view(-1, entry.k), offset + 2 * n
    bits = _CODE_BITS[code]
    groups = scale_groups(entry.blocks, entry.k)[1]
    raw_scales = np.frombuffer(view, dtype="<f4", count=groups, offset=offset)
    scales = torch.from_numpy(raw_scales.astype(np.float32))
    require_finite(scales, f"{where} scales")
    if bool((scales < 0).any()):
        raise CompressionError(f"{where}: a negative scale")
    offset += groups * _SCALE_BYTES
    nbytes = (n * bits + 7) // 8
    raw = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=offset)
    if bits == 4:
        nibbles = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)
        if n % 2 and nibbles[n]:
            raise CompressionError(f"{where}: stray bits after the last value")
        codes = nibbles[:n].astype(np.int8)
        codes = np.where(codes > 7, codes - 16, codes).astype(np.int8)
    else:
        codes = raw.view(np.int8).copy()
    qmax = (1 << (bits - 1)) - 1
    if codes.size and int(codes.min()) < -qmax:
        raise CompressionError(f"{where}: a value code outside [-{qmax}, {qmax}]")
    val = dequantize_values(torch.from_numpy(codes).view(-1, entry.k), scales)
    require_finite(val, f"{where} values")
    return val, offset + nbytes
