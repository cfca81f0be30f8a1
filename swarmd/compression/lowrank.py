"""PowerSGD: rank-r approximation M ~ P Q^T by one warm-started power-iteration step.

The all-reduce happens *inside* the algorithm: peers sum P = M Q (phase 1), each
orthogonalises the same reduced P, then peers average Q = M^T P (phase 2). Because both
phases are linear in M, the result approximates the average of every peer's matrix while
only (n + m) * r numbers per peer cross the network. `PowerSGDRound` exposes those two
phases so the averaging layer can run the reductions between peers.

Q must be identical on every peer at the start of a round: it starts from a seed derived
from (config seed, tensor name), then is warm-started from the *averaged* Q of the previous
round. Error feedback uses each peer's own reconstruction P (M^T P)^T, as in the paper.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarmd.compression.buffers import byte_view, check_float_input, from_bytes, require_finite
from swarmd.compression.error_feedback import ResidualStore
from swarmd.compression.errors import CompressionError
from swarmd.compression.raw import RawCodec
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
_PARAMS = struct.Struct("<I")


@dataclass(frozen=True)
class PowerSGDConfig:
    """`min_compression_ratio`: a matrix n x m is compressed only if n*m exceeds
    ratio * (n + m) * r (1.0: "only if it shrinks"; 0.0: every matrix, useful for tests)."""

    rank: int = 4
    min_compression_ratio: float = 1.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGDConfig.rank must be an int >= 1, got {self.rank!r}")
        ratio = self.min_compression_ratio
        if not isinstance(ratio, int | float) or not math.isfinite(ratio) or ratio < 0:
            raise ValueError(
                f"PowerSGDConfig.min_compression_ratio must be finite and >= 0, got {ratio!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"PowerSGDConfig.seed must be an int >= 0, got {self.seed!r}")


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """How a tensor is viewed as a matrix: first dim x the rest (as torch's hook does)."""
    return shape[0], math.prod(shape[1:])


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns (reduced QR; no NaN on zero or dependent columns)."""
    q: torch.Tensor = torch.linalg.qr(matrix, mode="reduced").Q
    return q


class PowerSGDRound:
    """One tensor, one round. Use::

        rnd = powersgd.begin(name, grad)
        if rnd.passthrough:
            mean = finish(all_reduce_mean(rnd.dense))     # 1-D or would not shrink
        else:
            q = rnd.compute_q(all_reduce_sum(rnd.p))      # phase 1: P, n x r
            mean = rnd.finish(all_reduce_mean(q))         # phase 2: Q, m x r

    Summing or averaging P makes no difference (it is orthogonalised); Q must be averaged.
    """

    def __init__(
        self,
        owner: PowerSGD,
        key: str,
        tensor: torch.Tensor,
        matrix: torch.Tensor | None,
        q: torch.Tensor | None,
    ) -> None:
        self._owner = owner
        self.key = key
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self._m = matrix
        self._q = q
        self._p_hat: torch.Tensor | None = None
        self._stage = 0
        self.passthrough = matrix is None
        self.dense: torch.Tensor | None = tensor if matrix is None else None
        self.p: torch.Tensor | None = None if matrix is None or q is None else matrix @ q

    @property
    def rank(self) -> int:
        return 0 if self._q is None else self._q.shape[1]

    def compute_q(self, p_reduced: torch.Tensor) -> torch.Tensor:
        """Phase 2 input: orthogonalise the reduced P, return this peer's Q = M^T P."""
        if self.passthrough or self._m is None or self._stage != 0:
            raise RuntimeError("compute_q() is called once, on a compressed round, first")
        expected = (self._m.shape[0], self.rank)
        _check_factor(p_reduced, expected, "reduced P")
        p_hat = orthogonalize(p_reduced.to(torch.float32))
        q_local = self._m.T @ p_hat
        if self._owner.config.error_feedback:
            self._owner.residuals.record(
                self.key, self._m.reshape(self.shape), (p_hat @ q_local.T).reshape(self.shape)
            )
        self._p_hat = p_hat
        self._stage = 1
        return q_local

    def finish(self, reduced: torch.Tensor) -> torch.Tensor:
        """The decompressed average, in the input's shape and dtype.

        `reduced` is the averaged Q (m x r), or the averaged dense tensor on pass-through.
        """
        if self.passthrough:
            if tuple(reduced.shape) != self.shape:
                raise CompressionError(
                    f"reduced tensor has shape {tuple(reduced.shape)}, expected {self.shape}"
                )
            require_finite(reduced, "reduced dense tensor")
            self._stage = 2
            return reduced.to(self.dtype)
        if self._stage != 1 or self._p_hat is None:
            raise RuntimeError("finish() is called once, after compute_q()")
        assert self._m is not None
        _check_factor(reduced, (self._m.shape[1], self.rank), "reduced Q")
        q_mean = reduced.to(torch.float32)
        if self._owner.config.warm_start:
            self._owner.q_state[self.key] = q_mean.clone()
        self._stage = 2
        return (self._p_hat @ q_mean.T).reshape(self.shape).to(self.dtype)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P-hat, local Q) after `compute_q`; what the single-peer wire format carries."""
        if self._p_hat is None or self._m is None:
            raise RuntimeError("factors() needs compute_q() first")
        return self._p_hat, self._m.T @ self._p_hat


def _check_factor(t: torch.Tensor, shape: tuple[int, int], what: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CompressionError(f"{what} has shape {got}, expected {shape}")
    check_float_input(t)
    require_finite(t, what)


class PowerSGD:
    """Stateful low-rank compressor: warm-start Q per tensor name, plus residuals."""

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        self.config = config or PowerSGDConfig()
        self.q_state: dict[str, torch.Tensor] = {}
        self.residuals = ResidualStore()

    def compresses(self, shape: tuple[int, ...]) -> bool:
        """1-D tensors, empty ones, and those that would not shrink pass through."""
        if len(shape) < 2 or math.prod(shape) == 0:
            return False
        n, m = matrix_shape(shape)
        r = min(self.config.rank, n, m)
        return n * m > self.config.min_compression_ratio * (n + m) * r

    def begin(self, key: str, tensor: torch.Tensor) -> PowerSGDRound:
        check_float_input(tensor)
        tensor = tensor.detach().cpu()
        require_finite(tensor, f"PowerSGD input {key!r}")
        shape = tuple(tensor.shape)
        if not self.compresses(shape):
            return PowerSGDRound(self, key, tensor, None, None)
        n, m = matrix_shape(shape)
        if self.config.error_feedback:
            compensated = self.residuals.compensate(key, tensor)
        else:
            compensated = tensor.to(torch.float32)
        matrix = compensated.reshape(n, m)
        r = min(self.config.rank, n, m)
        q = self.q_state.get(key) if self.config.warm_start else None
        if q is None or tuple(q.shape) != (m, r):
            q = self._initial_q(key, m, r)
        return PowerSGDRound(self, key, tensor, matrix, orthogonalize(q))

    def _initial_q(self, key: str, m: int, r: int) -> torch.Tensor:
        """Same on every peer: seeded by (seed, name), never by process-local hashing."""
        digest = hashlib.blake2b(f"{self.config.seed}:{key}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        return torch.randn(m, r, generator=gen, dtype=torch.float32)

    def encode(self, key: str, tensor: torch.Tensor) -> bytes:
        """Single-peer use (no all-reduce): the factors on the wire, decodable statelessly."""
        rnd = self.begin(key, tensor)
        if rnd.passthrough:
            return RawCodec().encode(tensor)
        assert rnd.p is not None
        q = rnd.compute_q(rnd.p)
        p_hat, _ = rnd.factors()
        rnd.finish(q)
        params = _PARAMS.pack(rnd.rank)
        header = pack_header(CodecId.LOWRANK, VERSION, tensor.dtype, rnd.shape, params)
        return b"".join((header, byte_view(p_hat), byte_view(q)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map ("q:<name>", "error:<name>"), torch.save friendly."""
        state = {f"q:{k}": v.clone() for k, v in self.q_state.items()}
        state.update({f"error:{k}": v for k, v in self.residuals.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        qs: dict[str, torch.Tensor] = {}
        errors: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            kind, sep, key = name.partition(":")
            if not sep or kind not in ("q", "error"):
                raise CompressionError(f"unexpected PowerSGD state entry {name!r}")
            check_float_input(value)
            require_finite(value, f"PowerSGD state {name!r}")
            if kind == "q":
                if value.dim() != 2:
                    raise CompressionError(f"PowerSGD state {name!r} must be 2-D")
                qs[key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True)
            else:
                errors[key] = value
        self.residuals.load_state_dict(errors)
        self.q_state = qs

    def reset(self, key: str | None = None) -> None:
        """Forget Q and residuals (e.g. when the peer group changes and Qs diverged)."""
        if key is None:
            self.q_state.clear()
        else:
            self.q_state.pop(key, None)
        self.residuals.reset(key)


class LowRankCodec:
    """Stateless decoder for `PowerSGD.encode` payloads (encoding needs `PowerSGD` state)."""

    codec_id = CodecId.LOWRANK

    def decode(self, data: bytes | bytearray | memoryview, limits: DecodeLimits) -> torch.Tensor:
        return decode_lowrank(parse_header(data, limits), data)


def decode_lowrank(header: Header, data: bytes | bytearray | memoryview) -> torch.Tensor:
    expect(header, CodecId.LOWRANK, VERSION, _PARAMS.size)
    expect_float(header)
    if len(header.shape) < 2:
        raise CompressionError(f"LOWRANK payload declares a {len(header.shape)}-D shape")
    (rank,) = _PARAMS.unpack(header.params)
    n, m = matrix_shape(header.shape)
    if not 1 <= rank <= min(n, m):
        raise CompressionError(f"LOWRANK rank {rank} invalid for a {n} x {m} matrix")
    body = payload(data, header, 4 * rank * (n + m))
    p = from_bytes(body[: 4 * rank * n], torch.float32, rank * n).view(n, rank)
    q = from_bytes(body[4 * rank * n :], torch.float32, rank * m).view(m, rank)
    require_finite(p, "LOWRANK P")
    require_finite(q, "LOWRANK Q")
    out = (p @ q.T).reshape(header.shape)
    require_finite(out, "LOWRANK reconstruction")
    return out.to(header.dtype)
