"""Data sources: determinism, disjoint shards, a shared validation split, every source type."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.workloads import (
    DataError,
    TokenSource,
    bin_source,
    builtin_corpus,
    load_source,
    shard_for_peer,
    text_source,
)

SMALL = 256 << 10  # a 256 KiB built-in corpus keeps these tests fast


def _is_shifted(x: torch.Tensor, y: torch.Tensor) -> None:
    assert torch.equal(x[:, 1:], y[:, :-1])


def _positional_source(n: int) -> TokenSource:
    """Token i at position i: a window's first token is where it starts."""
    return TokenSource.from_stream("positions", torch.arange(n), vocab_size=n)


def test_builtin_corpus_is_deterministic_and_needs_no_files() -> None:
    a, b = builtin_corpus(SMALL), builtin_corpus(SMALL)
    assert a.vocab_size == 256
    assert a.train_tokens.numel() + a.validation_tokens.numel() == SMALL
    assert a.fingerprint() == b.fingerprint()
    # It is the standard library's own source, starting with its first .py file by path.
    root = Path(sysconfig.get_paths()["stdlib"])
    first = min(p.relative_to(root).as_posix() for p in root.glob("*.py"))
    head = (root / first).read_bytes()[:1000]
    assert bytes(a.train_tokens[: len(head)].tolist()) == head


def test_batches_are_deterministic_and_shifted() -> None:
    src = builtin_corpus(SMALL)
    x1, y1 = src.train_batch(2, 4, 8, 32, seed=5, step=3)
    x2, y2 = src.train_batch(2, 4, 8, 32, seed=5, step=3)
    assert x1.shape == y1.shape == (8, 32) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    _is_shifted(x1, y1)
    assert not torch.equal(x1, src.train_batch(2, 4, 8, 32, seed=5, step=4)[0])
    assert not torch.equal(x1, src.train_batch(2, 4, 8, 32, seed=6, step=3)[0])
    # The iterator yields the same batches as addressing them by step.
    it = src.train_batches(2, 4, 8, 32, seed=5, start_step=3)
    assert torch.equal(next(it)[0], x1)
    assert torch.equal(next(it)[0], src.train_batch(2, 4, 8, 32, seed=5, step=4)[0])


def test_shards_are_disjoint_and_cover_the_training_split() -> None:
    src = _positional_source(4000)
    ranges = [src.shard_range(i, 4) for i in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == src.train_tokens.numel() == 3800
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(3))
    block = 16
    for i, (lo, hi) in enumerate(ranges):
        for step in range(50):
            x, y = src.train_batch(i, 4, 8, block, seed=0, step=step)
            _is_shifted(x, y)
            assert torch.equal(x, x[:, :1] + torch.arange(block))  # contiguous windows
            assert int(x[:, 0].min()) >= lo and int(y[:, -1].max()) < hi


