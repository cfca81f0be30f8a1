"""Token sources: where training and validation batches come from.

Every source is one token stream cut in two: the last `val_fraction` (5%) is the validation
split, identical on every peer and never trained on; the rest is cut into `num_shards`
contiguous, disjoint training shards, and a peer trains on the shard its peer id hashes to
(`shard_for_peer`). Training windows never cross a shard's end, so shards share no token.

Contiguous shards of an ordered corpus are not IID (the built-in one is sorted by path, so a
quarter holds only some modules). Dealing 8 KiB stripes to the shards in turn was measured
instead (benchmarks/convergence.py, 4 peers, 1000 steps) and kept out: data-parallel training
gained a little (validation loss 1.8186 -> 1.7734) but DiLoCo at H=100 lost a lot (1.8988 ->
2.1632), a 22% gap instead of 4.4%.

Batches are addressed by (seed, shard, step) rather than drawn from a stateful generator: a
restarted or re-sharded peer can resume at any step without replaying the ones before it, and
tests can compare batches across processes.

Sources:
  * `builtin_corpus()` - bytes of the Python standard library's own `.py` files. It needs no
    download: every machine that runs swarmd has it. It is the same on peers with the same
    CPython version and distribution (distributions split out some packages, which is why
    those are excluded); compare `fingerprint()` when in doubt.
  * `text_source(path)` - a text file or a directory of them, as byte-level tokens.
  * `bin_source(path)` - nanoGPT's pre-tokenised uint16 `.bin` files, memory-mapped. A
    directory holding nanoGPT's `train.bin` and `val.bin` uses `val.bin` as validation split.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch

BYTE_VOCAB = 256
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_BUILTIN_BYTES = 8 << 20
#: nanoGPT's GPT-2 tokenisation; its vocabulary fits in uint16.
GPT2_VOCAB = 50257
UINT16_VOCAB = 1 << 16
#: Directories distributions ship separately (or that are not the library itself), left out so
#: that the built-in corpus is the same on more installations.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "distutils",
    }
)
_SCAN_CHUNK = 1 << 24

Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ValueError):
    """A data source cannot be used as asked (missing, empty, too short, malformed)."""


def shard_for_peer(peer_id: bytes, num_shards: int) -> int:
    """The training shard a peer reads: BLAKE2b-64 of its peer id, modulo `num_shards`.

    A keyed-by-purpose cryptographic hash keeps the mapping stable across processes, Python
    versions and machines (unlike `hash()`), and spreads peers evenly. Two peers may land on
    the same shard when peers outnumber shards or by chance; that wastes some diversity but
    never breaks training.
    """
    if not isinstance(peer_id, bytes | bytearray) or not peer_id:
        raise ValueError("peer_id must be non-empty bytes")
    _check_shards(0, num_shards)
    digest = hashlib.blake2b(bytes(peer_id), digest_size=8, person=b"swarmd-shard").digest()
    return int.from_bytes(digest, "big") % num_shards


def _check_shards(shard: int, num_shards: int) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be an int in [0, {num_shards}), got {shard!r}")


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _step_seed(seed: int, shard: int, num_shards: int, step: int) -> int:
    packed = struct.pack("<qqqq", seed, shard, num_shards, step)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"swarmd-batch").digest()
    return int.from_bytes(digest, "big") >> 1  # torch seeds must fit in int64


class TokenSource:
    """A training token stream and a validation token stream (1-D integer tensors).

    The tensors may be memory-mapped (uint16 `.bin` files); windows are converted to int64
    only when a batch is cut, so a large file never has to fit in memory.
    """

    def __init__(
        self, name: str, train: torch.Tensor, validation: torch.Tensor, vocab_size: int
    ) -> None:
        if train.dim() != 1 or validation.dim() != 1:
            raise DataError(f"{name}: token streams must be 1-D")
        if train.numel() == 0 or validation.numel() == 0:
            raise DataError(f"{name}: empty corpus (no training or no validation tokens)")
        self.name = name
        self.train_tokens = train
        self.validation_tokens = validation
        self.vocab_size = _check_positive("vocab_size", vocab_size)

    @classmethod
    def from_stream(
        cls,
        name: str,
        tokens: torch.Tensor,
        vocab_size: int,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ) -> TokenSource:
        """Split one stream: the last `val_fraction` (at least one token) is validation."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        n = tokens.numel()
        if n < 2:
            raise DataError(f"{name}: empty corpus ({n} tokens)")
        n_val = min(n - 1, max(1, math.ceil(n * val_fraction)))
        return cls(name, tokens[: n - n_val], tokens[n - n_val :], vocab_size)

    def __repr__(self) -> str:
        return (
            f"TokenSource({self.name!r}, train={self.train_tokens.numel()} tokens, "
            f"validation={self.validation_tokens.numel()} tokens, vocab={self.vocab_size})"
        )

    def shard_range(self, shard: int, num_shards: int) -> tuple[int, int]:
        """[start, end) of a shard in the training stream: contiguous, disjoint, near-equal."""
        _check_shards(shard, num_shards)
        n = self.train_tokens.numel()
        return (shard * n) // num_shards, ((shard + 1) * n) // num_shards

    def train_batch(
        self,
        shard: int,
        num_shards: int,
        batch_size: int,
        block_size: int,
        seed: int,
        step: int,
    ) -> Batch:
        """Batch number `step` of a shard: `batch_size` random windows inside the shard.

        Returns (x, y), both int64 (batch_size, block_size), y shifted by one token.
        """
        _check_positive("batch_size", batch_size)
        _check_positive("block_size", block_size)
        lo, hi = self.shard_range(shard, num_shards)
        span = hi - lo - block_size  # number of valid window starts
        if span < 1:
            raise DataError(
                f"{self.name}: shard {shard}/{num_shards} has {hi - lo} training tokens, fewer "
                f"than block_size + 1 = {block_size + 1} (corpus has "
                f"{self.train_tokens.numel()} training tokens; use fewer shards, a shorter "
                "block or a larger corpus)"
            )
        gen = torch.Generator().manual_seed(_step_seed(seed, shard, num_shards, step))
        starts = torch.randint(lo, lo + span, (batch_size,), generator=gen)
        return self._cut(self.train_tokens, starts, block_size)

    def train_batches(
        self,
        shard: int,
        num_shards: int,
        batch_size: int,
        block_size: int,
        seed: int,
        start_step: int = 0,
    ) -> Iterator[Batch]:
        """Endless `train_batch` for steps `start_step`, `start_step + 1`, ..."""
        step = start_step
        while True:
            yield self.train_batch(shard, num_shards, batch_size, block_size, seed, step)
            step += 1

    def validation_batches(
        self, batch_size: int, block_size: int, max_batches: int | None = None
    ) -> list[Batch]:
        """Consecutive non-overlapping windows of the validation split, in order.

        No randomness: every peer evaluates on exactly the same tokens, so validation losses
        are comparable across peers and runs. `max_batches` bounds evaluation cost.
        """
        _check_positive("batch_size", batch_size)
        _check_positive("block_size", block_size)
        n = self.validation_tokens.numel()
        windows = (n - 1) // block_size
        if windows < 1:
            raise DataError(
                f"{self.name}: validation split has {n} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}"
            )
        nbatches = math.ceil(windows / batch_size)
        if max_batches is not None:
            nbatches = min(nbatches, _check_positive("max_batches", max_batches))
        out = []
        for b in range(nbatches):
            first = b * batch_size
            count = min(batch_size, windows - first)
            starts = torch.arange(first, first + count) * block_size
            out.append(self._cut(self.validation_tokens, starts, block_size))
        return out

    def _cut(self, tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> Batch:
        index = starts.unsqueeze(1) + torch.arange(block_size + 1)
        windows = tokens[index].to(torch.int64)
        if windows.numel() and int(windows.max()) >= self.vocab_size:
            raise DataError(
                f"{self.name}: token id {int(windows.max())} >= vocab_size {self.vocab_size}"
            )
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def fingerprint(self) -> str:
        """BLAKE2b-256 over both streams (one pass over the data): peers that must share a
        validation split compare this."""
        h = hashlib.blake2b(digest_size=32, person=b"swarmd-corpus")
        for tokens in (self.train_tokens, self.validation_tokens):
            h.update(struct.pack("<q", tokens.numel()))
            for i in range(0, tokens.numel(), _SCAN_CHUNK):
                chunk = tokens[i : i + _SCAN_CHUNK]
                buf = bytearray(4 * chunk.numel())  # torch-only (no numpy): copy into bytes
                torch.frombuffer(buf, dtype=torch.int32).copy_(chunk)
                h.update(buf)
        return h.hexdigest()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@lru_cache(maxsize=4)
def _stdlib_bytes(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"built-in corpus: Python standard library not found at {root}")
    paths: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                p = Path(dirpath) / f
                paths.append((p.relative_to(root).as_posix(), p))
    paths.sort()
    parts: list[bytes] = []
    total = 0
    for _, p in paths:
        if total >= max_bytes:
            break
        data = p.read_bytes()[: max_bytes - total]
        parts.append(data)
        total += len(data)
    return b"".join(parts)


def builtin_corpus(
    max_bytes: int = DEFAULT_BUILTIN_BYTES, val_fraction: float = DEFAULT_VAL_FRACTION
) -> TokenSource:
    """Bytes of the standard library's `.py` files, sorted by relative path, capped at
    `max_bytes`. Nothing is downloaded: the files ship with Python itself."""
    _check_positive("max_bytes", max_bytes)
    data = _stdlib_bytes(max_bytes)
    if not data:
        raise DataError("built-in corpus: no .py files found in the standard library")
    return TokenSource.from_stream("builtin:stdlib", _bytes_tensor(data), BYTE_VOCAB, val_fraction)


def _text_files(root: Path) -> list[Path]:
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            p = Path(dirpath) / f
            if not f.startswith(".") and p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    return [p for _, p in sorted(found)]


def text_source(
    path: str | os.PathLike[str], val_fraction: float = DEFAULT_VAL_FRACTION
) -> TokenSource:
    """A text file, or every non-hidden file under a directory in sorted path order, as bytes.

    The files are read into memory: this is meant for corpora of up to a few hundred MB; larger
    ones belong in a pre-tokenised `.bin`.
    """
    p = Path(path)
    if p.is_dir():
        files = _text_files(p)
        if not files:
            raise DataError(f"text corpus {p}: directory has no (non-hidden) files")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"text corpus {p}: no such file or directory")
    data = b"".join(f.read_bytes() for f in files)
    if not data:
        raise DataError(f"text corpus {p}: empty corpus (0 bytes in {len(files)} file(s))")
    return TokenSource.from_stream(f"text:{p}", _bytes_tensor(data), BYTE_VOCAB, val_fraction)


