"""Sparse top-k with few-bit values (SparseLoCo's compressor, Sarfi et al. 2025): per chunk of
a flat vector, the `k` largest-magnitude entries, their values quantised to `bits` bits with
one fp32 scale per chunk.

A pseudo-gradient's mass sits in few entries per chunk; what is not sent (and the
quantisation error) goes to error feedback, so over rounds every entry gets through. The
kept values are by construction far from zero, so the `2**bits` levels are the odd
multiples of the scale, ±scale … ±(2**bits − 1)·scale, with no level wasted on zero (2 bits:
±s, ±3s; an all-zero chunk has scale 0 and sends nothing). Every kept value is within one
scale of its input. Only nonzero entries are kept, so a chunk with fewer than `k` nonzeros
sends fewer: with ``density=1`` the codec sends exactly the nonzeros, which is how a reducer
serves the mean of sparse contributions (`averaging/codecs.py`).

Layout after the shared header (`wire`; little-endian)::

    params: chunk u32 | bits u8 | index width u8 | kept count u64
    scales f32 x chunks | counts u16 x chunks | support | codes (kept x bits, packed low bits
    first)

The support is either the indices (index width 1 or 2: kept x width bytes, unsigned, within
their chunk, increasing) or, with index width 0, a bitmap of the whole tensor (bit i, low bits
first, set where value i was kept), whichever is smaller: a contribution at 1/32 is 2 bytes a
kept value as indices and 4 as a bitmap; a reducer's mean of 4 of them (up to 1/8 dense) is
smaller as a bitmap.

The decoder checks every size against the header (and the header's element count against
the caller's limits) before allocating, then refuses counts beyond a chunk, indices out of
range or not increasing, and negative, non-finite or overflowing scales.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from swarmd.compression.buffers import byte_view, check_float_input, flat_float32, from_bytes
from swarmd.compression.errors import CompressionError
from swarmd.compression.int8 import SCALE_MIN
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
#: Chunks of at least 64 values keep every payload under its part's fp32 size (at density 1
#: and 8 bits: 2 + 6/64 bytes a value), which is what a reducer admits (`codecs.part_limit`);
#: at most 32768, so counts and indices fit in 16 bits.
MIN_CHUNK = 64
MAX_CHUNK = 1 << 15
BITS = (1, 2, 4, 8)
_PARAMS = struct.Struct("<IBBQ")
#: Chunks handled at once: temporaries (magnitudes, the keep mask) stay near 1 M values.
_ROWS = 256


def index_width(chunk: int) -> int:
    """Bytes per index: the narrowest unsigned type holding chunk - 1."""
    return 1 if chunk <= 256 else 2


def _support_bytes(numel: int, kept: int, chunk: int) -> tuple[int, int]:
    """(index width, bytes) of the smaller support: indices, or a bitmap (width 0)."""
    indices, bitmap = index_width(chunk) * kept, -(-numel // 8)
    return (0, bitmap) if bitmap < indices else (index_width(chunk), indices)


def _largest_scale(levels: int) -> float:
    """Largest float32 scale whose `levels` x scale is still finite in float32."""
    scale = torch.tensor(torch.finfo(torch.float32).max / levels, dtype=torch.float32)
    while not bool(torch.isfinite(scale * levels)):
        scale = torch.nextafter(scale, torch.zeros_like(scale))
    return float(scale)


_SCALE_MAX = {bits: _largest_scale((1 << bits) - 1) for bits in BITS}


@dataclass(frozen=True)
class TopKConfig:
    """`density` of each `chunk` kept (k = round(density x chunk), at least 1; 1 keeps every
    nonzero), values in `bits` bits (1, 2, 4 or 8) with an fp32 scale per chunk.

    Bytes per kept value: the index (1 byte for chunks up to 256, else 2) plus bits/8; with
    the defaults (4096, 1/32, 2 bits) 128 of every 4096 values go for 294 bytes, 0.072 bytes
    a value, 56x fewer than fp32 and 14x fewer than int8.
    """

    chunk: int = 4096
    density: float = 1 / 32
    bits: int = 2

    def __post_init__(self) -> None:
        c = self.chunk
        if isinstance(c, bool) or not isinstance(c, int) or not MIN_CHUNK <= c <= MAX_CHUNK:
            raise ValueError(f"top-k chunk must be an int in [{MIN_CHUNK}, {MAX_CHUNK}], got {c!r}")
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(f"top-k density must be a number in (0, 1], got {d!r}")
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"top-k bits must be one of 1, 2, 4, 8, got {self.bits!r}")

    @property
    def k(self) -> int:
        """Entries kept per chunk (the last, shorter chunk too)."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

    def bytes_per_value(self) -> float:
        """Wire bytes per input value when every chunk keeps k (for deadlines and sizing)."""
        per_kept = index_width(self.chunk) + self.bits / 8
        return (self.k * per_kept + 6) / self.chunk


