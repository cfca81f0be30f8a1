"""A reducer's commitment to its own contribution, opened where the probes read it.

Nobody but the reducer holds its own contribution to its part, so without this a reducer that
knows about proofs (proof.py) could fill in its own entry to make any result it serves pass
the mean check. Here it commits first: it splits its contribution into the probes' sample
blocks, hashes each block's bytes into a Merkle tree, and serves the root with the part's
bytes (`PartServed`), before any member's nonce (so before the probes) exists. Its proof then
opens the blocks the probes sample, each with its authentication path; every member hashes
them back to the root it was served and projects them itself. The reducer's entry is then as
checked as every other one: fixed before the probes and seen by every member.

The contribution is committed in the round's own number format, so the opening costs what the
members' parts cost: int8 codes and per-block scales at the round's bits (the reducer's own
values are quantised like everyone else's, and what that loses goes to its error feedback),
fp16, fp32, or a sparse codec's decoded values (mostly zeros, which zstd takes away). At the
default sample (1/32 of the blocks) an int8 opening adds ~1/32 of a byte per value of the
part to each proof: ~3% of an 8-bit part, ~6% of a 4-bit one, plus 32 bytes per sampled block
per tree level. What this does not stop: a reducer that has seen the other contributions
before it commits can still choose its own within the members' norm bound, as any member
could that guessed the others' (bounding that is robust aggregation's job, issue 28).

Hashes: BLAKE3 (32 bytes) with one-byte domain tags for leaves, inner nodes and padding, so a
leaf can never pass for a node (second-preimage attacks on Merkle trees). BLAKE3, not SHA-256:
every reducer hashes its whole contribution each round, and BLAKE3 runs at 4.5 GB/s on this
machine's one core against SHA-256's 1.7.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from blake3 import blake3

from swarmd.compression import CompressionError, zstd_compress, zstd_decompress
from swarmd.compression.int8 import quantize_int8_chunks
from swarmd.compression.zstd_frame import ZstdConfig

HASH_BYTES = 32
_NODE, _EMPTY = b"\x01", b"\x02"
_PAD = blake3(_EMPTY).digest()
#: Leaves hash in BLAKE3's derive-key mode: a mode of their own (nodes and the pad hash plain,
#: with a prefix byte), so a leaf never reads as a node. A prefix byte on the leaves too made
#: the tree 3-4x slower to build: it offset every 16 KB block from BLAKE3's 1 KB chunks (25 M
#: fp32 values 60-75 ms a commitment against 19-20, every reducer every round).
_LEAF_CONTEXT = "swarmd 2026-12-02 commitment leaf"
#: Every leaf's hash starts from this state (copied, never updated itself).
_LEAF_HEAD = blake3(derive_key_context=_LEAF_CONTEXT)
#: zstd of the opening: the cheapest level still removes a sparse codec's zeros.
_ZSTD = ZstdConfig(level=1)

Kind = Literal["fp32", "fp16", "int8"]


@dataclass(frozen=True)
class Form:
    """The number format the reducer's own contribution is committed (and aggregated) in."""

    kind: Kind
    #: int8 only: values per scale, and the largest code.
    int8_block: int = 256
    qmax: int = 127

    def __post_init__(self) -> None:
        if self.int8_block <= 0 or not 0 < self.qmax <= 127:
            raise ValueError(f"bad commitment form {self}")

    def nbytes(self, start: int, end: int) -> int:
        """Bytes of the committed values [start, end): int8 blocks start on a scale."""
        n = end - start
        if self.kind == "fp32":
            return 4 * n
        if self.kind == "fp16":
            return 2 * n
        return n + 4 * -(-n // self.int8_block)


def form_for(codec: str, int8_block: int, int8_bits: int) -> Form:
    """A sparse codec's own contribution is already what it sent (decoded): committed as is."""
    if codec == "int8":
        return Form("int8", int8_block, (1 << (int8_bits - 1)) - 1)
    if codec == "fp16":
        return Form("fp16")
    return Form("fp32")


@dataclass
class Committed:
    """The reducer's own contribution as it aggregates it, and the tree over its blocks."""

    values: torch.Tensor
    form: Form
    #: Sample block (proof.sample_block): one leaf each.
    block: int
    #: The bytes of every value, in the form's layout: (payload per value, int8 scales).
    payload: torch.Tensor
    scales: torch.Tensor | None
    levels: list[list[bytes]]
    #: The pooled buffer behind int8 `payload`, handed back once the proof is made.
    buffer: bytearray | None = None

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def block_views(self, leaf: int) -> list[memoryview]:
        """The bytes of one sample block (int8: its codes, then their scales), uncopied. The
        codes come first so that they start on BLAKE3's chunks (`_LEAF_CONTEXT`)."""
        start, end = leaf * self.block, min(self.values.numel(), (leaf + 1) * self.block)
        data = [self.payload[start:end].numpy().data.cast("B")]
        if self.scales is None:
            return data
        ib = self.form.int8_block  # the sample block is whole int8 blocks (sample_block)
        return [*data, self.scales[start // ib : -(-end // ib)].numpy().data.cast("B")]


def commit(
    own: torch.Tensor,
    form: Form,
    block: int,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    codes: torch.Tensor | None = None,
) -> Committed:
    """Puts ``own`` in ``form``; ``residual`` (its shape) receives what that loses, and the
    values land in ``out`` (``own`` itself is allowed: the int8 form then overwrites it, with
    no fresh 4-bytes-a-value tensor each round); int8 codes land in ``codes`` when given."""
    own = own.reshape(-1)
    scales: torch.Tensor | None = None
    if form.kind == "fp32":
        values = payload = own
    elif form.kind == "fp16":
        payload = own.to(torch.float16)
        values = payload.to(torch.float32)
    else:
        if block % form.int8_block:
            raise ValueError("the sample block must be whole int8 blocks")
        payload = torch.empty(own.numel(), dtype=torch.int8) if codes is None else codes
        scales = torch.empty(-(-own.numel() // form.int8_block), dtype=torch.float32)
        values = torch.empty_like(own) if out is None else out
        quantize_int8_chunks(
            own,
            form.int8_block,
            scales,
            codes=payload,
            residual=residual,
            qmax=form.qmax,
            decoded=values,
        )
        residual = None  # written while each chunk was in cache
    if residual is not None:
        torch.sub(own, values, out=residual)
    c = Committed(values, form, block, payload, scales, [])
    c.levels = _tree(_leaves(c) or [_PAD])
    return c


def _leaves(c: Committed) -> list[bytes]:
    """Every sample block's leaf, as `_leaf(*c.block_views(b))` hashes it, sliced from one
    byte view of the payload (and of the scales): taking each block's views through torch
    cost 2.5x the hashing itself (25 M fp32 values: 0.14 CPU-s a commitment, every reducer
    every round)."""
    count = -(-c.values.numel() // c.block)
    # (bytes of every block, bytes a block): int8 blocks hash their codes, then their scales.
    spans = [(c.payload.numpy().data.cast("B"), c.payload.element_size() * c.block)]
    if c.scales is not None:
        per = 4 * (c.block // c.form.int8_block)  # the float32 scales of its int8 blocks
        spans.append((c.scales.numpy().data.cast("B"), per))
    leaves = []
    for b in range(count):
        h = _LEAF_HEAD.copy()
        for data, width in spans:
            h.update(data[b * width : (b + 1) * width])
        leaves.append(h.digest())
    return leaves


def leaves_of(numel: int, block: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The sample blocks ``ranges`` (proof.sample's) cover, in order."""
    out: list[int] = []
    for a, b in ranges:
        out.extend(range(a // block, -(-b // block)))
    return out


def open_blocks(c: Committed, ranges: list[tuple[int, int]]) -> tuple[bytes, list[bytes]]:
    """The proof's opening: the sampled blocks (zstd) and each one's authentication path."""
    leaves = leaves_of(c.values.numel(), c.block, ranges)
    data = b"".join(v for b in leaves for v in c.block_views(b))
    reveal = zstd_compress(data, _ZSTD)  # self-describing: its size is checked before inflating
    return reveal, [b"".join(_path(c.levels, b)) for b in leaves]


def opened_values(
    root: bytes,
    form: Form,
    block: int,
    numel: int,
    ranges: list[tuple[int, int]],
    reveal: bytes,
    paths: list[bytes],
) -> torch.Tensor | str:
    """The reducer's own values on ``ranges``, as it committed them under ``root``, or why the
    opening does not hold. Nothing is allocated beyond the sample's own size."""
    leaves = leaves_of(numel, block, ranges)
    spans = [(b * block, min(numel, (b + 1) * block)) for b in leaves]
    if sum(z - a for a, z in spans) != sum(z - a for a, z in ranges):
        raise ValueError("ranges must be whole sample blocks")
    sizes = [form.nbytes(a, z) for a, z in spans]
    if len(paths) != len(leaves):
        return f"opens {len(paths)} blocks of its own contribution, not the {len(leaves)} sampled"
    try:
        data = zstd_decompress(reveal, max_bytes=sum(sizes))
    except CompressionError as exc:
        return f"opens its own contribution in bytes that do not decompress ({exc})"
    if len(data) != sum(sizes):
        return "opens its own contribution in the wrong number of bytes"
    depth = len(_tree_shape(-(-numel // block) or 1)) - 1
    values: list[torch.Tensor] = []
    offset = 0
    for leaf, (a, z), size, path in zip(leaves, spans, sizes, paths, strict=True):
        piece = data[offset : offset + size]
        offset += size
        if len(path) != depth * HASH_BYTES or _climb(_leaf(piece), leaf, path) != root:
            return f"opens block {leaf} of its own contribution off its commitment"
        block_values = _decode(piece, form, z - a)
        if not bool(torch.isfinite(block_values).all()):
            return f"opens block {leaf} of its own contribution with non-finite values"
        values.append(block_values)
    # proof.sample's ranges are whole sample blocks (or the part whole): the blocks in order
    # are the sampled values in order.
    return torch.cat(values) if values else torch.zeros(0)


def _decode(piece: bytes, form: Form, n: int) -> torch.Tensor:
    buf = bytearray(piece)
    if form.kind == "fp32":
        return torch.frombuffer(buf, dtype=torch.float32).clone()
    if form.kind == "fp16":
        return torch.frombuffer(buf, dtype=torch.float16).to(torch.float32)
    codes = torch.frombuffer(buf[:n], dtype=torch.int8)
    scales = torch.frombuffer(buf[n:], dtype=torch.float32)
    # As quantize_int8_chunks decodes: code x scale in float32, one rounding: bit-identical.
    return codes.to(torch.float32) * scales.repeat_interleave(form.int8_block)[:n]


def _leaf(*pieces: bytes | memoryview) -> bytes:
    h = _LEAF_HEAD.copy()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def _tree_shape(leaves: int) -> list[int]:
    shape = [leaves]
    while shape[-1] > 1:
        shape.append(-(-shape[-1] // 2))
    return shape


def _tree(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    while len(levels[-1]) > 1:
        lower = levels[-1] + ([_PAD] if len(levels[-1]) % 2 else [])
        pairs = zip(lower[::2], lower[1::2], strict=True)
        levels.append([blake3(_NODE + a + b).digest() for a, b in pairs])
    return levels


def _path(levels: list[list[bytes]], leaf: int) -> list[bytes]:
    out = []
    for level in levels[:-1]:
        sibling = leaf ^ 1
        out.append(level[sibling] if sibling < len(level) else _PAD)
        leaf //= 2
    return out


def _climb(node: bytes, leaf: int, path: bytes) -> bytes:
    for k in range(0, len(path), HASH_BYTES):
        sibling = path[k : k + HASH_BYTES]
        pair = node + sibling if leaf % 2 == 0 else sibling + node
        node = blake3(_NODE + pair).digest()
        leaf //= 2
    return node