def test_validation_is_shared_and_disjoint_from_training() -> None:
    data = bytes(range(256)) * 40
    a = TokenSource.from_stream("a", torch.tensor(list(data), dtype=torch.uint8), 256)
    val = a.validation_batches(4, 8)
    again = a.validation_batches(4, 8)
    assert len(val) == len(again) > 0
    for (x1, y1), (x2, y2) in zip(val, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    n_train = a.train_tokens.numel()
    assert n_train + a.validation_tokens.numel() == len(data)
    assert a.validation_tokens.numel() == pytest.approx(0.05 * len(data), abs=1)
    # Validation windows are cut from the tail only; training windows never reach it.
    assert torch.equal(val[0][0][0], torch.tensor(list(data[n_train : n_train + 8])))
    assert max(a.shard_range(shard, 3)[1] for shard in range(3)) == n_train
    assert len(a.validation_batches(4, 8, max_batches=1)) == 1


def test_shard_for_peer_is_stable_and_spread() -> None:
    assert shard_for_peer(b"peer-a", 8) == shard_for_peer(b"peer-a", 8)
    # Pinned values: the mapping must not change between versions or machines.
    assert shard_for_peer(bytes(32), 1000) == 628
    assert shard_for_peer(b"peer-a", 8) == 1
    counts = [0] * 4
    for i in range(400):
        counts[shard_for_peer(i.to_bytes(4, "big"), 4)] += 1
    assert min(counts) > 60
    with pytest.raises(ValueError, match="num_shards"):
        shard_for_peer(b"x", 0)
    with pytest.raises(ValueError, match="peer_id"):
        shard_for_peer(b"", 3)


def test_text_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second file " * 50)
    (tmp_path / "a.txt").write_bytes(b"first file " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"third " * 50)
    (tmp_path / ".hidden").write_bytes(b"SECRET" * 100)
    src = text_source(tmp_path)
    stream = bytes(torch.cat([src.train_tokens, src.validation_tokens]).tolist())
    assert stream == b"first file " * 50 + b"second file " * 50 + b"third " * 50
    single = text_source(tmp_path / "a.txt")
    assert single.train_tokens.numel() + single.validation_tokens.numel() == 550
    x, _ = single.train_batch(0, 2, 3, 16, seed=0, step=0)
    assert x.shape == (3, 16)
    assert load_source(str(tmp_path)).fingerprint() == src.fingerprint()


def test_bin_file_and_nanogpt_directory(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=5000, dtype=np.uint16)
    tokens.tofile(tmp_path / "data.bin")
    src = bin_source(tmp_path / "data.bin")
    assert src.vocab_size == 50257
    assert torch.equal(
        torch.cat([src.train_tokens, src.validation_tokens]).to(torch.int64),
        torch.from_numpy(tokens.astype(np.int64)),
    )
    x, y = src.train_batch(1, 3, 4, 32, seed=0, step=0)
    assert x.dtype == torch.int64 and int(x.max()) < 50257
    _is_shifted(x, y)
    d = tmp_path / "owt"
    d.mkdir()
    tokens[:4000].tofile(d / "train.bin")
    tokens[4000:].tofile(d / "val.bin")
    nano = load_source(str(d))
    assert nano.train_tokens.numel() == 4000 and nano.validation_tokens.numel() == 1000
    vx, _ = nano.validation_batches(2, 10)[0]
    assert torch.equal(vx[0], torch.from_numpy(tokens[4000:4010].astype(np.int64)))


def test_bad_bin_files(tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd"):
        bin_source(odd)
    big = tmp_path / "big.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(big)
    with pytest.raises(DataError, match="token id 300 >= vocab_size 256"):
        bin_source(big, vocab_size=256)
    # Unchecked at open, still caught when a batch contains it.
    src = bin_source(big, vocab_size=256, check_tokens=False, val_fraction=0.4)
    with pytest.raises(DataError, match="token id 300"):
        src.validation_batches(1, 1)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        bin_source(empty)
    with pytest.raises(DataError, match="no such file"):
        bin_source(tmp_path / "missing.bin")
    (tmp_path / "half").mkdir()
    np.array([1, 2], dtype=np.uint16).tofile(tmp_path / "half" / "train.bin")
    with pytest.raises(DataError, match=r"train\.bin and val\.bin"):
        bin_source(tmp_path / "half")


def test_bad_text_inputs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        text_source(tmp_path / "nope")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty corpus"):
        text_source(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no \\(non-hidden\\) files"):
        text_source(tmp_path / "d")
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    short = text_source(tmp_path / "short.txt")
    with pytest.raises(DataError, match="fewer than block_size \\+ 1"):
        short.train_batch(0, 1, 2, 128, seed=0, step=0)
    with pytest.raises(DataError, match="validation split has 5 tokens"):
        short.validation_batches(2, 8)
    with pytest.raises(ValueError, match="shard must be"):
        short.train_batch(3, 3, 2, 8, seed=0, step=0)
    with pytest.raises(ValueError, match="batch_size"):
        short.train_batch(0, 1, 0, 8, seed=0, step=0)
    with pytest.raises(ValueError, match="vocab"):
        load_source(str(tmp_path / "short.txt"), vocab_size=50257)
    with pytest.raises(ValueError, match="vocab_size 256"):
        load_source("builtin", vocab_size=50257)