def _select(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The keep mask of a block of chunks: each chunk's k largest magnitudes, nonzero only."""
    mag = rows.abs()
    if k >= rows.shape[1]:
        return mag > 0
    keep = torch.zeros_like(rows, dtype=torch.bool)
    keep.scatter_(1, torch.topk(mag, k, dim=1, sorted=False).indices, True)
    return keep & (mag > 0)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits, 8/bits to a byte, low bits first."""
    if bits == 8:
        return codes
    per = 8 // bits
    pad = -codes.numel() % per
    grouped = torch.cat([codes, codes.new_zeros(pad)]).view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (grouped << shifts).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    if bits == 8:
        return packed[:count]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    wide = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return wide.reshape(-1)[:count].to(torch.uint8)


def _support(pos: torch.Tensor, numel: int, chunk: int, width: int) -> bytes | memoryview:
    if width == 0:
        bitmap = np.zeros(-(-numel // 8) * 8, dtype=np.uint8)
        bitmap[pos.numpy()] = 1
        return np.packbits(bitmap, bitorder="little").tobytes()
    index = (pos % chunk).to(torch.int32 if width == 2 else torch.uint8)
    return index.numpy().astype("<u2").tobytes() if width == 2 else byte_view(index)


def _read_support(
    raw: memoryview, width: int, counts: torch.Tensor, chunk: int, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, their chunks), checked against the counts and the chunks' lengths."""
    nchunks = counts.numel()
    if width == 0:
        bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")
        if bits[numel:].any():
            raise CompressionError("TOPK bitmap marks values beyond the tensor")
        pos = torch.from_numpy(np.flatnonzero(bits).astype(np.int64))
        owner = pos // chunk
        if not torch.equal(torch.bincount(owner, minlength=nchunks), counts):
            raise CompressionError("TOPK bitmap does not match the chunk counts")
        return pos, owner
    lengths = torch.full((nchunks,), chunk, dtype=torch.int64)
    if nchunks:
        lengths[-1] = numel - (nchunks - 1) * chunk
    index = np.frombuffer(raw, "<u2" if width == 2 else "u1")
    owner = torch.repeat_interleave(torch.arange(nchunks), counts)
    offsets = torch.from_numpy(index.astype(np.int64))
    if bool((offsets >= lengths[owner]).any()):
        raise CompressionError("TOPK index beyond its chunk")
    pos = owner * chunk + offsets
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise CompressionError("TOPK indices are not increasing within their chunks")
    return pos, owner


class TopKCodec:
    codec_id = CodecId.TOPK

    def __init__(self, config: TopKConfig | None = None) -> None:
        self.config = config or TopKConfig()

    def encode(self, tensor: torch.Tensor) -> bytes:
        return b"".join(self.encode_segments(tensor))

    def encode_segments(self, tensor: torch.Tensor) -> list[bytes | memoryview]:
        """Header, scales, counts, indices, codes. Ties among equal magnitudes are broken by
        torch.topk, the same way for the same input on every run of this build."""
        check_float_input(tensor)
        flat = flat_float32(tensor)
        cfg = self.config
        n, chunk, levels = flat.numel(), cfg.chunk, (1 << cfg.bits) - 1
        nchunks = -(-n // chunk)
        scales = torch.zeros(nchunks, dtype=torch.float32)
        counts, positions, values = [], [], []
        for r0 in range(0, nchunks, _ROWS):
            r1 = min(nchunks, r0 + _ROWS)
            block = flat[r0 * chunk : r1 * chunk]
            if block.numel() < (r1 - r0) * chunk:  # the last chunk, padded with zeros
                block = torch.cat([block, block.new_zeros((r1 - r0) * chunk - block.numel())])
            rows = block.view(r1 - r0, chunk)
            amax = rows.abs().amax(dim=1)
            if not bool(torch.isfinite(amax).all()):
                raise CompressionError("TOPK input contains NaN or infinity")
            keep = _select(rows, cfg.k)
            counts.append(keep.sum(dim=1))
            at = keep.view(-1).nonzero().squeeze(1)
            positions.append(at + r0 * chunk)
            values.append(block[at])
            scales[r0:r1] = (amax / levels).clamp_(SCALE_MIN, _SCALE_MAX[cfg.bits])
            scales[r0:r1][amax == 0] = 0.0
        count = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)
        pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        kept = torch.cat(values) if values else torch.zeros(0)
        per_value = scales.repeat_interleave(count)
        codes = ((kept / per_value + levels) / 2).round_().clamp_(0, levels).to(torch.uint8)
        width, _ = _support_bytes(n, int(pos.numel()), chunk)
        params = _PARAMS.pack(chunk, cfg.bits, width, int(pos.numel()))
        header = pack_header(CodecId.TOPK, VERSION, tensor.dtype, tuple(tensor.shape), params)
        count16 = count.numpy().astype("<u2").tobytes()
        support = _support(pos, n, chunk, width)
        return [header, byte_view(scales), count16, support, byte_view(_pack(codes, cfg.bits))]

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return decode_topk(parse_header(data, limits), data)


def _read_params(header: Header) -> tuple[int, int, int, int]:
    expect(header, CodecId.TOPK, VERSION, _PARAMS.size)
    expect_float(header)
    chunk, bits, width, kept = _PARAMS.unpack(header.params)
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise CompressionError(f"TOPK chunk {chunk} outside [{MIN_CHUNK}, {MAX_CHUNK}]")
    if bits not in BITS:
        raise CompressionError(f"TOPK declares {bits} bits; only 1, 2, 4, 8 exist")
    if width not in (0, index_width(chunk)):
        raise CompressionError(f"TOPK index width {width} is neither 0 nor {index_width(chunk)}")
    if kept > header.numel:
        raise CompressionError(f"TOPK keeps {kept} of {header.numel} values")
    return chunk, bits, width, kept


def decode_topk(header: Header, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The dense tensor (zeros where nothing was sent). Every size is checked against the
    header, and the header against the caller's limits, before anything is allocated."""
    chunk, bits, width, kept = _read_params(header)
    n = header.numel
    nchunks = -(-n // chunk)
    support = -(-n // 8) if width == 0 else width * kept
    sizes = (4 * nchunks, 2 * nchunks, support, -(-kept * bits // 8))
    body = payload(data, header, sum(sizes))
    ends = np.cumsum(sizes).tolist()
    scales = from_bytes(body[: ends[0]], torch.float32, nchunks)
    if nchunks and not bool(((scales >= 0) & (scales <= _SCALE_MAX[bits])).all()):
        raise CompressionError("TOPK payload has a negative, NaN or overflowing chunk scale")
    counts = torch.from_numpy(np.frombuffer(body[ends[0] : ends[1]], "<u2").astype(np.int64))
    if bool((counts > chunk).any()) or int(counts.sum()) != kept:
        raise CompressionError(f"TOPK chunk counts exceed their chunks or do not sum to {kept}")
    pos, owner = _read_support(body[ends[1] : ends[2]], width, counts, chunk, n)
    packed = torch.from_numpy(np.frombuffer(body[ends[2] : ends[3]], np.uint8).copy())
    codes = _unpack(packed, bits, kept).to(torch.float32)
    levels = (1 << bits) - 1
    out = torch.zeros(n, dtype=torch.float32)
    out[pos] = (2 * codes - levels) * scales[owner]
    if header.dtype == torch.float32:
        return out.view(header.shape)
    return out.to(header.dtype).view(header.shape)


def encoded_size(numel: int, kept: int, config: TopKConfig) -> int:
    """Payload bytes after the header for `kept` values of `numel` (for tests and sizing)."""
    nchunks = math.ceil(numel / config.chunk)
    support = _support_bytes(numel, kept, config.chunk)[1]
    return 6 * nchunks + support + -(-kept * config.bits // 8)
