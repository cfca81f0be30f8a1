"""The reducer's commitment to its own contribution (swarmd/node/averaging/commit.py): an
honest opening gives back exactly the values it aggregated, in every form, and anything else
is refused with a reason."""

from __future__ import annotations

import pytest
import torch

from swarmd.compression import zstd_compress, zstd_decompress
from swarmd.node.averaging.commit import Form, commit, form_for, open_blocks, opened_values
from swarmd.node.averaging.proof import gather, sample, sample_block

BLOCK = sample_block(256)
FORMS = [Form("fp32"), Form("fp16"), form_for("int8", 256, 8), form_for("int8", 256, 4)]


def contribution(n: int = 300_001) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f.kind}-q{f.qmax}")
@pytest.mark.parametrize("density", [1 / 32, 1.0])
def test_an_honest_opening_gives_back_exactly_what_was_aggregated(
    form: Form, density: float
) -> None:
    own = contribution()
    residual = torch.empty_like(own)
    c = commit(own, form, BLOCK, residual)
    assert torch.equal(residual, own - c.values)  # what the rounding lost, for error feedback
    if form.kind == "fp32":
        assert torch.equal(c.values, own)
    else:
        assert not torch.equal(c.values, own)
        rel = float((c.values - own).norm() / own.norm())
        assert rel < (0.2 if form.qmax == 7 else 0.01), rel
    ranges = sample(b"s" * 32, own.numel(), BLOCK, density)
    reveal, paths = open_blocks(c, ranges)
    got = opened_values(c.root, form, BLOCK, own.numel(), ranges, reveal, paths)
    assert isinstance(got, torch.Tensor) and torch.equal(got, gather(c.values, ranges))


def test_anything_but_the_committed_values_is_refused() -> None:
    form = form_for("int8", 256, 8)
    own = contribution()
    c = commit(own, form, BLOCK)
    ranges = sample(b"t" * 32, own.numel(), BLOCK, 1 / 8)
    reveal, paths = open_blocks(c, ranges)
    numel = own.numel()

    def verdict(root: bytes = c.root, reveal: bytes = reveal, paths: list[bytes] = paths) -> str:
        got = opened_values(root, form, BLOCK, numel, ranges, reveal, paths)
        assert isinstance(got, str), "accepted"
        return got

    # Other values under the same root: one code changed in the first sampled block.
    data = bytearray(zstd_decompress(reveal, 1 << 24))
    data[100] ^= 1
    assert "off its commitment" in verdict(reveal=zstd_compress(bytes(data)))
    # A commitment made afterwards, to values that fit the probes: not the root served.
    other = commit(own * -1, form, BLOCK)
    assert "off its commitment" in verdict(root=other.root)
    # A path that does not climb to the root.
    bent = [paths[0][:-1] + bytes([paths[0][-1] ^ 1]), *paths[1:]]
    assert "off its commitment" in verdict(paths=bent)
    assert "not the" in verdict(paths=paths[1:])
    # Malformed or oversized openings: refused before anything larger is allocated.
    assert "do not decompress" in verdict(reveal=b"junk")
    bomb = zstd_compress(bytes(len(data) * 100))  # declares its size: refused unread
    assert "do not decompress" in verdict(reveal=bomb)
    assert "wrong number of bytes" in verdict(reveal=zstd_compress(bytes(data[:-4])))


def test_a_sparse_codec_opening_is_small() -> None:
    """A top-k contribution is committed as its decoded values, mostly zeros: zstd keeps the
    opening near the size of the non-zeros."""
    own = torch.zeros(1 << 20)
    own[::64] = 1.0
    c = commit(own, form_for("topk", 256, 2), BLOCK)
    ranges = sample(b"u" * 32, own.numel(), BLOCK, 1 / 32)
    reveal, _ = open_blocks(c, ranges)
    sampled = sum(b - a for a, b in ranges)
    assert len(reveal) < sampled * 4 / 8, (len(reveal), sampled)