def _open_bin(path: Path, vocab_size: int, check_tokens: bool) -> torch.Tensor:
    if not path.is_file():
        raise DataError(f"token file {path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {path}: empty corpus (0 bytes)")
    if size % 2:
        raise DataError(f"token file {path}: size {size} is odd, so it is not a uint16 token file")
    tokens = torch.from_file(str(path), shared=False, size=size // 2, dtype=torch.uint16)
    if check_tokens:
        for i in range(0, tokens.numel(), _SCAN_CHUNK):
            top = int(tokens[i : i + _SCAN_CHUNK].to(torch.int32).max())
            if top >= vocab_size:
                raise DataError(
                    f"token file {path}: token id {top} >= vocab_size {vocab_size} (wrong "
                    "vocab_size, or not a nanoGPT uint16 .bin)"
                )
    return tokens


def bin_source(
    path: str | os.PathLike[str],
    vocab_size: int = GPT2_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    check_tokens: bool = True,
) -> TokenSource:
    """nanoGPT-style raw little-endian uint16 tokens, memory-mapped.

    `path` is a `.bin` file (its last `val_fraction` is validation) or a directory with
    `train.bin` and `val.bin`. `check_tokens` scans the whole file once for ids outside the
    vocabulary, so a mismatch fails at start-up instead of as an index error mid-run; batches
    are checked regardless.
    """
    if not 1 <= vocab_size <= UINT16_VOCAB:
        raise ValueError(f"vocab_size for uint16 tokens must be in [1, 65536], got {vocab_size}")
    p = Path(path)
    if p.is_dir():
        train, val = p / "train.bin", p / "val.bin"
        if not train.is_file() or not val.is_file():
            raise DataError(f"token directory {p}: expected train.bin and val.bin in it")
        return TokenSource(
            f"bin:{p}",
            _open_bin(train, vocab_size, check_tokens),
            _open_bin(val, vocab_size, check_tokens),
            vocab_size,
        )
    tokens = _open_bin(p, vocab_size, check_tokens)
    return TokenSource.from_stream(f"bin:{p}", tokens, vocab_size, val_fraction)


def load_source(spec: str, *, vocab_size: int | None = None) -> TokenSource:
    """What a `--data` option names: `builtin`, a `.bin` file or nanoGPT directory, or text.

    A directory counts as nanoGPT's when it holds `train.bin`; `vocab_size` only applies to
    `.bin` data (byte-level sources always have 256).
    """
    p = Path(spec)
    if (p.is_dir() and (p / "train.bin").is_file()) or p.suffix == ".bin":
        return bin_source(p, vocab_size or GPT2_VOCAB)
    if vocab_size is not None and vocab_size != BYTE_VOCAB:
        raise ValueError(
            f"{spec or 'builtin'}: byte-level data has vocab_size 256, not {vocab_size}"
        )
    if spec in ("", "builtin", "stdlib"):
        return builtin_corpus()
    return text_source(p)
